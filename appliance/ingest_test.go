package appliance

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/appliance/metrics"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// TestIngestThroughDaemon: trigger datagrams matching an ingest rule reach
// a consumer of the configured ring, complete and in order, and the
// daemon's metrics count them — on the XDP path and on the AF_PACKET
// fallback alike. The senders are connected sockets, so a kernel that saw
// the datagrams would answer with port unreachable and make the next send
// fail: the fallback must hide them.
func TestIngestThroughDaemon(t *testing.T) {
	for _, path := range []string{"auto", "afpacket", "realtime"} {
		t.Run(path, func(t *testing.T) {
			tp := newTopo(t)
			switch path {
			case "auto":
			case "realtime":
				// The XDP path with the engine's loops at SCHED_FIFO 17.
				tp.iface = ", ingest_priority: 17"
			default:
				tp.iface = ", attach: strict, path: " + path
			}
			ingestThroughDaemon(t, tp, path)
		})
	}
}

func ingestThroughDaemon(t *testing.T, tp *topo, path string) {
	// A buffer per datagram and more: the consumer may not run before the
	// burst is over (a real-time engine loop holds one of CI's two CPUs
	// while windows are open), and this test is about nothing being lost.
	c := tp.config(t, `ingest:
  - {name: trigger, buffers: 256, buffer_size: 64K, window: 2ms}
rules:
  - {id: 2, name: trigger, match: {protocol: udp, dst_port: 9000-9003}, action: ingest, ingest: trigger}
`)
	d := tp.start(t, c, io.Discard)
	defer d.Close()
	if path == "realtime" {
		// The topology's veth has one queue: one engine loop.
		if n := len(testenv.FIFOThreads(t, 17)); n != 1 {
			t.Errorf("%d threads at SCHED_FIFO 17, want the engine's one loop", n)
		}
	}
	cons, err := ingest.Open(IngestPath(c, "trigger"), ingest.ConsumerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer cons.Close()
	if id := cons.Info().BufferID; id != 1 {
		t.Errorf("buffer id %d, want 1", id)
	}

	// Resolve the neighbour first: while ARP is pending the kernel queues
	// the burst and drops its oldest datagrams beyond unres_qlen_bytes.
	if _, err := tp.outside.Ping(tp.v.A.Addr4.Addr(), 1, 3*time.Second); err != nil {
		t.Fatal(err)
	}
	const perPort = 50
	for p := range 2 {
		err := tp.outside.Do(func() error {
			s, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(tp.v.A.Addr4.Addr(), uint16(9000+p))))
			if err != nil {
				return err
			}
			defer s.Close()
			for i := range perPort {
				if _, err := s.Write([]byte(fmt.Sprintf("port %d datagram %03d", 9000+p, i))); err != nil {
					return fmt.Errorf("datagram %d to port %d: %w", i, 9000+p, err)
				}
				if path == "afpacket" && i%10 == 9 {
					time.Sleep(time.Millisecond) // room for the kernel's answer, if it gave one
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	next := map[uint16]int{} // per destination port, the next datagram expected
	total := 0
	for deadline := time.Now().Add(5 * time.Second); total < 2*perPort && time.Now().Before(deadline); {
		b, err := cons.Next(500 * time.Millisecond)
		if err == ingest.ErrTimeout {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		for it := b.Iter(); it.Next(); {
			r := it.Record()
			src, ok := cons.Source(r.Source)
			if !ok {
				t.Fatalf("record with unknown source %d", r.Source)
			}
			port := src.DstPort
			if want := fmt.Sprintf("port %d datagram %03d", port, next[port]); string(r.Payload) != want {
				t.Fatalf("record %q, want %q (%s)", r.Payload, want, tp.ingestDrops(t, d))
			}
			next[port]++
			total++
		}
		cons.Release(&b)
	}
	if total != 2*perPort {
		t.Fatalf("%d of %d datagrams reached the consumer (%s)", total, 2*perPort, tp.ingestDrops(t, d))
	}
	s := tp.scrape(t, d)
	if path == "afpacket" {
		if v := value(t, s, "fabricbridge_attach_mode", "interface", tp.v.A.Name, "mode", "afpacket"); v != 1 {
			t.Errorf("not on the AF_PACKET path")
		}
	}
	if v := value(t, s, "fabricbridge_ingest_records_total", "ring", "trigger"); v != 2*perPort {
		t.Errorf("ring counted %v records", v)
	}
	if v := value(t, s, "fabricbridge_ingest_consumer_attached", "ring", "trigger"); v != 1 {
		t.Errorf("consumer not reported attached")
	}
	// Every published buffer is timed to publication; every released one
	// to its release once the engine has looked (at least every 100ms).
	published := value(t, s, "fabricbridge_ingest_buffers_published_total", "ring", "trigger")
	if v := value(t, s, "fabricbridge_ingest_wire_to_publish_seconds_count", "ring", "trigger"); published == 0 || v != published {
		t.Errorf("%v buffers timed to publication, %v published", v, published)
	}
	if v := value(t, s, "fabricbridge_ingest_latency_budget_seconds", "ring", "trigger"); v != config.DefaultIngestBudget.Seconds() {
		t.Errorf("latency budget %v s, want the default", v)
	}
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		v := value(t, tp.scrape(t, d), "fabricbridge_ingest_publish_to_release_seconds_count", "ring", "trigger")
		if v == published {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("%v buffers timed to release, %v published and released", v, published)
			break
		}
	}
	if v := value(t, s, "fabricbridge_rule_packets_total", "id", "2"); v != 2*perPort {
		t.Errorf("rule 2 counted %v", v)
	}
	if path == "realtime" {
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		if n := len(testenv.FIFOThreads(t, 17)); n != 0 {
			t.Errorf("%d threads left at SCHED_FIFO 17 after the daemon stopped", n)
		}
	}
}

// ingestDrops says where lost trigger datagrams went, for failure messages.
func (tp *topo) ingestDrops(t *testing.T, d *Daemon) string {
	s := tp.scrape(t, d)
	var out []string
	for _, x := range metrics.Find(s, "fabricbridge_ingest_drops_total") {
		out = append(out, fmt.Sprintf("ring drops %v: %v", x.Labels, x.Value))
	}
	for _, x := range metrics.Find(s, "fabricbridge_ingest_engine_frames_total") {
		out = append(out, fmt.Sprintf("engine %v: %v", x.Labels, x.Value))
	}
	return strings.Join(out, "; ")
}

package fabric

import (
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"golang.org/x/sys/unix"
)

// A remote application's stream served by the bridge, in the two shapes
// the appliance has had, measured in the same run over the same veth
// between two namespaces (root needed):
//
//	go test -run '^$' -bench RemoteBridgeGoodput -benchtime 3000x ./fabric/
//
// relayed: the bridge serves a shm stream pair whose application end two
// goroutines splice to the RemoteStream (the old appliance relay): one
// more copy and two more hand-offs per packet on the bridge host.
// direct: the bridge serves the RemoteStream's own bridge end.
//
// to-app offers batches of 64 packets of 1400 bytes as the bridge's RX
// dispatcher would (what is dropped is offered again a little later) and
// counts what the remote application receives; from-app has the application send them and
// drains them as the bridge's TX side does (EventQueue, TryRecv). Beside
// the rate each reports the process's CPU time per packet (both ends and
// both Remote loops: the shapes differ only in what the bridge host does),
// which the other tenants of a shared machine disturb less than the rate.

// relay splices a stream pair's application end to rs, one goroutine each
// way, and returns the pair's bridge end for the bridge to serve.
func relay(b testing.TB, rs *RemoteStream) BridgeEnd {
	br, app, err := NewPair(Config{})
	if err != nil {
		b.Fatal(err)
	}
	pump := func(recv, send func([][]byte) (int, error)) {
		bufs := mkBufs(64, 2048)
		for {
			for i := range bufs {
				bufs[i] = bufs[i][:cap(bufs[i])]
			}
			n, err := recv(bufs)
			if n > 0 {
				if _, err := send(bufs[:n]); err != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	go pump(app.Recv, rs.Send)
	go pump(rs.Recv, app.Send)
	b.Cleanup(func() { app.Close(); br.Close() })
	return br
}

// cpuTime is the CPU time (user and system) this process has used.
func cpuTime() time.Duration {
	var ru unix.Rusage
	unix.Getrusage(unix.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func BenchmarkRemoteBridgeGoodput(b *testing.B) {
	testenv.RequirePrivileged(b)
	const batch, size = 64, 1400
	pkts := make([][]byte, batch)
	for i := range pkts {
		pkts[i] = ipPkt(make([]byte, size), false, uint32(i), size)
	}
	for _, dir := range []string{"to-app", "from-app"} {
		for _, shape := range []string{"relayed", "direct"} {
			b.Run(dir+"/"+shape, func(b *testing.B) {
				x := newRemotes(b, false, RemoteConfig{}, RemoteConfig{})
				sa, sb := x.pair(b, 20)
				var end BridgeEnd = sa.Bridge()
				if shape == "relayed" {
					end = relay(b, sa)
				}
				q := queueOf(b, end)
				out := mkBufs(batch, 2048)
				want := b.N * batch
				errc := make(chan error, 1)
				b.SetBytes(batch * size)
				b.ResetTimer()
				start, cpu0 := time.Now(), cpuTime()
				if dir == "to-app" {
					go func() {
						for range b.N {
							for left := pkts; len(left) > 0; {
								n, err := end.SendMeta(left, nil)
								if err != nil {
									errc <- err
									return
								}
								if left = left[n:]; len(left) > 0 {
									// As the wire would, leave the receiver
									// time instead of spinning.
									time.Sleep(20 * time.Microsecond)
								}
							}
						}
						errc <- nil
					}()
					for got := 0; got < want; {
						n, err := sb.RecvTimeout(out, 5*time.Second)
						if err != nil {
							b.Fatalf("after %d of %d: %v", got, want, err)
						}
						got += n
					}
				} else {
					go func() {
						for range b.N {
							if _, err := sb.Send(pkts); err != nil {
								errc <- err
								return
							}
						}
						errc <- nil
					}()
					toks := make([]int, 4)
					for got := 0; got < want; {
						k, err := q.Wait(toks, 5*time.Second)
						if err != nil || k == 0 {
							b.Fatalf("after %d of %d: %v", got, want, err)
						}
						n, err := q.Stream(toks[0]).TryRecv(out)
						if err != nil {
							b.Fatal(err)
						}
						got += n
					}
				}
				el, cpu := time.Since(start), cpuTime()-cpu0
				b.StopTimer()
				if err := <-errc; err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(want)*size*8/el.Seconds()/1e9, "Gbit/s")
				b.ReportMetric(float64(cpu.Nanoseconds())/float64(want), "cpu-ns/packet")
			})
		}
	}
}

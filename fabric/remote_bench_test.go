package fabric

import (
	"fmt"
	"testing"
	"time"
	"unsafe"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"golang.org/x/sys/unix"
)

// The remote transport against plain UDP, measured in the same run over
// the same veth between two namespaces (root needed):
//
//	go test -run '^$' -bench 'Remote' -benchtime 200000x ./fabric/
//
// One stream, one direction, one sending and one receiving goroutine,
// batches of 64. The baseline is what the transport is built on: a UDP
// socket sending the same datagrams (inner packet plus 8 bytes, the size
// of the GENEVE header) with sendmmsg, and another receiving them with
// recvmmsg, batches of 64, no flow control. Packets of 64 and 1400 bytes
// (1400 + 36 bytes of GENEVE/UDP/IPv4 headers fit the 1500-byte MTU).

// udpBaseline sends n datagrams of size bytes from one namespace's
// socket to the other's and returns the rate at which they were received
// and how many were lost (UDP has no flow control: the sender may outrun
// the receiver).
func udpBaseline(b *testing.B, x *remotes, n, size int) (rate float64, lost int) {
	var tx, rx int
	if err := x.b.Do(func() (err error) {
		tx, err = rawSocket(x.addrB, false)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer unix.Close(tx)
	if err := x.a.Do(func() (err error) {
		rx, err = rawSocket(x.addrA, false)
		return err
	}); err != nil {
		b.Fatal(err)
	}
	defer unix.Close(rx)
	unix.SetsockoptInt(rx, unix.SOL_SOCKET, unix.SO_RCVBUF, 4<<20)
	unix.SetsockoptInt(tx, unix.SOL_SOCKET, unix.SO_SNDBUF, 4<<20)
	sa, _ := unix.Getsockname(rx)
	dst := makeRawName(addrPortOf(sa), false)

	var smsgs, rmsgs [remoteBatch]unix.Mmsghdr
	var siov, riov [remoteBatch]unix.Iovec
	payload := make([]byte, size)
	rbufs := mkBufs(remoteBatch, 2048)
	for i := range smsgs {
		siov[i].Base = &payload[0]
		siov[i].SetLen(size)
		smsgs[i].Hdr.Iov = &siov[i]
		smsgs[i].Hdr.SetIovlen(1)
		smsgs[i].Hdr.Name = (*byte)(unsafe.Pointer(&dst.sa))
		smsgs[i].Hdr.Namelen = dst.len
		riov[i].Base = &rbufs[i][0]
		riov[i].SetLen(len(rbufs[i]))
		rmsgs[i].Hdr.Iov = &riov[i]
		rmsgs[i].Hdr.SetIovlen(1)
	}
	start := time.Now()
	go func() {
		for sent := 0; sent < n; {
			k := min(remoteBatch, n-sent)
			m, _, errno := unix.Syscall6(unix.SYS_SENDMMSG, uintptr(tx), uintptr(unsafe.Pointer(&smsgs[0])), uintptr(k), 0, 0, 0)
			if errno == 0 {
				sent += int(m)
			}
		}
	}()
	got := 0
	last := start
	pfd := []unix.PollFd{{Fd: int32(rx), Events: unix.POLLIN}}
	for got < n {
		if k, _ := unix.Poll(pfd, 100); k == 0 {
			break // the rest was lost
		}
		m, _, errno := unix.Syscall6(unix.SYS_RECVMMSG, uintptr(rx), uintptr(unsafe.Pointer(&rmsgs[0])), remoteBatch, unix.MSG_DONTWAIT, 0, 0)
		if errno == 0 {
			got += int(m)
			last = time.Now()
		}
	}
	return float64(got) / last.Sub(start).Seconds(), n - got
}

// remoteRate sends n packets of size bytes over one stream from B to A.
func remoteRate(b *testing.B, x *remotes, vni uint32, n, size int) float64 {
	sa, sb := x.pair(b, vni)
	defer sa.Close()
	defer sb.Close()
	errc := make(chan error, 1)
	start := time.Now()
	go func() { errc <- sendSeq(sb, false, 0, n, size) }()
	out := mkBufs(64, 2048)
	for got := 0; got < n; {
		k, err := sa.RecvTimeout(out, 5*time.Second)
		if err != nil {
			b.Fatalf("after %d: %v", got, err)
		}
		got += k
	}
	el := time.Since(start)
	if err := <-errc; err != nil {
		b.Fatal(err)
	}
	return float64(n) / el.Seconds()
}

func BenchmarkRemote(b *testing.B) {
	testenv.RequirePrivileged(b)
	for _, size := range []int{64, 1400} {
		for _, off := range []struct {
			name  string
			plain bool
		}{{"gso+gro", false}, {"plain", true}} {
			b.Run(fmt.Sprintf("size=%d/%s", size, off.name), func(b *testing.B) {
				cfg := RemoteConfig{NoGSO: off.plain, NoGRO: off.plain}
				x := newRemotes(b, false, cfg, cfg)
				base, lost := udpBaseline(b, x, max(b.N, 100000), size+geneveHdrLen)
				b.ResetTimer()
				r := remoteRate(b, x, 1, b.N, size)
				b.StopTimer()
				c := x.rb.Counters()
				b.ReportMetric(r, "pkts/s")
				b.ReportMetric(r*float64(size)*8/1e9, "Gbit/s")
				b.ReportMetric(base, "udp-pkts/s")
				b.ReportMetric(r/base, "x-udp")
				b.ReportMetric(float64(lost), "udp-lost")
				b.ReportMetric(float64(c.SentSegmented), "gso-sends")
				b.ReportMetric(0, "ns/op")
			})
		}
	}
}

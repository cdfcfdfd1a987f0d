package appliance

import (
	"context"
	"io"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/userstack"
)

// TestMTUDropDuringDownload: the served interface's MTU (and its peer's)
// goes from 1500 to 1280 in the middle of a download from an application;
// the daemon tells the application, whose stack cuts its segments to the
// new MTU, and the download completes, byte for byte. Without that, every
// full-size segment is refused on transmit (tx_rejects{reason="mtu"}) and
// the download stalls.
func TestMTUDropDuringDownload(t *testing.T) {
	tp := newTopo(t)
	d := tp.start(t, tp.config(t, ""), io.Discard)
	defer d.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := userstack.Open(ctx, userstack.Options{App: "download", Control: d.Config().Control.Socket})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ln, err := st.Listen("tcp", ":8080")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	const size = 64 << 20
	pattern := func(i int) byte { return byte(i*7 + i>>12) }
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 64<<10)
		for off := 0; off < size; off += len(buf) {
			for i := range buf {
				buf[i] = pattern(off + i)
			}
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	var c net.Conn
	if err := tp.outside.Do(func() (err error) {
		c, err = net.DialTimeout("tcp", netip.AddrPortFrom(tp.v.A.Addr4.Addr(), 8080).String(), 5*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(45 * time.Second))
	buf := make([]byte, 64<<10)
	got, lowered := 0, false
	for got < size {
		n, err := c.Read(buf)
		for i := range n {
			if buf[i] != pattern(got+i) {
				t.Fatalf("byte %d is %#x, want %#x", got+i, buf[i], pattern(got+i))
			}
		}
		got += n
		if !lowered && got >= 4<<20 {
			setLinkMTU(t, tp.bridge, tp.v.A.Name, 1280)
			setLinkMTU(t, tp.outside, tp.v.B.Name, 1280)
			lowered = true
		}
		if err != nil {
			t.Fatalf("after %d of %d bytes: %v", got, size, err)
		}
	}
	if !lowered {
		t.Fatal("the MTU was never lowered")
	}
}

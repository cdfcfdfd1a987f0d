package xsk

import (
	"sync/atomic"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// fakeRing lays a ring out in ordinary memory the way the kernel maps it,
// so both sides can be driven by the test.
func fakeRing(t *testing.T, size int, entry int) ([]byte, unix.XDPRingOffset) {
	t.Helper()
	off := unix.XDPRingOffset{Producer: 0, Consumer: 64, Flags: 128, Desc: 192}
	mem := make([]byte, int(off.Desc)+size*entry)
	return mem, off
}

func TestFillRingWrapsAndStopsWhenFull(t *testing.T) {
	const size = 8
	mem, off := fakeRing(t, size, 8)
	f := &FillRing{r: newRing(mem, off, size)}
	f.addrs = unsafe.Slice((*uint64)(unsafe.Pointer(&mem[off.Desc])), size)
	kernelCons := (*uint32)(unsafe.Pointer(&mem[off.Consumer]))

	next := uint64(0)
	batch := make([]uint64, 5)
	var taken []uint64
	for round := 0; round < 20; round++ {
		for i := range batch {
			batch[i] = next + uint64(i)*2048
		}
		n := f.Fill(batch)
		if got := f.Pending(); got > size {
			t.Fatalf("round %d: %d pending in a ring of %d", round, got, size)
		}
		next += uint64(n) * 2048
		// The "kernel" takes three entries per round, in order.
		c := atomic.LoadUint32(kernelCons)
		p := atomic.LoadUint32(f.r.producer)
		for k := 0; k < 3 && c != p; k++ {
			taken = append(taken, f.addrs[c&(size-1)])
			c++
		}
		atomic.StoreUint32(kernelCons, c)
	}
	for i, a := range taken {
		if a != uint64(i)*2048 {
			t.Fatalf("kernel read entry %d as %#x, want %#x (order lost across the wrap)", i, a, uint64(i)*2048)
		}
	}
	if len(taken) < 40 {
		t.Fatalf("only %d entries went through", len(taken))
	}
	// With the consumer stopped the ring fills up and refuses more.
	for f.Fill([]uint64{1}) == 1 {
	}
	if f.Pending() != size {
		t.Fatalf("full ring holds %d, want %d", f.Pending(), size)
	}
}

func TestRxRingReceivesInOrder(t *testing.T) {
	const size = 16
	mem, off := fakeRing(t, size, int(unsafe.Sizeof(Desc{})))
	x := &RxRing{r: newRing(mem, off, size)}
	x.descs = unsafe.Slice((*Desc)(unsafe.Pointer(&mem[off.Desc])), size)
	kernelProd := (*uint32)(unsafe.Pointer(&mem[off.Producer]))
	userCons := (*uint32)(unsafe.Pointer(&mem[off.Consumer]))

	produced, received := uint32(0), uint32(0)
	dst := make([]Desc, 7)
	for round := 0; round < 50; round++ {
		// The "kernel" produces as many as fit, up to 11.
		c := atomic.LoadUint32(userCons)
		for k := 0; k < 11 && produced-c < size; k++ {
			x.descs[produced&(size-1)] = Desc{Addr: uint64(produced), Len: produced + 60}
			produced++
		}
		atomic.StoreUint32(kernelProd, produced)
		n := x.Receive(dst)
		for _, d := range dst[:n] {
			if d.Addr != uint64(received) || d.Len != received+60 {
				t.Fatalf("descriptor %d arrived as %+v", received, d)
			}
			received++
		}
	}
	if received < 300 {
		t.Fatalf("only %d descriptors received", received)
	}
	if got := atomic.LoadUint32(userCons); got != received {
		t.Fatalf("consumer index %d, received %d", got, received)
	}
}

func TestUmemFreeRefusesDoubleFreeAndStrangers(t *testing.T) {
	testenv.RequirePrivileged(t) // NewUmem registers with the kernel
	u, err := NewUmem(UmemConfig{FrameCount: 16})
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	got := make([]uint64, 20)
	if n := u.Alloc(got); n != 16 {
		t.Fatalf("allocated %d of 16 frames", n)
	}
	if n := u.Alloc(got); n != 0 {
		t.Fatalf("allocated %d from an empty pool", n)
	}
	if err := u.Free(got[:4]); err != nil {
		t.Fatal(err)
	}
	if err := u.Free(got[3:5]); err == nil {
		t.Fatal("double free accepted")
	}
	if err := u.Free([]uint64{uint64(16 * 2048)}); err == nil {
		t.Fatal("free of an address past the area accepted")
	}
	a := u.Account(got[4:16])
	if err := a.Err(); err != nil || a.Free != 4 || a.Held != 12 {
		t.Fatalf("accounting %+v: %v", a, err)
	}
	a = u.Account(got[4:16], got[10:11])
	if len(a.Problems) != 1 {
		t.Fatalf("a frame listed twice gave problems %v", a.Problems)
	}
	a = u.Account(got[5:16])
	if a.InKernel != 1 || a.Err() == nil {
		t.Fatalf("a frame in no list: %+v", a)
	}
	if _, err := NewUmem(UmemConfig{FrameSize: 3000}); err == nil {
		t.Fatal("frame size 3000 accepted")
	}
}

package ingest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"
)

// TestConsumerValidatesDescriptors: a producer that writes impossible
// descriptors gets ErrCorruption, and the consumer stays stopped.
func TestConsumerValidatesDescriptors(t *testing.T) {
	le := binary.LittleEndian
	for _, c := range []struct {
		name string
		edit func(d []byte)
	}{
		{"wrong sequence", func(d []byte) { le.PutUint64(d[dSeq:], 7) }},
		{"bytes beyond the buffer", func(d []byte) { le.PutUint32(d[dBytes:], 4097) }},
		{"no records", func(d []byte) { le.PutUint32(d[dRecords:], 0) }},
		{"more records than fit", func(d []byte) { le.PutUint32(d[dRecords:], 1000) }},
		{"ends before it starts", func(d []byte) { le.PutUint64(d[dLastNs:], 1) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, cons := newPair(t, Config{Window: time.Hour})
			r.Append(srcA, Now(), []byte("payload"))
			r.Flush()
			c.edit(r.mem[r.l.desc(0):][:descSize])
			if _, err := cons.Next(time.Second); !errors.Is(err, ErrCorruption) {
				t.Fatalf("Next: %v", err)
			}
			if _, _, err := cons.Poll(); !errors.Is(err, ErrCorruption) {
				t.Fatalf("after corruption, Poll: %v", err)
			}
		})
	}
}

// TestConsumerValidatesRecords: a record that would reach outside its
// buffer, claim a payload longer than itself, name a source not in the
// table, or leave bytes unaccounted for ends the walk with ErrCorruption.
func TestConsumerValidatesRecords(t *testing.T) {
	le := binary.LittleEndian
	for _, c := range []struct {
		name string
		edit func(b []byte) // the first record of three
	}{
		{"size under the header", func(b []byte) { le.PutUint32(b[rSize:], 16) }},
		{"size not aligned", func(b []byte) { le.PutUint32(b[rSize:], 33) }},
		{"size beyond the buffer", func(b []byte) { le.PutUint32(b[rSize:], 1<<20) }},
		{"payload longer than the record", func(b []byte) { le.PutUint16(b[rPayloadLen:], 200) }},
		{"unknown source", func(b []byte) { le.PutUint16(b[rSource:], 9) }},
		{"record shorter than written", func(b []byte) { le.PutUint32(b[rSize:], 24) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			r, cons := newPair(t, Config{Window: time.Hour})
			for range 3 {
				r.Append(srcA, Now(), make([]byte, 40))
			}
			r.Flush()
			c.edit(r.mem[r.l.buffer(0):])
			b, err := cons.Next(time.Second)
			if err != nil {
				t.Fatal(err)
			}
			it := b.Iter()
			for it.Next() {
				if p := it.Record().Payload; len(p) > 40 {
					t.Fatalf("a %d-byte payload from a corrupt record", len(p))
				}
			}
			if !errors.Is(it.Err(), ErrCorruption) {
				t.Fatalf("walk ended with %v", it.Err())
			}
		})
	}
}

// TestRecordWalkNeverEscapes scribbles random bytes over a buffer and its
// record count; the walk may stop with an error but never panics or hands
// out a payload outside the buffer.
func TestRecordWalkNeverEscapes(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	data := make([]byte, 4096)
	for range 20000 {
		for i := range data {
			data[i] = 0
		}
		// A few plausible records, then damage.
		off := 0
		n := 1 + rng.IntN(8)
		for range n {
			plen := rng.IntN(100)
			size := (RecordHeader + plen + 7) &^ 7
			if off+size > len(data) {
				break
			}
			binary.LittleEndian.PutUint32(data[off:], uint32(size))
			binary.LittleEndian.PutUint16(data[off+4:], uint16(plen))
			off += size
		}
		for range 1 + rng.IntN(4) {
			data[rng.IntN(off+8)%len(data)] = byte(rng.Uint32())
		}
		b := Buffer{data: data[:off], Records: n + rng.IntN(3) - 1, sources: 1}
		it := b.Iter()
		for it.Next() {
			p := it.Record().Payload
			if len(p) > 0 {
				start := int(uintptr(unsafe.Pointer(&p[0])) - uintptr(unsafe.Pointer(&data[0])))
				if start < 0 || start+len(p) > off {
					t.Fatalf("payload at %d+%d outside %d bytes", start, len(p), off)
				}
			}
		}
	}
}

// TestScribblingConsumer: garbage in the state words makes the producer
// treat those buffers as held — it drops and counts, never writes them —
// until they read free again.
func TestScribblingConsumer(t *testing.T) {
	r, cons := newPair(t, Config{Buffers: 4, Window: time.Hour})
	mem := cons.mem // the consumer's own mapping
	for k := range 4 {
		le := binary.LittleEndian
		le.PutUint32(mem[cons.l.desc(k)+dState:], uint32(2+k))
	}
	before := bytes.Clone(mem[cons.l.buffersOff:])
	for i := range 50 {
		if r.Append(srcA, Now(), []byte{byte(i)}) {
			t.Fatal("appended into a buffer whose state is not free")
		}
	}
	r.Tick(Now())
	if !bytes.Equal(before, mem[cons.l.buffersOff:]) {
		t.Fatal("the producer wrote into buffers it does not own")
	}
	if st := r.Stats(); st.NoBuffer != 50 {
		t.Fatalf("stats %+v", st)
	}
	binary.LittleEndian.PutUint32(mem[cons.l.desc(0)+dState:], stateFree)
	if !r.Append(srcA, Now(), []byte("ok")) {
		t.Fatal("a buffer marked free again was not used")
	}
}

// TestHeaderValidation: a mapped header that disagrees with itself or with
// the mapping is refused before anything is indexed through it.
func TestHeaderValidation(t *testing.T) {
	cfg := Config{Buffers: 4, BufferSize: 4096, Window: time.Millisecond, MaxSources: 8}.withDefaults()
	l := computeLayout(cfg, false)
	good := make([]byte, l.size)
	writeHeader(good, l)
	if _, err := readHeader(good); err != nil {
		t.Fatalf("the good header: %v", err)
	}
	le := binary.LittleEndian
	for _, c := range []struct {
		name string
		edit func(b []byte) []byte
		want error
	}{
		{"magic", func(b []byte) []byte { le.PutUint32(b[hMagic:], 1); return b }, ErrBadMagic},
		{"version", func(b []byte) []byte { le.PutUint32(b[hVersion:], 2); return b }, ErrVersion},
		{"short mapping", func(b []byte) []byte { return b[:len(b)-4096] }, ErrBadLayout},
		{"too many buffers", func(b []byte) []byte { le.PutUint32(b[hBufferCount:], 5); return b }, ErrBadLayout},
		{"buffer size", func(b []byte) []byte { le.PutUint32(b[hBufferSize:], 8192); return b }, ErrBadLayout},
		{"buffers before the header ends", func(b []byte) []byte { le.PutUint64(b[hBuffersOff:], 0); return b }, ErrBadLayout},
		{"descriptors over the buffers", func(b []byte) []byte { le.PutUint64(b[hDescOff:], l.buffersOff); return b }, ErrBadLayout},
		{"sources beyond the end", func(b []byte) []byte { le.PutUint32(b[hMaxSources:], 60000); return b }, ErrBadLayout},
		{"zero window", func(b []byte) []byte { le.PutUint64(b[hWindowNs:], 0); return b }, ErrBadLayout},
		{"record alignment", func(b []byte) []byte { le.PutUint32(b[hRecordAlign:], 4); return b }, ErrBadLayout},
	} {
		b := c.edit(bytes.Clone(good))
		if _, err := readHeader(b); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
}

// TestCHeaderLayout compiles fb_ingest.h with the system C compiler and
// compares every offset and constant it declares with this package's.
func TestCHeaderLayout(t *testing.T) {
	cc, err := exec.LookPath("clang")
	if err != nil {
		if cc, err = exec.LookPath("cc"); err != nil {
			t.Skip("no C compiler to check fb_ingest.h with")
		}
	}
	dir := t.TempDir()
	src := `#include <stdio.h>
#include <stddef.h>
#include "fb_ingest.h"
#define P(s, f) printf(#s "." #f " %zu\n", offsetof(struct s, f))
int main(void) {
	P(fb_ingest_header, magic); P(fb_ingest_header, version); P(fb_ingest_header, header_len);
	P(fb_ingest_header, flags); P(fb_ingest_header, region_len); P(fb_ingest_header, buffer_count);
	P(fb_ingest_header, buffer_size); P(fb_ingest_header, desc_off); P(fb_ingest_header, sources_off);
	P(fb_ingest_header, max_sources); P(fb_ingest_header, record_align); P(fb_ingest_header, buffers_off);
	P(fb_ingest_header, window_ns); P(fb_ingest_header, buffer_id); P(fb_ingest_header, published);
	P(fb_ingest_header, source_count); P(fb_ingest_header, producer_state); P(fb_ingest_header, records);
	P(fb_ingest_header, dropped); P(fb_ingest_header, cons_armed); P(fb_ingest_header, consumer_state);
	P(fb_ingest_header, next_seq); P(fb_ingest_header, released);
	P(fb_ingest_desc, state); P(fb_ingest_desc, records); P(fb_ingest_desc, seq); P(fb_ingest_desc, bytes);
	P(fb_ingest_desc, flags); P(fb_ingest_desc, first_ns); P(fb_ingest_desc, last_ns);
	P(fb_ingest_desc, window_ns); P(fb_ingest_desc, publish_ns);
	P(fb_ingest_source, addr); P(fb_ingest_source, src_port); P(fb_ingest_source, dst_port);
	P(fb_ingest_source, flags); P(fb_ingest_source, first_ns);
	P(fb_ingest_record, size); P(fb_ingest_record, payload_len); P(fb_ingest_record, source);
	P(fb_ingest_record, rx_ns); P(fb_ingest_record, seq); P(fb_ingest_record, source_gen);
	printf("magic %u\nversion %u\nrecord_header %u\nhuge %d\nlocked %d\naligned %d\n",
		FB_INGEST_MAGIC, FB_INGEST_VERSION, FB_INGEST_RECORD_HEADER,
		FB_INGEST_HUGETLB, FB_INGEST_LOCKED, FB_INGEST_ALIGNED_WINDOWS);
	printf("buf %d %d %d %d\n", FB_INGEST_BUF_WINDOW, FB_INGEST_BUF_FULL, FB_INGEST_BUF_FLUSHED, FB_INGEST_BUF_CONTINUED);
	return 0;
}
`
	if err := os.WriteFile(filepath.Join(dir, "check.c"), []byte(src), 0o644); err != nil {
		t.Fatal(err)
	}
	wd, _ := os.Getwd()
	bin := filepath.Join(dir, "check")
	if out, err := exec.Command(cc, "-std=c11", "-Wall", "-Werror", "-I", wd, "-o", bin, filepath.Join(dir, "check.c")).CombinedOutput(); err != nil {
		t.Fatalf("fb_ingest.h does not compile: %v\n%s", err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		k, v, _ := strings.Cut(line, " ")
		got[k] = v
	}
	want := map[string]uint64{
		"fb_ingest_header.magic": hMagic, "fb_ingest_header.version": hVersion, "fb_ingest_header.header_len": hHeaderLen,
		"fb_ingest_header.flags": hFlags, "fb_ingest_header.region_len": hRegionLen, "fb_ingest_header.buffer_count": hBufferCount,
		"fb_ingest_header.buffer_size": hBufferSize, "fb_ingest_header.desc_off": hDescOff, "fb_ingest_header.sources_off": hSourcesOff,
		"fb_ingest_header.max_sources": hMaxSources, "fb_ingest_header.record_align": hRecordAlign, "fb_ingest_header.buffers_off": hBuffersOff,
		"fb_ingest_header.window_ns": hWindowNs, "fb_ingest_header.buffer_id": hBufferID, "fb_ingest_header.published": hPublished,
		"fb_ingest_header.source_count": hSourceCount, "fb_ingest_header.producer_state": hProdState, "fb_ingest_header.records": hRecords,
		"fb_ingest_header.dropped": hDropped, "fb_ingest_header.cons_armed": hConsArmed, "fb_ingest_header.consumer_state": hConsState,
		"fb_ingest_header.next_seq": hConsNextSeq, "fb_ingest_header.released": hConsReleased,
		"fb_ingest_desc.state": dState, "fb_ingest_desc.records": dRecords, "fb_ingest_desc.seq": dSeq, "fb_ingest_desc.bytes": dBytes,
		"fb_ingest_desc.flags": dFlags, "fb_ingest_desc.first_ns": dFirstNs, "fb_ingest_desc.last_ns": dLastNs,
		"fb_ingest_desc.window_ns": dWindowNs, "fb_ingest_desc.publish_ns": dPublishNs,
		"fb_ingest_source.addr": sAddr, "fb_ingest_source.src_port": sSrcPort, "fb_ingest_source.dst_port": sDstPort,
		"fb_ingest_source.flags": sFlags, "fb_ingest_source.first_ns": sFirstNs,
		"fb_ingest_record.size": rSize, "fb_ingest_record.payload_len": rPayloadLen, "fb_ingest_record.source": rSource,
		"fb_ingest_record.rx_ns": rRxNs, "fb_ingest_record.seq": rSeq, "fb_ingest_record.source_gen": rSourceGen,
		"magic": uint64(Magic), "version": uint64(Version), "record_header": RecordHeader,
		"huge": FlagHugetlb, "locked": FlagLocked, "aligned": FlagAlignedWindows,
	}
	for k, v := range want {
		if got[k] != itoa(v) {
			t.Errorf("%s: C says %q, Go %d", k, got[k], v)
		}
	}
	if w := itoa(BufWindow) + " " + itoa(BufFull) + " " + itoa(BufFlushed) + " " + itoa(BufContinued); got["buf"] != w {
		t.Errorf("buffer flags: C %q, Go %q", got["buf"], w)
	}
}

func itoa(v uint64) string { return strconv.FormatUint(v, 10) }

// TestHugepages: the region is on hugetlb pages when the kernel has free
// ones, and falls back to ordinary (locked) pages when it has none.
func TestHugepages(t *testing.T) {
	cfg := Config{Buffers: 2, BufferSize: 1 << 20, Window: time.Hour}
	free := hugePagesFree(t)
	need := int((computeLayout(testConfig(t, cfg).withDefaults(), true).size) / hugePageSize)
	r, c := newPair(t, cfg)
	st := r.Stats()
	if st.Hugetlb != (free >= need) {
		t.Fatalf("hugetlb %v with %d free huge pages (%d needed)", st.Hugetlb, free, need)
	}
	if c.Info().Hugetlb != st.Hugetlb || (st.Hugetlb && r.Size()%hugePageSize != 0) {
		t.Fatalf("consumer sees hugetlb %v, size %d", c.Info().Hugetlb, r.Size())
	}
	if !st.Locked {
		t.Logf("not locked: %v", r.LockError())
	}
	r.Append(srcA, Now(), []byte("on whatever pages"))
	r.Flush()
	if b, err := c.Next(time.Second); err != nil || b.Records != 1 {
		t.Fatalf("%+v %v", b, err)
	}
	t.Logf("hugetlb %v (%d free huge pages), locked %v", st.Hugetlb, free, st.Locked)
}

func hugePagesFree(t *testing.T) int {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		t.Skip(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "HugePages_Free:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

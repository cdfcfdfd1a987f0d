package ingest

// sourceTable is the producer's private index of the shared source table,
// with the entries in order of use: a full table gives the entry of its
// least recently seen source to a new one (Ring.sourceIndex), so that a
// burst of new sources, spoofed or not, holds the table only until it has
// been idle for Config.SourceIdle, never for good.
//
// The order is a doubly linked list threaded through the entries by index:
// touching an entry and finding the least recently seen one are O(1) and
// allocate nothing.
type sourceTable struct {
	index      map[Source]uint16
	e          []sourceEntry
	head, tail int32 // most and least recently seen entry; -1 when empty
}

type sourceEntry struct {
	src        Source
	seq        uint32 // the next record's per-source sequence number
	gen        uint32 // how many sources held the entry before this one
	lastNs     uint64 // latest RX time seen from the source
	lastBuf    uint64 // 1 + sequence number of the buffer holding its latest record; 0: none
	prev, next int32  // neighbours in the order of use: towards head, towards tail
}

func newSourceTable(max int) sourceTable {
	return sourceTable{index: make(map[Source]uint16, max), e: make([]sourceEntry, max), head: -1, tail: -1}
}

// add puts src into the unused entry j as the most recently seen.
func (t *sourceTable) add(j int, src Source, rxNs uint64) {
	t.e[j] = sourceEntry{src: src, lastNs: rxNs, prev: -1, next: -1}
	t.index[src] = uint16(j)
	t.pushFront(j)
}

// reassign gives entry j to src: its sequence starts again at 0 and its
// generation moves on, so a consumer tells the new source's records from
// the old one's.
func (t *sourceTable) reassign(j int, src Source, rxNs uint64) {
	e := &t.e[j]
	delete(t.index, e.src)
	t.unlink(j)
	gen := e.gen + 1
	t.add(j, src, rxNs)
	e.gen = gen
}

// lru is the least recently seen entry; the table must not be empty.
func (t *sourceTable) lru() int { return int(t.tail) }

// touch makes entry j the most recently seen.
func (t *sourceTable) touch(j int) {
	if int(t.head) == j {
		return
	}
	t.unlink(j)
	t.pushFront(j)
}

func (t *sourceTable) pushFront(j int) {
	e := &t.e[j]
	e.prev, e.next = -1, t.head
	if t.head >= 0 {
		t.e[t.head].prev = int32(j)
	}
	t.head = int32(j)
	if t.tail < 0 {
		t.tail = int32(j)
	}
}

func (t *sourceTable) unlink(j int) {
	e := &t.e[j]
	if e.prev >= 0 {
		t.e[e.prev].next = e.next
	} else {
		t.head = e.next
	}
	if e.next >= 0 {
		t.e[e.next].prev = e.prev
	} else {
		t.tail = e.prev
	}
	e.prev, e.next = -1, -1
}

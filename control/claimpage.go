package control

import (
	"container/heap"
	"net/netip"
	"slices"

	"github.com/fabricbridge/fabricbridge/classifier"
)

// ClaimInfo is one listener or flow an application holds.
type ClaimInfo struct {
	App    string
	Stream uint32
	// ID is the claim's id in its application's session (what Release
	// takes); (Stream, ID) is unique in the daemon.
	ID       uint64
	Listener bool
	Proto    classifier.Protocol
	// Local is the local address and port; a listener on every address of
	// both families has the zero Addr.
	Local netip.AddrPort
	// Remote is a flow's peer; zero for listeners.
	Remote netip.AddrPort
	// RuleID is a listener's counter id in the classifier; flows share
	// their application's, which is not given here.
	RuleID uint32
}

// ClaimCursor is a position in the order Claims pages in: by stream, then
// by claim id. The zero cursor is before the first claim.
type ClaimCursor struct {
	Stream uint32
	ID     uint64
}

func (c ClaimCursor) before(d ClaimCursor) bool {
	return c.Stream < d.Stream || c.Stream == d.Stream && c.ID < d.ID
}

// Claims returns up to limit claims that come after cursor, of the
// application named app or of every application when app is empty, and
// whether more follow. It holds the registry's lock for one pass over the
// claims, keeping only the limit smallest, so a page costs the same
// memory with a million flows as with ten and claims wait on it briefly.
func (s *Server) Claims(app string, after ClaimCursor, limit int) (page []ClaimInfo, more bool) {
	if limit <= 0 {
		return nil, false
	}
	r := s.reg
	r.mu.Lock()
	defer r.mu.Unlock()
	var h claimHeap
	for _, a := range r.apps {
		if app != "" && a.name != app || a.stream < after.Stream {
			continue
		}
		for _, c := range a.claims {
			at := ClaimCursor{a.stream, c.id}
			if !after.before(at) {
				continue
			}
			if len(h) <= limit {
				heap.Push(&h, pageEntry{a, c})
			} else if at.before(h.cursor(0)) {
				h[0] = pageEntry{a, c}
				heap.Fix(&h, 0)
			}
		}
	}
	// One more than asked for was kept: it says whether another page exists.
	if more = len(h) > limit; more {
		heap.Pop(&h)
	}
	page = make([]ClaimInfo, len(h))
	for i, e := range h {
		c := &e.c
		var remote netip.AddrPort
		if !c.listener {
			remote = c.peer()
		}
		page[i] = ClaimInfo{App: e.a.name, Stream: e.a.stream, ID: c.id, Listener: c.listener, Proto: c.proto,
			Local: netip.AddrPortFrom(c.addr.ip(), c.port), Remote: remote, RuleID: c.ruleID}
	}
	slices.SortFunc(page, func(x, y ClaimInfo) int {
		if (ClaimCursor{x.Stream, x.ID}).before(ClaimCursor{y.Stream, y.ID}) {
			return -1
		}
		return 1
	})
	return page, more
}

// claimHeap is a max-heap of claims in cursor order: its top is the
// largest claim kept so far, the one to give up for a smaller one.
type claimHeap []pageEntry

// pageEntry is a claim kept for a page, with its application.
type pageEntry struct {
	a *app
	c claim
}

func (h claimHeap) cursor(i int) ClaimCursor { return ClaimCursor{h[i].a.stream, h[i].c.id} }
func (h claimHeap) Len() int                 { return len(h) }
func (h claimHeap) Less(i, j int) bool       { return h.cursor(j).before(h.cursor(i)) }
func (h claimHeap) Swap(i, j int)            { h[i], h[j] = h[j], h[i] }
func (h *claimHeap) Push(x any)              { *h = append(*h, x.(pageEntry)) }
func (h *claimHeap) Pop() any {
	old := *h
	c := old[len(old)-1]
	*h = old[:len(old)-1]
	return c
}

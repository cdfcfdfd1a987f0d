//go:build ignore

// SPDX-License-Identifier: (MIT OR GPL-2.0-only)
//
// fabricbridge XDP classifier. Its semantics are defined by package classifier
// (see its package doc); the Go reference there must agree with this program
// frame for frame, and the tests in this directory prove it.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "fabricbridge.h"

#define FLOW_ENTRIES 262144
#define LISTEN_ENTRIES 65536
#define MAX_QUEUES 256

// The wire format the parser reads. Where package classifier names a
// constant, the name here is the same one.

// EtherTypes the parser knows.
#define ETHER_IPV4 0x0800
#define ETHER_IPV6 0x86dd
#define ETHER_VLAN 0x8100
#define ETHER_QINQ 0x88a8
#define MAX_VLAN_TAGS 2 // behind a third, the EtherType is the kernel's to find

// IPv6 extension headers the parser walks.
#define IPV6_HOP_BY_HOP 0
#define IPV6_ROUTING 43
#define IPV6_FRAGMENT 44
#define IPV6_AH 51
#define IPV6_DST_OPTS 60

// IP protocols.
#define PROTO_ICMPV4 1
#define PROTO_TCP 6
#define PROTO_UDP 17
#define PROTO_ICMPV6 58

// ICMP errors, the only ICMP messages the program steers.
#define ICMPV4_UNREACH 3
#define ICMPV4_TIME_EXCEEDED 11
#define ICMPV4_PARAM_PROBLEM 12
#define ICMPV6_PARAM_PROBLEM 4 // types 1 to 4 are the ICMPv6 errors

// Header lengths: the fixed ones, and the least the others can be.
#define ETH_HDR_LEN 14
#define VLAN_HDR_LEN 4
#define IPV4_HDR_LEN 20
#define IPV6_HDR_LEN 40
#define IPV6_EXT_HDR_LEN 8
#define IPV6_FRAG_HDR_LEN 8
#define TCP_HDR_LEN 20
#define UDP_HDR_LEN 8
#define ICMP_HDR_LEN 8
#define QUOTED_L4_LEN 8 // the first 64 bits of the quoted L4 header, all RFC 792 promises
#define IPV4_ADDR_LEN 4
#define IPV6_ADDR_LEN 16
// classifier.MinStrippedFrame: bpf_xdp_adjust_head leaves at least an
// Ethernet header's worth of frame.
#define MIN_STRIPPED_FRAME ETH_HDR_LEN

// Byte offsets of the fields the parser reads, each from the start of its
// header. An IPv6 extension header starts with the next header and, but for
// a fragment header, its length.
#define ETH_TYPE 12
#define VLAN_TCI 0
#define VLAN_TYPE 2
#define IPV4_TOT_LEN 2
#define IPV4_ID 4
#define IPV4_FRAG_OFF 6
#define IPV4_PROTO 9
#define IPV4_SRC 12
#define IPV4_DST 16
#define IPV6_PAYLOAD_LEN 4
#define IPV6_NEXT 6
#define IPV6_SRC 8
#define IPV6_DST 24
#define EXT_NEXT 0
#define EXT_LEN 1
#define IPV6_FRAG_OFF 2
#define IPV6_FRAG_ID 4
#define L4_SPORT 0
#define L4_DPORT 2
#define UDP_LEN 4
#define TCP_DOFF 12
#define ICMP_TYPE 0

// Bits within those fields.
#define VLAN_VID_MASK 0x0fff
#define IPV4_MF 0x2000
#define IPV4_OFFSET_MASK 0x1fff
#define IPV6_MF 0x0001
#define IPV6_OFFSET_MASK 0xfff8

// The exact flows, IPv4 ones in flows4 under a key less than half the size
// (see fb_flow4_key), the rest in flows. Both take the flow capacity; the
// IPv6 table allocates an entry when it is added, so that a capacity sized
// for IPv4 flows does not cost its memory twice.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FLOW_ENTRIES);
	__type(key, struct fb_flow4_key);
	__type(value, struct fb_target);
} flows4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FLOW_ENTRIES);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct fb_flow_key);
	__type(value, struct fb_target);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, LISTEN_ENTRIES);
	__type(key, struct fb_listen_key);
	__type(value, struct fb_listener);
} listeners SEC(".maps");

// The tables of listeners shared by instances, by fb_listener.spread. Each
// lives in an inner map of its own that user space fills before a listener
// points to it and never changes after: a changed spread is a new table
// under a fresh index, and the listener entry's one atomic update moves the
// listener to it, so a frame meets the old table and listener or the new
// ones, never half of each. A per-listener index in a hash map's value costs
// a plain listener hit nothing (a separate table keyed like the listeners
// would cost every hit a second hash lookup), and one inner map per table,
// rather than one big array of slots, lets a listener's seed, size and
// slots change together.
struct spread_map {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fb_spread);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, FB_SPREAD_INDICES);
	__type(key, __u32);
	__array(values, struct spread_map);
} spreads SEC(".maps");

// The rules live in an inner map that user space replaces whole: a frame sees
// the old set or the new one, never half of each.
struct ruleset_map {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fb_ruleset);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct ruleset_map);
} rulesets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, FB_FRAG_ENTRIES);
	__type(key, struct fb_frag_key);
	__type(value, struct fb_frag_result);
} fragments SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, MAX_QUEUES);
	__type(key, __u32);
	__type(value, __u32);
} ingest_xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FB_NUM_VERDICTS);
	__type(key, __u32);
	__type(value, struct fb_counter);
} verdict_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FB_MAX_RULE_ID + 1);
	__type(key, __u32);
	__type(value, struct fb_counter);
} rule_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, FB_NUM_EVENTS);
	__type(key, __u32);
	__type(value, __u64);
} event_counters SEC(".maps");

// Tests set record_last at load time to have every classification copied to
// last_meta, whatever its verdict. Left 0, the verifier removes the copy.
volatile const __u32 record_last = 0;

// Tests set strip_unbound at load time to have ingest frames stripped even
// when no socket is bound (and then passed), so that BPF_PROG_TEST_RUN shows
// the stripped frame. Left 0, an unbound ingest frame goes to the kernel whole.
volatile const __u32 strip_unbound = 0;

// The daemon sets drop_unbound at load time: a steered frame with no AF_XDP
// socket on its queue (the daemon is restarting, or the queue is not served)
// is dropped, so that its sender retransmits it later. Passed, it would reach
// a kernel that has no socket for it and answers with a reset. Left 0 (the
// tests), such a frame goes to the kernel.
volatile const __u32 drop_unbound = 0;

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fb_meta);
} last_meta SEC(".maps");

// Make the shared types visible to bpf2go's -type.
const struct fb_meta *unused_meta __attribute__((unused));
const struct fb_ingest_meta *unused_ingest_meta __attribute__((unused));
const struct fb_ruleset *unused_ruleset __attribute__((unused));
const struct fb_spread *unused_spread __attribute__((unused));
const enum fb_limit *unused_limit __attribute__((unused));
const enum fb_verdict *unused_verdict __attribute__((unused));
const enum fb_action *unused_action __attribute__((unused));
const enum fb_flag *unused_flag __attribute__((unused));
const enum fb_event *unused_event __attribute__((unused));

// The parsed packet, in the form the tables are keyed on.
struct pkt {
	__u8 family;
	__u8 proto;
	__u16 vlan;
	__u16 sport;
	__u16 dport;
	__u64 src[2];
	__u64 dst[2];
};

// The frame as the parser reads it. Every scalar check against len or an IP
// packet's end is the semantic one; the pointer checks beside them only
// convince the verifier and never decide alone.
struct frame {
	__u8 *data;
	__u8 *data_end;
	__u64 len;
};

// Where the L3 steps found the parts of an IP packet.
struct l3 {
	__u64 off;  // the IP header
	__u64 l4;   // the L4 header
	__u64 end;  // the IP packet's end; what follows is padding
	__u8 proto; // the L4 protocol
	__u8 first; // a first fragment: its result is remembered for the rest
};

// Each parsing step either hands the frame on to the next or decides it: the
// verdict in the metadata is then final, FB_VERDICT_PASS leaving the frame to
// the kernel.
enum step {
	NEXT,
	DECIDED,
};

struct rule_scan {
	struct fb_ruleset *set;
	struct pkt *p;
	struct fb_rule *hit;
};

// The tables' keys, the parsed packet and the metadata are stored a whole
// word at a time, each word built in a register. A word stored as narrower
// pieces and then loaded whole (by the hash and compare of a map lookup, or
// by a struct copy) cannot be forwarded from the CPU's store buffer: the load
// waits until the pieces reach the cache. On the flow-hit path those stalls
// cost about 5 ns (docs/performance.md). The packing below puts
// the bytes where the structs' layouts have them on a little-endian target,
// the only one built (gen.go).
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "word packing assumes a little-endian target"
#endif

// load_addr4 is an IPv4 address as the first word of a __u64[2] address:
// its bytes in order, then zeros.
static __always_inline __u64 load_addr4(const __u8 *b)
{
	__u32 v;

	__builtin_memcpy(&v, b, IPV4_ADDR_LEN);
	return v;
}

// load_addr8 is 8 bytes of an address, in order, as one word.
static __always_inline __u64 load_addr8(const __u8 *b)
{
	__u64 v;

	__builtin_memcpy(&v, b, sizeof(v));
	return v;
}

static __always_inline __u16 load_be16(const __u8 *p)
{
	return ((__u16)p[0] << 8) | p[1];
}

static __always_inline __u32 load_be32(const __u8 *p)
{
	return ((__u32)p[0] << 24) | ((__u32)p[1] << 16) | ((__u32)p[2] << 8) | p[3];
}

static __always_inline __u8 ip_version(const __u8 *ip)
{
	return ip[0] >> 4;
}

static __always_inline __u32 ipv4_hdr_len(const __u8 *ip)
{
	return (ip[0] & 0x0f) * 4; // IHL counts 32-bit words
}

static __always_inline __u32 tcp_hdr_len(const __u8 *th)
{
	return (th[TCP_DOFF] >> 4) * 4; // the data offset counts 32-bit words
}

static __always_inline int is_ipv6_ext(__u8 proto)
{
	return proto == IPV6_HOP_BY_HOP || proto == IPV6_ROUTING || proto == IPV6_FRAGMENT ||
	       proto == IPV6_AH || proto == IPV6_DST_OPTS;
}

// ipv6_ext_len is the length of extension header h, not a fragment header.
static __always_inline __u32 ipv6_ext_len(__u8 proto, const __u8 *h)
{
	if (proto == IPV6_AH)
		return ((__u32)h[EXT_LEN] + 2) * 4; // 32-bit words, less two (RFC 4302)
	return ((__u32)h[EXT_LEN] + 1) * 8; // 8-octet units, less one
}

static __always_inline enum step malformed(struct fb_meta *m)
{
	m->verdict = FB_VERDICT_MALFORMED;
	return DECIDED;
}

static __always_inline int prefix_holds(const __u64 *a, const __u64 *net, const __u64 *mask)
{
	return (a[0] & mask[0]) == net[0] && (a[1] & mask[1]) == net[1];
}

static long match_rule(__u32 i, void *data)
{
	struct rule_scan *s = data;
	struct pkt *p = s->p;
	struct fb_rule *r;

	if (i >= FB_MAX_RULES)
		return 1;
	r = &s->set->rules[i];
	if (r->vlan && r->vlan != p->vlan)
		return 0;
	if (r->proto && r->proto != p->proto)
		return 0;
	if (r->family && r->family != p->family)
		return 0;
	if (!prefix_holds(p->src, r->src_net, r->src_mask) ||
	    !prefix_holds(p->dst, r->dst_net, r->dst_mask))
		return 0;
	if (p->sport < r->sport_lo || p->sport > r->sport_hi ||
	    p->dport < r->dport_lo || p->dport > r->dport_hi)
		return 0;
	s->hit = r;
	return 1;
}

static __always_inline void count(void *map, __u32 key, __u64 bytes)
{
	struct fb_counter *c = bpf_map_lookup_elem(map, &key);

	if (c) {
		c->packets++;
		c->bytes += bytes;
	}
}

static __always_inline void count_event(__u32 key)
{
	__u64 *c = bpf_map_lookup_elem(&event_counters, &key);

	if (c)
		(*c)++;
}

// mix64 is SplitMix64's finaliser, maglev's mix64.
static __always_inline __u64 mix64(__u64 x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return x;
}

// addr_words puts an address of p's family into the two big-endian words
// maglev.FlowHash16 reads: IPv4 as ::ffff:a.b.c.d.
static __always_inline void addr_words(const struct pkt *p, const __u64 *a, __u64 *w)
{
	if (p->family == FB_FAMILY_IPV4) {
		w[0] = 0;
		w[1] = 0xffff00000000ULL | bpf_ntohl(*(const __u32 *)a);
		return;
	}
	w[0] = bpf_be64_to_cpu(a[0]);
	w[1] = bpf_be64_to_cpu(a[1]);
}

// flow_hash is maglev.FlowHash16 of p under seed: the same on every box, so
// that whichever box a router picks steers a flow to the same instance.
static __always_inline __u64 flow_hash(__u64 seed, const struct pkt *p)
{
	const __u64 golden = 0x9e3779b97f4a7c15ULL;
	__u64 s[2], d[2];
	__u64 h;

	addr_words(p, p->src, s);
	addr_words(p, p->dst, d);
	h = mix64(seed ^ (__u64)p->proto << 32 ^ (__u64)p->sport << 16 ^ p->dport);
	h = mix64(h ^ s[0] * golden);
	h = mix64(h ^ s[1] * golden);
	h = mix64(h ^ d[0] * golden);
	return mix64(h ^ d[1] * golden);
}

// spread_steer steers m, a hit on a listener with a spread, to the current
// owner of p's slot in the spread under index, and flags a slot whose
// previous owner may hold the connection. A missing or malformed table,
// which user space never installs, leaves the listener's own stream.
static __always_inline void spread_steer(__u32 index, const struct pkt *p, struct fb_meta *m)
{
	__u32 zero = 0;
	void *inner = bpf_map_lookup_elem(&spreads, &index);
	if (!inner)
		return;
	struct fb_spread *sp = bpf_map_lookup_elem(inner, &zero);
	if (!sp)
		return;
	__u64 n = sp->nslots;
	if (n == 0)
		return;
	__u64 i = flow_hash(sp->seed, p) % n;
	if (i >= FB_MAX_SPREAD_SLOTS)
		return;
	struct fb_slot slot = sp->slots[i];
	m->stream_id = slot.current;
	if (slot.previous && slot.previous != slot.current)
		m->flags |= FB_FLAG_SECOND_CHANCE;
}

// steer looks p up in the flows, the listeners on its destination and the
// wildcard listeners; on a hit it steers m to the stream, or to the slot's
// stream of a listener with a spread, and returns 1.
static __always_inline int steer(struct pkt *p, struct fb_meta *m)
{
	// The keys as the words they are stored in (see load_addr4).
	union {
		struct fb_flow4_key k;
		__u64 w[2];
	} f4;
	union {
		struct fb_flow_key k;
		__u64 w[5];
	} fk;
	union {
		struct fb_listen_key k;
		__u32 w[5];
	} lk;
	struct fb_target *t;
	struct fb_listener *l;

	if (p->family == FB_FAMILY_IPV4) {
		// src, dst; sport, dport, proto, pad. An IPv4 address is the
		// low half of its first word.
		f4.w[0] = p->src[0] | p->dst[0] << 32;
		f4.w[1] = p->sport | (__u32)p->dport << 16 | (__u64)p->proto << 32;
		t = bpf_map_lookup_elem(&flows4, &f4.k);
	} else {
		// family, proto, sport, dport, pad
		fk.w[0] = p->family | (__u32)p->proto << 8 | (__u32)p->sport << 16 |
			  (__u64)p->dport << 32;
		fk.w[1] = p->src[0];
		fk.w[2] = p->src[1];
		fk.w[3] = p->dst[0];
		fk.w[4] = p->dst[1];
		t = bpf_map_lookup_elem(&flows, &fk.k);
	}
	if (t) {
		m->verdict = FB_VERDICT_STEER;
		m->stream_id = t->stream_id;
		m->rule_id = t->rule_id;
		return 1;
	}
	// family, proto, port
	lk.w[0] = p->family | (__u32)p->proto << 8 | (__u32)p->dport << 16;
	lk.w[1] = p->dst[0];
	lk.w[2] = p->dst[0] >> 32;
	lk.w[3] = p->dst[1];
	lk.w[4] = p->dst[1] >> 32;
	l = bpf_map_lookup_elem(&listeners, &lk.k);
	if (!l) {
		lk.w[1] = lk.w[2] = lk.w[3] = lk.w[4] = 0;
		l = bpf_map_lookup_elem(&listeners, &lk.k);
	}
	if (!l)
		return 0;
	m->verdict = FB_VERDICT_STEER;
	m->stream_id = l->stream_id;
	m->rule_id = l->rule_id;
	if (l->spread)
		spread_steer(l->spread, p, m);
	return 1;
}

// lookup decides a TCP or UDP packet: flows, listeners, rules, default.
static __always_inline void lookup(struct pkt *p, struct fb_meta *m)
{
	__u32 zero = 0;

	if (steer(p, m))
		return;

	void *inner = bpf_map_lookup_elem(&rulesets, &zero);
	if (!inner)
		return;
	struct fb_ruleset *set = bpf_map_lookup_elem(inner, &zero);
	if (!set)
		return;
	struct rule_scan scan = { .set = set, .p = p };
	__u32 n = set->count;
	if (n > FB_MAX_RULES)
		n = FB_MAX_RULES;
	bpf_loop(n, match_rule, &scan, 0);
	struct fb_rule *r = scan.hit;
	if (!r)
		return;
	m->rule_id = r->id;
	m->stream_id = r->stream_id;
	switch (r->action) {
	case FB_ACTION_STEER:
		m->verdict = FB_VERDICT_STEER;
		break;
	case FB_ACTION_INGEST:
		m->verdict = FB_VERDICT_INGEST;
		break;
	case FB_ACTION_DROP:
		m->verdict = FB_VERDICT_DROP;
		break;
	default:
		m->verdict = FB_VERDICT_PASS;
	}
}

// later_fragment decides a fragment other than the first as its first
// fragment was decided, if that one was seen.
static __always_inline void later_fragment(struct fb_frag_key *k, struct fb_meta *m)
{
	struct fb_frag_result *r = bpf_map_lookup_elem(&fragments, k);

	m->flags |= FB_FLAG_LATER_FRAGMENT;
	if (!r) {
		m->verdict = FB_VERDICT_FRAG_MISS;
		return;
	}
	m->verdict = r->verdict;
	m->stream_id = r->stream_id;
	m->rule_id = r->rule_id;
}

// remember_first_fragment keeps a first fragment's result for the fragments
// that follow it, which carry no L4 header to be classified by.
static __always_inline void remember_first_fragment(struct fb_frag_key *k, const struct fb_meta *m)
{
	struct fb_frag_result r = {
		.stream_id = m->stream_id,
		.rule_id = m->rule_id,
		.verdict = m->verdict,
	};

	bpf_map_update_elem(&fragments, k, &r, BPF_ANY);
}

// icmp_error mirrors classifier's icmpError: an ICMP error quoting a TCP or
// UDP packet that the local side sent is steered to the flow or listener of
// the quoted tuple, looked up reversed; anything else is left to the kernel.
// p holds the outer family; its other fields are overwritten.
static __always_inline void icmp_error(const struct frame *f, const struct l3 *ip3,
				       struct pkt *p, struct fb_meta *m)
{
	__u8 *data = f->data, *data_end = f->data_end;
	__u64 l4 = ip3->l4, end = ip3->end;
	__u8 *icmp = data + l4;
	__u64 q = l4 + ICMP_HDR_LEN; // the quoted IP header
	__u8 *ip;

	if (l4 + ICMP_HDR_LEN > end || icmp + ICMP_HDR_LEN > data_end)
		return;
	ip = data + q;
	if (p->family == FB_FAMILY_IPV4) {
		__u32 ihl;

		if (ip3->proto != PROTO_ICMPV4)
			return;
		if (icmp[ICMP_TYPE] != ICMPV4_UNREACH && icmp[ICMP_TYPE] != ICMPV4_TIME_EXCEEDED &&
		    icmp[ICMP_TYPE] != ICMPV4_PARAM_PROBLEM)
			return;
		if (q + IPV4_HDR_LEN > end || ip + IPV4_HDR_LEN > data_end ||
		    ip_version(ip) != FB_FAMILY_IPV4)
			return;
		ihl = ipv4_hdr_len(ip);
		// A later fragment quotes no L4 header.
		if (ihl < IPV4_HDR_LEN || q + ihl + QUOTED_L4_LEN > end ||
		    (load_be16(ip + IPV4_FRAG_OFF) & IPV4_OFFSET_MASK))
			return;
		p->proto = ip[IPV4_PROTO];
		p->src[0] = load_addr4(ip + IPV4_DST);
		p->dst[0] = load_addr4(ip + IPV4_SRC);
		q += ihl;
	} else {
		if (ip3->proto != PROTO_ICMPV6)
			return;
		if (icmp[ICMP_TYPE] == 0 || icmp[ICMP_TYPE] > ICMPV6_PARAM_PROBLEM)
			return;
		if (q + IPV6_HDR_LEN + QUOTED_L4_LEN > end ||
		    ip + IPV6_HDR_LEN + QUOTED_L4_LEN > data_end || ip_version(ip) != FB_FAMILY_IPV6)
			return;
		p->proto = ip[IPV6_NEXT]; // extension headers in the quote are not followed
		p->src[0] = load_addr8(ip + IPV6_DST);
		p->src[1] = load_addr8(ip + IPV6_DST + 8);
		p->dst[0] = load_addr8(ip + IPV6_SRC);
		p->dst[1] = load_addr8(ip + IPV6_SRC + 8);
		q += IPV6_HDR_LEN;
	}
	if (p->proto != PROTO_TCP && p->proto != PROTO_UDP)
		return;
	__u8 *th = data + q;
	if (th + QUOTED_L4_LEN > data_end)
		return;
	p->vlan = m->vlan;
	p->sport = load_be16(th + L4_DPORT);
	p->dport = load_be16(th + L4_SPORT);
	steer(p, m);
}

// parse_l2 steps over the Ethernet header and up to MAX_VLAN_TAGS VLAN tags,
// noting the innermost VLAN id, and leaves the EtherType behind them in
// *etype.
static __always_inline enum step parse_l2(const struct frame *f, struct fb_meta *m, __u16 *etype)
{
	__u32 off = ETH_HDR_LEN;

	if (f->data + ETH_HDR_LEN > f->data_end)
		return malformed(m);
	*etype = load_be16(f->data + ETH_TYPE);
#pragma unroll
	for (int i = 0; i < MAX_VLAN_TAGS; i++) {
		if (*etype != ETHER_VLAN && *etype != ETHER_QINQ)
			break;
		if (f->data + off + VLAN_HDR_LEN > f->data_end)
			return malformed(m);
		m->vlan = load_be16(f->data + off + VLAN_TCI) & VLAN_VID_MASK;
		*etype = load_be16(f->data + off + VLAN_TYPE);
		off += VLAN_HDR_LEN;
	}
	m->l3_offset = off;
	return NEXT;
}

// parse_ipv4 checks the IPv4 header at ip->off and finds the L4 header
// behind it. A fragment is keyed in *frag; a later fragment is decided here.
static __always_inline enum step parse_ipv4(const struct frame *f, struct fb_meta *m, struct l3 *ip,
					    struct pkt *p, struct fb_frag_key *frag)
{
	__u8 *h = f->data + ip->off;
	__u32 hlen, total;
	__u16 frag_off;

	if (h + IPV4_HDR_LEN > f->data_end || ip_version(h) != FB_FAMILY_IPV4)
		return malformed(m);
	hlen = ipv4_hdr_len(h);
	total = load_be16(h + IPV4_TOT_LEN);
	if (hlen < IPV4_HDR_LEN || total < hlen || ip->off + total > f->len)
		return malformed(m);
	ip->end = ip->off + total;
	ip->l4 = ip->off + hlen;
	ip->proto = h[IPV4_PROTO];
	p->family = FB_FAMILY_IPV4;
	p->src[0] = load_addr4(h + IPV4_SRC);
	p->dst[0] = load_addr4(h + IPV4_DST);
	frag_off = load_be16(h + IPV4_FRAG_OFF);
	if (!(frag_off & (IPV4_MF | IPV4_OFFSET_MASK)))
		return NEXT;
	m->flags |= FB_FLAG_FRAGMENT;
	frag->family = FB_FAMILY_IPV4;
	frag->proto = ip->proto;
	frag->id = load_be16(h + IPV4_ID);
	frag->src[0] = p->src[0];
	frag->dst[0] = p->dst[0];
	if (frag_off & IPV4_OFFSET_MASK) {
		m->l4_offset = ip->l4;
		later_fragment(frag, m);
		return DECIDED;
	}
	ip->first = 1;
	return NEXT;
}

// ipv6_fragment reads the fragment header h at ip->l4 and steps over it. A
// fragment is keyed in *frag; a later fragment is decided here. An atomic
// fragment (offset 0, no more fragments) is a whole packet.
static __always_inline enum step ipv6_fragment(const __u8 *h, struct fb_meta *m, struct l3 *ip,
					       const struct pkt *p, struct fb_frag_key *frag)
{
	__u16 frag_off;

	if (m->flags & FB_FLAG_FRAGMENT)
		return malformed(m); // a second fragment header
	frag_off = load_be16(h + IPV6_FRAG_OFF);
	if (frag_off & (IPV6_OFFSET_MASK | IPV6_MF)) {
		m->flags |= FB_FLAG_FRAGMENT;
		frag->family = FB_FAMILY_IPV6;
		frag->proto = h[EXT_NEXT];
		frag->id = load_be32(h + IPV6_FRAG_ID);
		frag->src[0] = p->src[0];
		frag->src[1] = p->src[1];
		frag->dst[0] = p->dst[0];
		frag->dst[1] = p->dst[1];
		if (frag_off & IPV6_OFFSET_MASK) {
			m->l4_offset = ip->l4 + IPV6_FRAG_HDR_LEN;
			later_fragment(frag, m);
			return DECIDED;
		}
		ip->first = 1;
	}
	ip->proto = h[EXT_NEXT];
	ip->l4 += IPV6_FRAG_HDR_LEN;
	return NEXT;
}

// walk_ipv6_ext follows up to FB_MAX_EXT_HEADERS extension headers from
// ip->l4 to the L4 header; a longer chain is the kernel's.
static __always_inline enum step walk_ipv6_ext(const struct frame *f, struct fb_meta *m, struct l3 *ip,
					       const struct pkt *p, struct fb_frag_key *frag)
{
#pragma unroll
	for (int depth = 0; depth <= FB_MAX_EXT_HEADERS; depth++) {
		__u8 *h;
		__u32 hlen;

		if (!is_ipv6_ext(ip->proto))
			break;
		if (depth == FB_MAX_EXT_HEADERS)
			return DECIDED; // too deep to follow: the kernel's
		if (ip->l4 + IPV6_EXT_HDR_LEN > ip->end)
			return malformed(m);
		h = f->data + ip->l4;
		if (h + IPV6_EXT_HDR_LEN > f->data_end)
			return malformed(m);
		if (ip->proto == IPV6_FRAGMENT) {
			if (ipv6_fragment(h, m, ip, p, frag) == DECIDED)
				return DECIDED;
			continue;
		}
		hlen = ipv6_ext_len(ip->proto, h);
		if (ip->l4 + hlen > ip->end)
			return malformed(m);
		ip->proto = h[EXT_NEXT];
		ip->l4 += hlen;
	}
	return NEXT;
}

// parse_ipv6 checks the IPv6 header at ip->off and finds the L4 header
// behind its extension headers.
static __always_inline enum step parse_ipv6(const struct frame *f, struct fb_meta *m, struct l3 *ip,
					    struct pkt *p, struct fb_frag_key *frag)
{
	__u8 *h = f->data + ip->off;

	if (h + IPV6_HDR_LEN > f->data_end || ip_version(h) != FB_FAMILY_IPV6)
		return malformed(m);
	m->flags |= FB_FLAG_IPV6;
	ip->end = ip->off + IPV6_HDR_LEN + load_be16(h + IPV6_PAYLOAD_LEN);
	if (ip->end > f->len)
		return malformed(m);
	ip->proto = h[IPV6_NEXT];
	p->family = FB_FAMILY_IPV6;
	p->src[0] = load_addr8(h + IPV6_SRC);
	p->src[1] = load_addr8(h + IPV6_SRC + 8);
	p->dst[0] = load_addr8(h + IPV6_DST);
	p->dst[1] = load_addr8(h + IPV6_DST + 8);
	ip->l4 = ip->off + IPV6_HDR_LEN;
	return walk_ipv6_ext(f, m, ip, p, frag);
}

// parse_l4 checks the TCP or UDP header at ip->l4 and reads its ports into p,
// and a UDP header's length into *ulen. Any other protocol is decided here:
// an ICMP error may be steered to the flow it quotes, the rest is the
// kernel's.
static __always_inline enum step parse_l4(const struct frame *f, struct fb_meta *m, const struct l3 *ip,
					  struct pkt *p, __u32 *ulen)
{
	__u64 l4 = ip->l4;
	__u8 *th = f->data + l4;

	m->l4_offset = l4;
	if (ip->proto == PROTO_TCP) {
		__u32 doff;

		if (l4 + TCP_HDR_LEN > ip->end || th + TCP_HDR_LEN > f->data_end)
			return malformed(m);
		doff = tcp_hdr_len(th);
		if (doff < TCP_HDR_LEN || l4 + doff > ip->end)
			return malformed(m);
	} else if (ip->proto == PROTO_UDP) {
		if (l4 + UDP_HDR_LEN > ip->end || th + UDP_HDR_LEN > f->data_end)
			return malformed(m);
		*ulen = load_be16(th + UDP_LEN);
		// A first fragment's UDP length covers the whole datagram.
		if (*ulen < UDP_HDR_LEN || (!ip->first && l4 + *ulen > ip->end))
			return malformed(m);
	} else {
		if (!(m->flags & FB_FLAG_FRAGMENT))
			icmp_error(f, ip, p, m);
		return DECIDED;
	}
	p->proto = ip->proto;
	p->vlan = m->vlan;
	p->sport = load_be16(th + L4_SPORT);
	p->dport = load_be16(th + L4_DPORT);
	return NEXT;
}

// ingest_fits reports whether a datagram may be ingested: offload takes whole
// datagrams whose UDP length is the IP payload's, since anything else would
// put a partial or ambiguous payload into a buffer.
static __always_inline int ingest_fits(const struct fb_meta *m, const struct l3 *ip, __u32 ulen)
{
	return !(m->flags & FB_FLAG_FRAGMENT) && ip->l4 + ulen == ip->end;
}

// classify is classifier.Classifier.Classify, step by step. For an ingest
// verdict it leaves the packet's fields in pp and the UDP length in ulenp.
static __always_inline void classify(struct xdp_md *ctx, struct fb_meta *m, struct pkt *pp, __u32 *ulenp)
{
	struct frame f = {
		.data = (void *)(long)ctx->data,
		.data_end = (void *)(long)ctx->data_end,
	};
	struct fb_frag_key frag = {};
	struct l3 ip = {};
	struct pkt p = {};
	__u32 ulen = 0;
	__u16 etype;
	enum step s;

	f.len = f.data_end - f.data;
	if (parse_l2(&f, m, &etype) == DECIDED)
		return;
	ip.off = m->l3_offset;
	if (etype == ETHER_IPV4)
		s = parse_ipv4(&f, m, &ip, &p, &frag);
	else if (etype == ETHER_IPV6)
		s = parse_ipv6(&f, m, &ip, &p, &frag);
	else
		return; // not IP, or a third VLAN tag: the kernel's
	if (s == DECIDED || parse_l4(&f, m, &ip, &p, &ulen) == DECIDED)
		return;

	lookup(&p, m);
	if (m->verdict == FB_VERDICT_INGEST) {
		if (ingest_fits(m, &ip, ulen)) {
			*pp = p;
			*ulenp = ulen;
		} else {
			// The rule id stays, so the refusal is counted under
			// the rule as well as a malformed frame.
			m->verdict = FB_VERDICT_MALFORMED;
			m->stream_id = 0;
		}
	}
	if (ip.first && m->rule_id)
		remember_first_fragment(&frag, m);
}

// size_meta sizes the metadata area in front of the frame to exactly size
// bytes, whatever it held before (empty from a driver; ours again when a test
// run repeats). It counts a failure, and then the frame is as it was.
static __always_inline int size_meta(struct xdp_md *ctx, long size)
{
	long held = (long)ctx->data - (long)ctx->data_meta;

	if (bpf_xdp_adjust_meta(ctx, held - size)) {
		count_event(FB_EVENT_META_FAILED);
		return -1;
	}
	return 0;
}

// ingest redirects a datagram to the ingest socket of its queue, stripped to
// its payload with an fb_ingest_meta in front; classifier.Ingest is its
// reference. The redirect is asked first: without a socket the frame goes to
// the kernel untouched, never stripped.
static __always_inline int ingest(struct xdp_md *ctx, struct fb_meta *m, struct pkt *p, __u32 ulen)
{
	struct fb_ingest_meta im = {};
	long ret;

	ret = bpf_redirect_map(&ingest_xsks, ctx->rx_queue_index, XDP_PASS);
	if (ret != XDP_REDIRECT) {
		count_event(FB_EVENT_REDIRECT_FAILED);
		if (!strip_unbound)
			return XDP_PASS;
	}

	__u32 len = ctx->data_end - ctx->data;
	__u32 hdr = (__u32)m->l4_offset + UDP_HDR_LEN;
	__u32 strip = hdr;
	// A payload shorter than the frame the kernel must leave keeps some
	// header bytes in front of it.
	if (len < strip + MIN_STRIPPED_FRAME)
		strip = len - MIN_STRIPPED_FRAME;

	im.rx_timestamp_ns = bpf_ktime_get_ns();
	if (m->flags & FB_FLAG_IPV6) {
		im.src[0] = p->src[0];
		im.src[1] = p->src[1];
	} else {
		__u8 *b = (__u8 *)im.src;

		// ::ffff:a.b.c.d, the IPv4-mapped form.
		b[10] = 0xff;
		b[11] = 0xff;
		__builtin_memcpy(b + 12, p->src, IPV4_ADDR_LEN);
	}
	im.buffer_id = m->stream_id;
	im.rule_id = m->rule_id;
	im.src_port = p->sport;
	im.dst_port = p->dport;
	im.payload_len = ulen - UDP_HDR_LEN;
	im.payload_offset = hdr - strip;
	im.verdict = FB_VERDICT_INGEST;
	im.flags = m->flags & FB_FLAG_IPV6;

	// Size the metadata first: adjust_head carries it along, and a failure
	// here leaves the frame whole.
	if (size_meta(ctx, sizeof(im)))
		return XDP_PASS;
	if (bpf_xdp_adjust_head(ctx, strip)) {
		count_event(FB_EVENT_STRIP_FAILED);
		return XDP_PASS;
	}
	struct fb_ingest_meta *meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > (void *)(long)ctx->data) {
		// Cannot happen after a successful adjust_meta, but the frame
		// is stripped now: it must not reach the kernel.
		count_event(FB_EVENT_META_FAILED);
		return XDP_DROP;
	}
	*meta = im;
	return ret;
}

// Whether steered frames carry an RX timestamp: user space sets the one
// entry while something reads them (Program.StampSteered; a packet capture
// is the only reader). Unread, the clock is not worth reading: on a virtual
// machine's kvm-clock it is a third of a flow hit. Ingest frames are always
// stamped, since their consumer reads every record's time.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} stamp_steered SEC(".maps");

static __always_inline int stamping_steered(void)
{
	__u32 zero = 0;
	__u32 *on = bpf_map_lookup_elem(&stamp_steered, &zero);

	return on && *on;
}

// redirect hands a steered frame to the AF_XDP socket of its queue with m in
// front of it.
static __always_inline int redirect(struct xdp_md *ctx, struct fb_meta *m)
{
	long ret;

	if (stamping_steered())
		m->rx_timestamp_ns = bpf_ktime_get_ns();
	if (size_meta(ctx, sizeof(*m)))
		return XDP_PASS;
	struct fb_meta *meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > (void *)(long)ctx->data) {
		count_event(FB_EVENT_META_FAILED);
		return XDP_PASS;
	}
	// Field by field: each load matches the store that wrote the field
	// (see load_addr4); the frame's bytes are not read back here.
	meta->rx_timestamp_ns = m->rx_timestamp_ns;
	meta->stream_id = m->stream_id;
	meta->rule_id = m->rule_id;
	meta->l3_offset = m->l3_offset;
	meta->l4_offset = m->l4_offset;
	meta->vlan = m->vlan;
	meta->verdict = m->verdict;
	meta->flags = m->flags;

	ret = bpf_redirect_map(&xsks, ctx->rx_queue_index, drop_unbound ? XDP_DROP : XDP_PASS);
	if (ret != XDP_REDIRECT)
		count_event(FB_EVENT_REDIRECT_FAILED);
	return ret;
}

SEC("xdp")
int fabricbridge(struct xdp_md *ctx)
{
	struct fb_meta m = {};
	struct pkt p = {};
	__u32 ulen = 0;
	__u64 bytes = ctx->data_end - ctx->data;

	classify(ctx, &m, &p, &ulen);
	if (record_last) {
		__u32 zero = 0;

		bpf_map_update_elem(&last_meta, &zero, &m, BPF_ANY);
	}
	count(&verdict_counters, m.verdict, bytes);
	if (m.rule_id && m.rule_id <= FB_MAX_RULE_ID)
		count(&rule_counters, m.rule_id, bytes);

	switch (m.verdict) {
	case FB_VERDICT_DROP:
		return XDP_DROP;
	case FB_VERDICT_STEER:
		return redirect(ctx, &m);
	case FB_VERDICT_INGEST:
		return ingest(ctx, &m, &p, ulen);
	default:
		return XDP_PASS;
	}
}

// pass_all is the yardstick the benchmarks measure fabricbridge against.
SEC("xdp")
int pass_all(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char _license[] SEC("license") = "Dual MIT/GPL";

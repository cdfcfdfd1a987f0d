//go:build ignore

// SPDX-License-Identifier: (MIT OR GPL-2.0-only)
//
// fabricbridge XDP classifier. Its semantics are defined by package classifier
// (see its package doc); the Go reference there must agree with this program
// frame for frame, and the tests in this directory prove it.

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define MAX_RULES 1024
#define MAX_RULE_ID 16383
#define MAX_EXT_HEADERS 8
#define FRAG_ENTRIES 8192
#define FLOW_ENTRIES 262144
#define LISTEN_ENTRIES 65536
#define MAX_QUEUES 256

enum fb_verdict {
	FB_VERDICT_PASS = 0,
	FB_VERDICT_DROP = 1,
	FB_VERDICT_STEER = 2,
	FB_VERDICT_INGEST = 3,
	FB_VERDICT_MALFORMED = 4,
	FB_VERDICT_FRAG_MISS = 5,
	FB_NUM_VERDICTS = 6,
};

enum fb_action {
	FB_ACTION_STEER = 1,
	FB_ACTION_INGEST = 2,
	FB_ACTION_PASS = 3,
	FB_ACTION_DROP = 4,
};

enum fb_flag {
	FB_FLAG_IPV6 = 1,
	FB_FLAG_FRAGMENT = 2,
	FB_FLAG_LATER_FRAGMENT = 4,
};

// Events that are not verdicts, counted per CPU.
enum fb_event {
	FB_EVENT_REDIRECT_FAILED = 0, // no AF_XDP socket on the queue: the kernel got it
	FB_EVENT_META_FAILED = 1,     // the driver gave no metadata room: the kernel got it
	FB_EVENT_STRIP_FAILED = 2,    // an ingest frame could not be stripped: the kernel got it whole
	FB_NUM_EVENTS = 3,
};

// Written in front of every redirected frame. Keep in step with
// classifier.Meta; the Go tests compare them field by field.
struct fb_meta {
	__u64 rx_timestamp_ns;
	__u32 stream_id;
	__u32 rule_id;
	__u16 l3_offset;
	__u16 l4_offset;
	__u16 vlan;
	__u8 verdict;
	__u8 flags;
};

// Written in front of every ingest frame, after its headers are stripped.
// Keep in step with classifier.IngestMeta. Like fb_meta it ends with the
// verdict and flags, so the byte in front of a frame names the layout.
struct fb_ingest_meta {
	__u64 rx_timestamp_ns;
	__u64 src[2]; // the address's bytes in order; IPv4 as ::ffff:a.b.c.d
	__u32 buffer_id;
	__u16 rule_id;
	__u16 src_port; // host order
	__u16 dst_port;
	__u16 payload_len;
	__u8 payload_offset; // payload start in the stripped frame
	__u8 pad;
	__u8 verdict;
	__u8 flags;
};

struct fb_flow_key {
	__u8 family;
	__u8 proto;
	__u16 sport; // host order, as are all ports in the tables
	__u16 dport;
	__u16 pad;
	// Addresses are held in wide words so that copies and compares are
	// whole loads, not byte by byte; the bytes are the address's, in order.
	__u64 src[2];
	__u64 dst[2];
};

struct fb_listen_key {
	__u8 family;
	__u8 proto;
	__u16 port;
	__u32 addr[4]; // all zero: any address of the family
};

struct fb_target {
	__u32 stream_id;
	__u32 rule_id;
};

struct fb_frag_key {
	__u8 family;
	__u8 proto;
	__u16 pad;
	__u32 id;
	__u64 src[2];
	__u64 dst[2];
};

struct fb_frag_result {
	__u32 stream_id;
	__u32 rule_id;
	__u8 verdict;
	__u8 pad[3];
};

struct fb_rule {
	__u32 id;
	__u32 stream_id;
	__u8 action;
	__u8 family; // 0: any
	__u8 proto;  // 0: any
	__u8 pad;
	__u16 vlan; // 0: any
	__u16 sport_lo;
	__u16 sport_hi;
	__u16 dport_lo;
	__u16 dport_hi;
	__u16 pad2;
	__u64 src_net[2];
	__u64 src_mask[2];
	__u64 dst_net[2];
	__u64 dst_mask[2];
};

struct fb_ruleset {
	__u32 count;
	__u32 pad;
	struct fb_rule rules[MAX_RULES];
};

struct fb_counter {
	__u64 packets;
	__u64 bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, FLOW_ENTRIES);
	__type(key, struct fb_flow_key);
	__type(value, struct fb_target);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, LISTEN_ENTRIES);
	__type(key, struct fb_listen_key);
	__type(value, struct fb_target);
} listeners SEC(".maps");

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
	__uint(max_entries, FRAG_ENTRIES);
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
	__uint(max_entries, MAX_RULE_ID + 1);
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

struct rule_scan {
	struct fb_ruleset *set;
	struct pkt *p;
	struct fb_rule *hit;
};

static __always_inline __u16 load_be16(const __u8 *p)
{
	return ((__u16)p[0] << 8) | p[1];
}

static __always_inline __u32 load_be32(const __u8 *p)
{
	return ((__u32)p[0] << 24) | ((__u32)p[1] << 16) | ((__u32)p[2] << 8) | p[3];
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

	if (i >= MAX_RULES)
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

// steer looks p up in the flows, the listeners on its destination and the
// wildcard listeners; on a hit it steers m to the stream and returns 1.
static __always_inline int steer(struct pkt *p, struct fb_meta *m)
{
	struct fb_flow_key fk = {
		.family = p->family,
		.proto = p->proto,
		.sport = p->sport,
		.dport = p->dport,
	};
	struct fb_listen_key lk = {
		.family = p->family,
		.proto = p->proto,
		.port = p->dport,
	};
	struct fb_target *t;

	fk.src[0] = p->src[0];
	fk.src[1] = p->src[1];
	fk.dst[0] = p->dst[0];
	fk.dst[1] = p->dst[1];
	t = bpf_map_lookup_elem(&flows, &fk);
	if (!t) {
		__builtin_memcpy(lk.addr, p->dst, 16); // both 4-byte aligned: four word copies
		t = bpf_map_lookup_elem(&listeners, &lk);
	}
	if (!t) {
		__builtin_memset(lk.addr, 0, 16);
		t = bpf_map_lookup_elem(&listeners, &lk);
	}
	if (!t)
		return 0;
	m->verdict = FB_VERDICT_STEER;
	m->stream_id = t->stream_id;
	m->rule_id = t->rule_id;
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
	if (n > MAX_RULES)
		n = MAX_RULES;
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

// icmp_error mirrors classifier's icmpError: an ICMP error quoting a TCP or
// UDP packet that the local side sent is steered to the flow or listener of
// the quoted tuple, looked up reversed; anything else is left to the kernel.
// p holds the outer family; its other fields are overwritten.
static __always_inline void icmp_error(__u8 *data, __u8 *data_end, __u32 l4, __u32 end,
				       __u8 proto, struct pkt *p, struct fb_meta *m)
{
	__u8 *icmp = data + l4;
	__u32 q = l4 + 8; // the quoted IP header
	__u8 *ip;

	if (l4 + 8 > end || icmp + 8 > data_end)
		return;
	ip = data + q;
	if (p->family == 4) {
		__u32 ihl;

		if (proto != 1)
			return;
		if (icmp[0] != 3 && icmp[0] != 11 && icmp[0] != 12)
			return;
		if (q + 20 > end || ip + 20 > data_end || (ip[0] >> 4) != 4)
			return;
		ihl = (ip[0] & 0x0f) * 4;
		// A later fragment quotes no L4 header.
		if (ihl < 20 || q + ihl + 8 > end || (load_be16(ip + 6) & 0x1fff))
			return;
		p->proto = ip[9];
		__builtin_memcpy(p->src, ip + 16, 4);
		__builtin_memcpy(p->dst, ip + 12, 4);
		q += ihl;
	} else {
		if (proto != 58)
			return;
		if (icmp[0] == 0 || icmp[0] > 4)
			return;
		if (q + 48 > end || ip + 48 > data_end || (ip[0] >> 4) != 6)
			return;
		p->proto = ip[6];
		__builtin_memcpy(p->src, ip + 24, 16);
		__builtin_memcpy(p->dst, ip + 8, 16);
		q += 40;
	}
	if (p->proto != 6 && p->proto != 17)
		return;
	__u8 *th = data + q;
	if (th + 8 > data_end)
		return;
	p->vlan = m->vlan;
	p->sport = load_be16(th + 2);
	p->dport = load_be16(th);
	steer(p, m);
}

// classify mirrors classifier.Classifier.Classify statement by statement.
// Every scalar check against len or end is the semantic one; the pointer
// checks beside them only convince the verifier and never decide alone.
// For an ingest verdict it leaves the packet's fields in p and the UDP
// length in ulen.
static __always_inline void classify(struct xdp_md *ctx, struct fb_meta *m, struct pkt *pp, __u32 *ulenp)
{
	__u8 *data = (void *)(long)ctx->data;
	__u8 *data_end = (void *)(long)ctx->data_end;
	__u64 len = data_end - data;
	struct fb_frag_key fkey = {};
	struct pkt p = {};
	__u32 off, l4, end, ulen = 0;
	__u16 etype;
	__u8 proto;
	int first = 0;

	if (data + 14 > data_end)
		goto malformed;
	etype = load_be16(data + 12);
	off = 14;
#pragma unroll
	for (int i = 0; i < 2; i++) {
		if (etype != 0x8100 && etype != 0x88a8)
			break;
		if (data + off + 4 > data_end)
			goto malformed;
		m->vlan = load_be16(data + off) & 0x0fff;
		etype = load_be16(data + off + 2);
		off += 4;
	}
	m->l3_offset = off;

	if (etype == 0x0800) {
		__u8 *ip = data + off;
		__u32 ihl, total;
		__u16 frag;

		if (ip + 20 > data_end || (ip[0] >> 4) != 4)
			goto malformed;
		ihl = (ip[0] & 0x0f) * 4;
		total = load_be16(ip + 2);
		if (ihl < 20 || total < ihl || off + total > len)
			goto malformed;
		end = off + total;
		l4 = off + ihl;
		proto = ip[9];
		p.family = 4;
		__builtin_memcpy(p.src, ip + 12, 4);
		__builtin_memcpy(p.dst, ip + 16, 4);
		frag = load_be16(ip + 6);
		if (frag & 0x3fff) {
			m->flags |= FB_FLAG_FRAGMENT;
			fkey.family = 4;
			fkey.proto = proto;
			fkey.id = load_be16(ip + 4);
			fkey.src[0] = p.src[0];
			fkey.dst[0] = p.dst[0];
			if (frag & 0x1fff) {
				m->l4_offset = l4;
				later_fragment(&fkey, m);
				return;
			}
			first = 1;
		}
	} else if (etype == 0x86dd) {
		__u8 *ip = data + off;

		if (ip + 40 > data_end || (ip[0] >> 4) != 6)
			goto malformed;
		m->flags |= FB_FLAG_IPV6;
		end = off + 40 + load_be16(ip + 4);
		if (end > len)
			goto malformed;
		proto = ip[6];
		p.family = 6;
		__builtin_memcpy(p.src, ip + 8, 16);
		__builtin_memcpy(p.dst, ip + 24, 16);
		l4 = off + 40;
#pragma unroll
		for (int depth = 0; depth <= MAX_EXT_HEADERS; depth++) {
			__u8 *h;
			__u32 hlen;

			if (proto != 0 && proto != 43 && proto != 44 && proto != 51 && proto != 60)
				break;
			if (depth == MAX_EXT_HEADERS)
				return; // too deep to follow: the kernel's
			if (l4 + 8 > end)
				goto malformed;
			h = data + l4;
			if (h + 8 > data_end)
				goto malformed;
			if (proto == 44) {
				__u16 fo;

				if (m->flags & FB_FLAG_FRAGMENT)
					goto malformed;
				fo = load_be16(h + 2);
				if (fo & 0xfff9) {
					m->flags |= FB_FLAG_FRAGMENT;
					fkey.family = 6;
					fkey.proto = h[0];
					fkey.id = load_be32(h + 4);
					fkey.src[0] = p.src[0];
					fkey.src[1] = p.src[1];
					fkey.dst[0] = p.dst[0];
					fkey.dst[1] = p.dst[1];
					if (fo & 0xfff8) {
						m->l4_offset = l4 + 8;
						later_fragment(&fkey, m);
						return;
					}
					first = 1;
				}
				proto = h[0];
				l4 += 8;
				continue;
			}
			if (proto == 51)
				hlen = ((__u32)h[1] + 2) * 4;
			else
				hlen = ((__u32)h[1] + 1) * 8;
			if (l4 + hlen > end)
				goto malformed;
			proto = h[0];
			l4 += hlen;
		}
	} else {
		return; // not IP, or a third VLAN tag: the kernel's
	}
	m->l4_offset = l4;

	__u8 *th = data + l4;
	if (proto == 6) {
		__u32 doff;

		if (l4 + 20 > end || th + 20 > data_end)
			goto malformed;
		doff = (th[12] >> 4) * 4;
		if (doff < 20 || l4 + doff > end)
			goto malformed;
	} else if (proto == 17) {
		if (l4 + 8 > end || th + 8 > data_end)
			goto malformed;
		ulen = load_be16(th + 4);
		if (ulen < 8 || (!first && l4 + ulen > end))
			goto malformed;
	} else {
		if (!(m->flags & FB_FLAG_FRAGMENT))
			icmp_error(data, data_end, l4, end, proto, &p, m);
		return;
	}
	p.proto = proto;
	p.vlan = m->vlan;
	p.sport = load_be16(th);
	p.dport = load_be16(th + 2);
	lookup(&p, m);
	if (m->verdict == FB_VERDICT_INGEST) {
		// Whole datagrams only, with the UDP length the IP payload's.
		if ((m->flags & FB_FLAG_FRAGMENT) || l4 + ulen != end) {
			m->verdict = FB_VERDICT_MALFORMED;
			m->stream_id = 0;
		} else {
			*pp = p;
			*ulenp = ulen;
		}
	}
	if (first && m->rule_id) {
		struct fb_frag_result r = {
			.stream_id = m->stream_id,
			.rule_id = m->rule_id,
			.verdict = m->verdict,
		};
		bpf_map_update_elem(&fragments, &fkey, &r, BPF_ANY);
	}
	return;

malformed:
	m->verdict = FB_VERDICT_MALFORMED;
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
	__u32 hdr = (__u32)m->l4_offset + 8;
	__u32 strip = hdr;
	// The kernel keeps at least an Ethernet header's worth of frame; a
	// shorter payload keeps some header bytes in front of it.
	if (len < strip + 14)
		strip = len - 14;

	im.rx_timestamp_ns = bpf_ktime_get_ns();
	if (m->flags & FB_FLAG_IPV6) {
		im.src[0] = p->src[0];
		im.src[1] = p->src[1];
	} else {
		__u8 *b = (__u8 *)&im.src[1];

		b[2] = 0xff;
		b[3] = 0xff;
		__builtin_memcpy(b + 4, p->src, 4);
	}
	im.buffer_id = m->stream_id;
	im.rule_id = m->rule_id;
	im.src_port = p->sport;
	im.dst_port = p->dport;
	im.payload_len = ulen - 8;
	im.payload_offset = hdr - strip;
	im.verdict = FB_VERDICT_INGEST;
	im.flags = m->flags & FB_FLAG_IPV6;

	// Size the metadata first: adjust_head carries it along, and a failure
	// here leaves the frame whole.
	long held = (long)ctx->data - (long)ctx->data_meta;
	if (bpf_xdp_adjust_meta(ctx, held - (long)sizeof(im))) {
		count_event(FB_EVENT_META_FAILED);
		return XDP_PASS;
	}
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

SEC("xdp")
int fabricbridge(struct xdp_md *ctx)
{
	struct fb_meta m = {};
	struct pkt p = {};
	__u32 ulen = 0;
	__u64 bytes = ctx->data_end - ctx->data;
	long ret;

	classify(ctx, &m, &p, &ulen);
	if (record_last) {
		__u32 zero = 0;

		bpf_map_update_elem(&last_meta, &zero, &m, BPF_ANY);
	}
	count(&verdict_counters, m.verdict, bytes);
	if (m.rule_id && m.rule_id <= MAX_RULE_ID)
		count(&rule_counters, m.rule_id, bytes);

	switch (m.verdict) {
	case FB_VERDICT_DROP:
		return XDP_DROP;
	case FB_VERDICT_STEER:
		break;
	case FB_VERDICT_INGEST:
		return ingest(ctx, &m, &p, ulen);
	default:
		return XDP_PASS;
	}

	m.rx_timestamp_ns = bpf_ktime_get_ns();
	// Size the metadata area to exactly our struct, whatever it held
	// before (empty from a driver; ours again when a test run repeats).
	long held = (long)ctx->data - (long)ctx->data_meta;
	if (bpf_xdp_adjust_meta(ctx, held - (long)sizeof(m))) {
		count_event(FB_EVENT_META_FAILED);
		return XDP_PASS;
	}
	struct fb_meta *meta = (void *)(long)ctx->data_meta;
	if ((void *)(meta + 1) > (void *)(long)ctx->data) {
		count_event(FB_EVENT_META_FAILED);
		return XDP_PASS;
	}
	*meta = m;

	ret = bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS);
	if (ret != XDP_REDIRECT)
		count_event(FB_EVENT_REDIRECT_FAILED);
	return ret;
}

// pass_all is the yardstick the benchmarks measure fabricbridge against.
SEC("xdp")
int pass_all(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char _license[] SEC("license") = "Dual MIT/GPL";

// SPDX-License-Identifier: (MIT OR GPL-2.0-only)
//
// What fabricbridge.c shares with user space: the metadata it writes in front
// of redirected frames, the keys and values of its tables, and the numbers
// both sides must agree on. bpf2go renders every type here in Go
// (bpf_bpfel.go); package classifier holds the hand-written mirrors, and
// layout_test.go proves the two sides equal.

#ifndef FABRICBRIDGE_H
#define FABRICBRIDGE_H

#include <linux/types.h>

// Limits; classifier.MaxRules, MaxRuleID, MaxExtHeaders and
// DefaultFragmentCapacity.
enum fb_limit {
	FB_MAX_RULES = 1024,
	FB_MAX_RULE_ID = 16383, // rule ids index the per-rule counters
	FB_MAX_EXT_HEADERS = 8, // IPv6 extension headers the parser walks
	FB_FRAG_ENTRIES = 8192,
	// Distinct spread tables (struct fb_spread) the program holds at
	// once: each is half a megabyte of kernel memory.
	FB_MAX_SPREADS = 256,
	FB_MAX_SPREAD_SLOTS = 65537, // maglev.DefaultSize
	// Indices of the spreads map. User space never rewrites a table a
	// listener points to: a changed spread gets a fresh index, and a
	// freed index is cleared one update later and reused no sooner than
	// the update after, so three generations of FB_MAX_SPREADS tables,
	// and index 0 for none.
	FB_SPREAD_INDICES = 3 * FB_MAX_SPREADS + 1,
};

// Families in the tables and rules are the IP version; 0 in a rule: any.
#define FB_FAMILY_IPV4 4
#define FB_FAMILY_IPV6 6

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
	FB_FLAG_SECOND_CHANCE = 8, // steered by a spread slot with another previous owner
};

// Events that are not verdicts, counted per CPU.
enum fb_event {
	FB_EVENT_REDIRECT_FAILED = 0, // no AF_XDP socket on the queue: the kernel got it
	FB_EVENT_META_FAILED = 1,     // the driver gave no metadata room: the kernel got it
	FB_EVENT_STRIP_FAILED = 2,    // an ingest frame could not be stripped: the kernel got it whole
	FB_NUM_EVENTS = 3,
};

// Written in front of every steered frame; classifier.Meta.
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
_Static_assert(sizeof(struct fb_meta) == 24, "fb_meta is classifier.MetaSize bytes");

// Written in front of every ingest frame, after its headers are stripped;
// classifier.IngestMeta. Like fb_meta it ends with the verdict and flags, so
// the byte in front of a frame names the layout.
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
_Static_assert(sizeof(struct fb_ingest_meta) == 40, "fb_ingest_meta is classifier.IngestMetaSize bytes");
_Static_assert(FB_MAX_RULE_ID <= 0xffff, "rule ids fit fb_ingest_meta.rule_id");

// The IPv6 flows table's key: classifier.FlowKey in the kernel's layout.
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

// The IPv4 flows table's key: classifier.FlowKey of an IPv4 flow. The
// kernel hashes a key with jhash, whose cost grows with every 12 bytes; at
// 16 bytes an IPv4 flow hit costs about 10 ns less than under fb_flow_key
// (docs/performance.md), so IPv4 flows, the common ones, get a table of
// their own. The family is the table's.
struct fb_flow4_key {
	__u32 src; // the address's bytes in order
	__u32 dst;
	__u16 sport;
	__u16 dport;
	__u8 proto;
	__u8 pad[3];
};
_Static_assert(sizeof(struct fb_flow4_key) == 16, "fb_flow4_key is 16 bytes");

// The listeners table's key: classifier.ListenKey in the kernel's layout.
struct fb_listen_key {
	__u8 family;
	__u8 proto;
	__u16 port;
	__u32 addr[4]; // all zero: any address of the family
};

// The value of the flows tables; classifier.Target.
struct fb_target {
	__u32 stream_id;
	__u32 rule_id;
};

// The value of the listeners table: classifier.Target and, for a listener
// shared by instances, the index of its table in the spreads map. The flows
// table keeps the narrower fb_target: it is the big one, and its entries
// never spread.
struct fb_listener {
	__u32 stream_id;
	__u32 rule_id;
	__u32 spread; // 0: none; the stream is then stream_id
};

// One slot of a spread; classifier.Slot.
struct fb_slot {
	__u32 current;
	__u32 previous; // 0: none
};

// A listener's consistent-hash table, classifier.Spread: the one value of an
// inner map of spreads, so that seed, size and slots change together.
struct fb_spread {
	__u64 seed;
	__u32 nslots; // 1..FB_MAX_SPREAD_SLOTS
	__u32 pad;
	struct fb_slot slots[FB_MAX_SPREAD_SLOTS];
};

// A first fragment's datagram, the fragments table's key.
struct fb_frag_key {
	__u8 family;
	__u8 proto;
	__u16 pad;
	__u32 id;
	__u64 src[2];
	__u64 dst[2];
};

// How a first fragment was decided, for the fragments that follow it.
struct fb_frag_result {
	__u32 stream_id;
	__u32 rule_id;
	__u8 verdict;
	__u8 pad[3];
};

// classifier.CompiledRule in the kernel's layout.
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

// The rules in match order: the one value of an inner rule map.
struct fb_ruleset {
	__u32 count;
	__u32 pad;
	struct fb_rule rules[FB_MAX_RULES];
};

// The value of the per-CPU verdict and rule counters.
struct fb_counter {
	__u64 packets;
	__u64 bytes;
};

#endif

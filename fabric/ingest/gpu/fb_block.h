// SPDX-License-Identifier: MIT
//
// fb_block.h: what one block does with one buffer before its turn, in
// shared memory only: find the records, decode them, and summarise each
// source's. trigger.cu includes it for the GPU; testdata/block_host.cpp
// includes it for the host, with a thread per CUDA thread, and checks it
// against a sequential walk (TestBlockOnHost). The includer defines FB_DEV,
// FB_DEV_MEMBER, tid(), block_sync(), warp_sync(), shfl_up32(), match_any32(),
// popc32(), atomic_add32(), atomic_max32() and atomic_add64().
//
// Every step is parallel over the buffer's 8-byte slots or its records:
// a buffer's cost grows with the logarithm of its records, not with them.
//
//   parse      a buffer of records of one size is checked in one pass;
//              otherwise a slot is a candidate record if its header is
//              plausible and a plausible header points at it, and pointer
//              jumping over the candidates ranks the chain from slot 0
//              (log2 records rounds)
//   decode     a thread per record: header, sender sequence, hit energies
//              (8 bytes at a time), a block reduction of the energies
//   sort       records by source, stably (per-warp histograms, match.any)
//   summarise  three segmented block scans over the sorted records: each
//              source's first and last sender sequence, the sender state
//              before each record (a running maximum), and the sums and
//              gap ranks the fold applies in turn
#ifndef FB_BLOCK_H
#define FB_BLOCK_H

#include "fb_trigger.h"

#define NONE 0xffff
#define LOCAL_GAPS 256
#define WARPS (FB_TRIGGER_THREADS / 32)
#define PER_THREAD (FB_TRIGGER_CHUNK / FB_TRIGGER_THREADS) // sorted records a thread scans
#define PER_WARP (FB_TRIGGER_CHUNK / WARPS)                // records a warp sorts
#define PAR_SLOTS 8192 // 8-byte slots parse indexes: buffers up to 64 KiB
#define PAR_NODES 2048 // candidates it follows; more (a payload full of headers) and one thread walks
// fb_ingest_record's u32 at 20: the source entry's generation (source_gen,
// "reserved" before it had one). A new generation is a new source.
#define REC_GEN 20
#define FB_TRIGGER_SEQ_LEN 4 // ingest.TriggerSeqLen: the sender sequence in front of the hits
// Sender sequence numbers within this distance of a source's first in the
// buffer compare as integers, so its state is a running maximum; a source
// whose numbers spread further replays its records in turn.
#define SEQ_WINDOW (1 << 30)

// A gap found before the turn, kept in shared memory until the fold knows
// whether it can be among the first FB_TRIGGER_MAX_GAPS.
struct local_gap {
	uint32_t key;
	uint16_t source;
	uint16_t sender;
	uint32_t want;
	uint32_t got;
	uint32_t rank; // gaps of its source before it in this buffer
};

// A source's records in this buffer, summarised for the fold: everything
// that does not depend on the records before the buffer.
struct source_summary {
	uint32_t have_t; // a record long enough for a sender sequence
	uint32_t t1;     // the first such record's sender sequence ...
	uint32_t t1_i;   // ... and index
	uint32_t last_t; // the last one's
	uint32_t nexts;  // the sender sequence expected after the buffer, given t1 accepted
	uint32_t bytes;
	uint32_t shorts;
	uint32_t back;   // sender numbers behind, after the first
	uint32_t gaps;   // gaps after the first record (ring and sender)
	uint32_t pad;
	uint64_t dropped;
	uint64_t sgaps;
};

// One block's view of the buffer in hand.
struct block_shared {
	struct fb_trigger_job job;
	const uint8_t *data; // staged copy, or the buffer where it lies
	uint32_t go;         // persistent mode: 1 to go on, 0 to stop
	uint32_t n;          // records decoded in this chunk
	uint32_t bad;        // an fb_trigger_errors code, 0 none
	uint32_t bad_record;
	uint32_t next_off;   // where the next chunk starts
	uint32_t gaps;       // gaps found in this buffer
	uint32_t gaps_before;
	uint32_t source_slots; // the running totals as the turn found them
	uint64_t window_energy;
	uint64_t windows, triggers, buffers, records;
	uint32_t max_source;
	uint64_t energy;
	uint32_t fast;       // the buffer takes the fast path (see process)
	uint32_t nlocal;     // entries in local
	uint32_t overflow;   // local overflowed: every source replays
	uint32_t ncand;      // parse's candidates
	uint64_t results_read; // the host's, as last read
	uint64_t prof_mark;    // thread 0's clock at the end of the last phase
	uint64_t prof[FB_TRIGGER_PHASES];
	uint8_t replay[FB_TRIGGER_THREADS]; // the source replays its records in turn
	uint16_t seg_start[FB_TRIGGER_THREADS]; // per source: its first in sorted ...
	uint16_t seg_count[FB_TRIGGER_THREADS]; // ... and how many
	uint16_t sorted[FB_TRIGGER_CHUNK];      // record indices by (source, index)
	uint32_t scan_flag[WARPS];              // block scans: each warp's aggregate
	uint64_t scan_agg[WARPS][4];
	struct local_gap local[LOCAL_GAPS];
	uint32_t off[FB_TRIGGER_CHUNK];
	uint32_t ring[FB_TRIGGER_CHUNK];
	uint32_t sender[FB_TRIGGER_CHUNK];
	uint32_t gen[FB_TRIGGER_CHUNK];
	uint16_t src[FB_TRIGGER_CHUNK];
	uint16_t plen[FB_TRIGGER_CHUNK];
	union {
		struct {
			uint16_t cid[PAR_SLOTS];     // slot: its candidate + 1, or 0
			uint16_t slot[PAR_NODES];    // candidate: its slot
			uint16_t jump[2][PAR_NODES]; // candidate: the one 2^k records on, or NONE
			uint16_t rank[PAR_NODES];    // candidate: its record index, or NONE
		} parse;
		struct {
			uint16_t hist[WARPS][FB_TRIGGER_THREADS]; // per warp and source: records, then sorted offset
			uint16_t lrank[FB_TRIGGER_CHUNK];         // a record's rank in its warp and source
			struct source_summary sum[FB_TRIGGER_THREADS];
		} sum;
	} u;
};

// slot_valid says whether the 8-byte slot j starts a record that walk would
// accept there, and where the next would start (a slot index).
FB_DEV uint32_t slot_valid(const struct block_shared *sh, uint32_t j, uint32_t *next)
{
	uint32_t bytes = sh->job.bytes, off = 8 * j;
	if (off + FB_INGEST_RECORD_HEADER > bytes)
		return 0;
	uint64_t w = *(const uint64_t *)(sh->data + off);
	uint32_t size = (uint32_t)w, plen = (uint32_t)(w >> 32) & 0xffff, src = (uint32_t)(w >> 48);
	if (size < FB_INGEST_RECORD_HEADER || size % FB_INGEST_RECORD_ALIGN != 0 || size > bytes - off ||
	    plen > size - FB_INGEST_RECORD_HEADER || src >= sh->job.sources)
		return 0;
	*next = j + size / 8;
	return 1;
}

// walk (thread 0) finds up to a chunk of records from off, checking each
// as ingest.RecordIter does: the sequential twin of parse.
FB_DEV void walk(struct block_shared *sh, uint32_t first, uint32_t off)
{
	const uint8_t *data = sh->data;
	uint32_t bytes = sh->job.bytes, left = sh->job.records - first, n = 0;
	sh->bad = 0;
	while (n < FB_TRIGGER_CHUNK && n < left) {
		if (bytes - off < FB_INGEST_RECORD_HEADER) {
			sh->bad = FB_TRIGGER_ERECORD;
			break;
		}
		uint64_t w = *(const uint64_t *)(data + off);
		uint32_t size = (uint32_t)w, plen = (uint32_t)(w >> 32) & 0xffff, src = (uint32_t)(w >> 48);
		if (size < FB_INGEST_RECORD_HEADER || size % FB_INGEST_RECORD_ALIGN != 0 || size > bytes - off ||
		    plen > size - FB_INGEST_RECORD_HEADER || src >= sh->job.sources) {
			sh->bad = FB_TRIGGER_ERECORD;
			break;
		}
		sh->off[n++] = off;
		off += size;
	}
	if (!sh->bad && n == left && off != bytes)
		sh->bad = FB_TRIGGER_ETRAILER;
	sh->bad_record = first + n;
	sh->n = n;
	sh->next_off = off;
}

// parse_uniform (all threads) is parse for the common buffer whose records
// all have the first one's size, as a sender of fixed-size trigger
// primitives makes them: record i is then at i times that size, so one
// pass that checks each header where it must be (as walk would) stands in
// for ranking the chain. 0, with nothing of parse's done, for any other
// buffer: parse ranks it. sh->bad carries the verdict between barriers;
// parse and the success path both set it afterwards.
FB_DEV int parse_uniform(struct block_shared *sh)
{
	uint32_t bytes = sh->job.bytes, records = sh->job.records, next;
	uint32_t size = *(const uint32_t *)sh->data, step = size / 8;
	int fits = records > 0 && size >= FB_INGEST_RECORD_HEADER && size % 8 == 0 && (uint64_t)size * records == bytes;
	if (tid() == 0)
		sh->bad = !fits;
	block_sync();
	if (fits)
		for (uint32_t i = tid(); i < records; i += FB_TRIGGER_THREADS) {
			uint32_t j = i * step;
			if (!slot_valid(sh, j, &next) || next != j + step) {
				sh->bad = 1; // any thread that finds one: the same store
				break;
			}
			sh->off[i] = 8 * j;
		}
	block_sync();
	uint32_t other = sh->bad;
	block_sync(); // everyone has read the verdict before it is overwritten
	if (other)
		return 0;
	if (tid() == 0) {
		sh->n = records;
		sh->bad = 0;
		sh->bad_record = records;
		sh->next_off = 0;
		sh->ncand = 0;
	}
	block_sync();
	return 1;
}

// parse (all threads) is walk over a whole staged buffer of at most
// FB_TRIGGER_CHUNK records and PAR_SLOTS slots, in parallel: the same
// n, off, bad and bad_record. The chain of records from slot 0 runs through
// candidates only (a record's successor is plausible and pointed at), so
// ranking the candidates by pointer jumping from slot 0 finds it; garbage
// candidates inside payloads are never reached from slot 0 and stay
// unranked. 0 when there are more than PAR_NODES candidates: walk then.
FB_DEV int parse(struct block_shared *sh)
{
	if (parse_uniform(sh))
		return 1;
	uint32_t t = tid(), bytes = sh->job.bytes, slots = bytes / 8, records = sh->job.records, next;
	uint16_t *cid = sh->u.parse.cid, *slot = sh->u.parse.slot, *rank = sh->u.parse.rank;
	// Each slot's header is checked once; the jump tables are free until
	// the candidates are numbered.
	uint8_t *valid = (uint8_t *)sh->u.parse.jump;
	static_assert(sizeof sh->u.parse.jump >= PAR_SLOTS, "a byte per slot");
	for (uint32_t j = t; j < slots; j += FB_TRIGGER_THREADS) {
		cid[j] = 0;
		valid[j] = slot_valid(sh, j, &next);
	}
	if (t == 0)
		sh->ncand = 0;
	block_sync();
	for (uint32_t j = t; j < slots; j += FB_TRIGGER_THREADS) {
		if (!valid[j])
			continue;
		next = j + *(const uint32_t *)(sh->data + 8 * j) / 8;
		if (j == 0)
			cid[0] = 1;
		if (next < slots && valid[next])
			cid[next] = 1;
	}
	block_sync();
	uint32_t mine = 0;
	for (uint32_t j = t; j < slots; j += FB_TRIGGER_THREADS)
		mine += cid[j] != 0;
	uint32_t c = mine ? atomic_add32(&sh->ncand, mine) : 0;
	for (uint32_t j = t; j < slots && mine; j += FB_TRIGGER_THREADS) {
		if (!cid[j])
			continue;
		if (c < PAR_NODES) {
			slot[c] = j;
			cid[j] = c + 1;
		}
		c++;
	}
	block_sync();
	uint32_t m = sh->ncand;
	if (m > PAR_NODES)
		return 0;
	for (c = t; c < m; c += FB_TRIGGER_THREADS) {
		slot_valid(sh, slot[c], &next);
		sh->u.parse.jump[0][c] = next < slots && cid[next] ? cid[next] - 1 : NONE;
		rank[c] = slot[c] == 0 ? 0 : NONE;
	}
	if (t == 0) {
		// Unless the chain says otherwise (below): all records, or none
		// if slot 0 holds no record.
		sh->n = cid[0] ? records : 0;
		sh->bad = cid[0] ? 0 : FB_TRIGGER_ERECORD;
		sh->bad_record = sh->n;
		sh->next_off = 0;
	}
	block_sync();
	// After round k every candidate within 2^(k+1) records of slot 0 is
	// ranked: the one 2^k on from each ranked below 2^k. A rank is written
	// once; a candidate read in the round it is ranked fails r < 2^k either
	// way.
	uint32_t cur = 0;
	for (uint32_t k = 0; (1u << k) < records; k++) {
		const uint16_t *from = sh->u.parse.jump[cur];
		uint16_t *to = sh->u.parse.jump[cur ^ 1];
		for (c = t; c < m; c += FB_TRIGGER_THREADS) {
			uint32_t r = rank[c], nx = from[c];
			if (nx == NONE) {
				to[c] = NONE;
				continue;
			}
			if (r < (1u << k))
				rank[nx] = r + (1u << k);
			to[c] = from[nx];
		}
		block_sync();
		cur ^= 1;
	}
	// The chain's records in order; where it stops short of the count, or
	// goes on past it, the error walk would report (one candidate writes).
	for (c = t; c < m; c += FB_TRIGGER_THREADS) {
		uint32_t r = rank[c];
		if (r >= records)
			continue;
		slot_valid(sh, slot[c], &next);
		sh->off[r] = 8 * slot[c];
		if (r == records - 1) {
			if (8 * next != bytes)
				sh->bad = FB_TRIGGER_ETRAILER;
		} else if (!(next < slots && cid[next])) {
			sh->n = r + 1;
			sh->bad_record = r + 1;
			sh->bad = FB_TRIGGER_ERECORD;
		}
	}
	block_sync();
	return 1;
}

// hits sums the big-endian 16-bit hit energies in one 8-byte word of a
// payload of plen bytes, the word at payload offset q; the first 4 bytes of
// a payload are the sender sequence, not hits.
FB_DEV uint32_t hits(uint64_t w, uint32_t q, uint32_t plen)
{
	uint64_t keep = 0;
	for (uint32_t m = 0; m < 4; m++)
		if (q + 2 * m >= FB_TRIGGER_SEQ_LEN && q + 2 * m + 2 <= plen)
			keep |= (uint64_t)0xffff << (16 * m);
	w &= keep;
	uint64_t hi = w & 0x00ff00ff00ff00ffull, lo = (w >> 8) & 0x00ff00ff00ff00ffull;
	// Each 16-bit lane holds a byte: a multiply adds the four into the top lane.
	return (uint32_t)((hi * 0x0001000100010001ull) >> 48) * 256 + (uint32_t)((lo * 0x0001000100010001ull) >> 48);
}

FB_DEV uint32_t be32(uint32_t le)
{
	return le << 24 | (le & 0xff00) << 8 | (le >> 8 & 0xff00) | le >> 24;
}

// warp_sum64 and warp_max32 leave the warp's total in lane 31.
FB_DEV uint64_t warp_sum64(uint64_t v)
{
	uint32_t lane = tid() & 31;
	for (uint32_t d = 1; d < 32; d <<= 1) {
		uint64_t o = (uint64_t)shfl_up32((uint32_t)(v >> 32), d) << 32 | shfl_up32((uint32_t)v, d);
		if (lane >= d)
			v += o;
	}
	return v;
}

FB_DEV uint32_t warp_max32(uint32_t v)
{
	uint32_t lane = tid() & 31;
	for (uint32_t d = 1; d < 32; d <<= 1) {
		uint32_t o = shfl_up32(v, d);
		if (lane >= d && o > v)
			v = o;
	}
	return v;
}

// decode (all threads) reads each record of the chunk: its source, sequences
// and generation, and adds its hit energies to the buffer's. Thread i%256
// takes record i and reads its payload a word at a time, starting at a word
// that depends on the lane, so that a warp's reads of equal-sized records
// fall in different banks.
FB_DEV void decode(struct block_shared *sh)
{
	uint64_t energy = 0;
	uint32_t maxsrc = 0, n = sh->n;
	for (uint32_t base = 0; base < n; base += FB_TRIGGER_THREADS) {
		uint32_t i = base + tid();
		if (i >= n)
			break;
		const uint8_t *r = sh->data + sh->off[i];
		uint64_t w0 = *(const uint64_t *)r;
		uint32_t plen = (uint32_t)(w0 >> 32) & 0xffff, src = (uint32_t)(w0 >> 48), seq = 0, e = 0;
		const uint8_t *p = r + FB_INGEST_RECORD_HEADER;
		if (plen >= FB_TRIGGER_SEQ_LEN) {
			uint32_t words = (plen + 7) / 8, k = tid() % words;
			for (uint32_t left = words; left; left--) {
				uint64_t w = *(const uint64_t *)(p + 8 * k);
				if (k == 0)
					seq = be32((uint32_t)w);
				e += hits(w, 8 * k, plen);
				if (++k == words)
					k = 0;
			}
		}
		sh->src[i] = src;
		sh->plen[i] = plen;
		sh->ring[i] = *(const uint32_t *)(r + 16);
		sh->gen[i] = *(const uint32_t *)(r + REC_GEN);
		sh->sender[i] = seq;
		energy += e;
		maxsrc = src > maxsrc ? src : maxsrc;
	}
	// Every lane of every warp reaches the reductions.
	energy = warp_sum64(energy);
	maxsrc = warp_max32(maxsrc);
	if ((tid() & 31) == 31) {
		if (energy)
			atomic_add64(&sh->energy, energy);
		atomic_max32(&sh->max_source, maxsrc);
	}
}

FB_DEV void local_gap(struct block_shared *sh, uint32_t s, uint32_t key, uint32_t sender, uint32_t want, uint32_t got,
		      uint32_t rank)
{
	if (rank >= FB_TRIGGER_MAX_GAPS)
		return;
	uint32_t k = atomic_add32(&sh->nlocal, 1);
	if (k >= LOCAL_GAPS) {
		sh->overflow = 1;
		return;
	}
	struct local_gap *g = &sh->local[k];
	g->key = key;
	g->source = s;
	g->sender = sender;
	g->want = want;
	g->got = got;
	g->rank = rank;
}

// block_excl_sum (all threads) is the sum of v over the threads before this one.
FB_DEV uint32_t block_excl_sum(struct block_shared *sh, uint32_t v)
{
	uint32_t lane = tid() & 31, warp = tid() / 32, x = v;
	for (uint32_t d = 1; d < 32; d <<= 1) {
		uint32_t o = shfl_up32(x, d);
		if (lane >= d)
			x += o;
	}
	if (lane == 31)
		sh->scan_flag[warp] = x;
	block_sync();
	for (uint32_t u = 0; u < warp; u++)
		x += sh->scan_flag[u];
	block_sync();
	return x - v;
}

// sort_by_source (all threads) fills sorted with the chunk's record indices
// ordered by source, then index, and seg_start/seg_count per source. Warp w
// counts records w*PER_WARP... 32 at a time: lanes with the same source
// (match.any) rank themselves among each other and after the warp's count
// so far; the counts of all warps, in source-major order, give the offsets.
FB_DEV void sort_by_source(struct block_shared *sh)
{
	uint32_t t = tid(), lane = t & 31, warp = t / 32, n = sh->n;
	uint16_t (*hist)[FB_TRIGGER_THREADS] = sh->u.sum.hist;
	for (uint32_t w = 0; w < WARPS; w++)
		hist[w][t] = 0;
	block_sync();
	for (uint32_t k = 0; k < PER_WARP / 32; k++) {
		uint32_t i = warp * PER_WARP + k * 32 + lane;
		uint32_t key = i < n ? sh->src[i] : 0x10000;
		uint32_t peers = match_any32(key);
		if (i < n)
			sh->u.sum.lrank[i] = hist[warp][key] + popc32(peers & ((1u << lane) - 1));
		warp_sync();
		if (i < n && peers >> lane == 1) // the last of its source in this round
			hist[warp][key] += popc32(peers);
		warp_sync();
	}
	block_sync();
	uint32_t count = 0;
	for (uint32_t w = 0; w < WARPS; w++) {
		uint32_t c = hist[w][t];
		hist[w][t] = count;
		count += c;
	}
	uint32_t start = block_excl_sum(sh, count);
	sh->seg_start[t] = start;
	sh->seg_count[t] = count;
	for (uint32_t w = 0; w < WARPS; w++)
		hist[w][t] += start;
	block_sync();
	for (uint32_t i = t; i < n; i += FB_TRIGGER_THREADS)
		sh->sorted[hist[i / PER_WARP][sh->src[i]] + sh->u.sum.lrank[i]] = i;
	block_sync();
}

// shfl_up_of moves a whole struct of 32-bit words up d lanes (the host
// emulation brings its own, one exchange for all words).
#ifndef FB_HAVE_SHFL_UP_OF
template <typename T> FB_DEV T shfl_up_of(T v, uint32_t d)
{
	union {
		T v;
		uint32_t w[sizeof(T) / 4];
	} a, b;
	a.v = v;
	#pragma unroll
	for (uint32_t k = 0; k < sizeof(T) / 4; k++)
		b.w[k] = shfl_up32(a.w[k], d);
	return b.v;
}
#endif

// seg_scan (all threads) scans the PER_THREAD consecutive values each
// thread holds, segments starting where head has a bit, with the
// associative op of identity id: incl and excl, within each segment.
template <typename T, typename Op>
FB_DEV void seg_scan(struct block_shared *sh, const T *v, uint32_t head, Op op, T id, T *incl, T *excl)
{
	uint32_t lane = tid() & 31, warp = tid() / 32;
	T acc = id;
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		acc = head >> e & 1 ? v[e] : op(acc, v[e]);
		incl[e] = acc;
	}
	// The threads' aggregates, segmented, across the warp ...
	T x = acc;
	uint32_t f = head != 0;
	for (uint32_t d = 1; d < 32; d <<= 1) {
		T y = shfl_up_of(x, d);
		uint32_t g = shfl_up32(f, d);
		if (lane >= d) {
			if (!f)
				x = op(y, x);
			f |= g;
		}
	}
	T xp = shfl_up_of(x, 1);
	uint32_t fp = shfl_up32(f, 1);
	if (lane == 31) {
		__builtin_memcpy(sh->scan_agg[warp], &x, sizeof(T));
		sh->scan_flag[warp] = f;
	}
	block_sync();
	// ... and across the warps before.
	T carry = id;
	for (uint32_t u = 0; u < warp; u++) {
		T a;
		__builtin_memcpy(&a, sh->scan_agg[u], sizeof(T));
		carry = sh->scan_flag[u] ? a : op(carry, a);
	}
	block_sync();
	T run = lane == 0 ? carry : fp ? xp : op(carry, xp);
	uint32_t started = 0;
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		started |= head >> e & 1;
		excl[e] = head >> e & 1 ? id : run;
		if (!started)
			incl[e] = op(run, v[e]);
		run = incl[e];
	}
}

struct first_last {
	uint32_t has, t1, t1_i, last_t;
};
struct sums {
	uint32_t bytes, shorts, back, gaps;
	uint64_t dropped, sgaps;
};

struct first_last_op {
	FB_DEV_MEMBER struct first_last operator()(struct first_last a, struct first_last b) const
	{
		struct first_last r = {a.has | b.has, a.has ? a.t1 : b.t1, a.has ? a.t1_i : b.t1_i, b.has ? b.last_t : a.last_t};
		return r;
	}
};
struct max_op {
	FB_DEV_MEMBER int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};
struct sums_op {
	FB_DEV_MEMBER struct sums operator()(struct sums a, struct sums b) const
	{
		struct sums r = {a.bytes + b.bytes, a.shorts + b.shorts, a.back + b.back, a.gaps + b.gaps,
				 a.dropped + b.dropped, a.sgaps + b.sgaps};
		return r;
	}
};

// summarise (all threads) sorts the chunk's records by source and writes
// each source's summary: the checks of every record against the one
// before it of its source, listed in local; only each source's first
// record is left for the turn. A source whose records change generation
// or whose sender numbers spread beyond SEQ_WINDOW is marked to replay.
FB_DEV void summarise(struct block_shared *sh)
{
	sort_by_source(sh);
	uint32_t t = tid(), n = sh->n, head = 0, valid = 0;
	uint32_t idx[PER_THREAD], prev[PER_THREAD], s[PER_THREAD], nonshort = 0;
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		uint32_t p = PER_THREAD * t + e;
		idx[e] = prev[e] = NONE;
		s[e] = 0;
		if (p >= n) {
			head |= 1u << e; // an empty segment of its own
			continue;
		}
		idx[e] = sh->sorted[p];
		s[e] = sh->src[idx[e]];
		valid |= 1u << e;
		if (p == sh->seg_start[s[e]])
			head |= 1u << e;
		else
			prev[e] = sh->sorted[p - 1];
		if (sh->plen[idx[e]] >= FB_TRIGGER_SEQ_LEN)
			nonshort |= 1u << e;
	}
	// Each source's first and last sender sequence, up to each record.
	struct first_last fl[PER_THREAD], fl_in[PER_THREAD], fl_ex[PER_THREAD], fl_id = {0, 0, 0, 0};
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		fl[e] = fl_id;
		if (nonshort >> e & 1) {
			uint32_t seq = sh->sender[idx[e]];
			struct first_last x = {1, seq, idx[e], seq};
			fl[e] = x;
		}
	}
	seg_scan(sh, fl, head, first_last_op(), fl_id, fl_in, fl_ex);
	// The sender state before each record: relative to the first, the
	// reference's "expected next" is the running maximum of seq+1.
	int32_t u[PER_THREAD], mx[PER_THREAD], mx_in[PER_THREAD], mx_ex[PER_THREAD];
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		u[e] = 0;
		mx[e] = INT32_MIN;
		if (!(nonshort >> e & 1))
			continue;
		u[e] = (int32_t)(sh->sender[idx[e]] - fl_in[e].t1);
		if (u[e] <= -SEQ_WINDOW || u[e] >= SEQ_WINDOW)
			sh->replay[s[e]] = 1;
		else
			mx[e] = u[e] + 1;
	}
	seg_scan(sh, mx, head, max_op(), (int32_t)INT32_MIN, mx_in, mx_ex);
	// Each record against the one before it of its source.
	struct sums v[PER_THREAD], v_in[PER_THREAD], v_ex[PER_THREAD], zero = {0, 0, 0, 0, 0, 0};
	uint32_t ring_gap = 0, sender_gap = 0;
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		v[e] = zero;
		if (!(valid >> e & 1))
			continue;
		uint32_t i = idx[e];
		v[e].bytes = sh->plen[i];
		if (prev[e] != NONE) {
			if (sh->gen[i] != sh->gen[prev[e]])
				sh->replay[s[e]] = 1;
			if (sh->ring[i] != sh->ring[prev[e]] + 1) {
				ring_gap |= 1u << e;
				v[e].gaps++;
				v[e].dropped = (uint32_t)(sh->ring[i] - (sh->ring[prev[e]] + 1));
			}
		}
		if (!(nonshort >> e & 1)) {
			v[e].shorts = 1;
		} else if (mx_ex[e] != INT32_MIN) {
			int32_t d = u[e] - mx_ex[e];
			if (d > 0) {
				sender_gap |= 1u << e;
				v[e].gaps++;
				v[e].sgaps = (uint32_t)d;
			} else if (d < 0) {
				v[e].back = 1;
			}
		}
	}
	seg_scan(sh, v, head, sums_op(), zero, v_in, v_ex);
	#pragma unroll
	for (uint32_t e = 0; e < PER_THREAD; e++) {
		if (!(valid >> e & 1))
			continue;
		uint32_t i = idx[e], rg = ring_gap >> e & 1;
		if (rg)
			local_gap(sh, s[e], i * 2, 0, sh->ring[prev[e]] + 1, sh->ring[i], v_ex[e].gaps);
		if (sender_gap >> e & 1)
			local_gap(sh, s[e], i * 2 + 1, 1, fl_in[e].t1 + (uint32_t)mx_ex[e], sh->sender[i], v_ex[e].gaps + rg);
		if (PER_THREAD * t + e != sh->seg_start[s[e]] + sh->seg_count[s[e]] - 1u)
			continue;
		struct source_summary *m = &sh->u.sum.sum[s[e]];
		m->have_t = fl_in[e].has;
		m->t1 = fl_in[e].t1;
		m->t1_i = fl_in[e].t1_i;
		m->last_t = fl_in[e].last_t;
		m->nexts = fl_in[e].t1 + (uint32_t)mx_in[e];
		m->bytes = v_in[e].bytes;
		m->shorts = v_in[e].shorts;
		m->back = v_in[e].back;
		m->gaps = v_in[e].gaps;
		m->dropped = v_in[e].dropped;
		m->sgaps = v_in[e].sgaps;
	}
	block_sync();
}

#endif /* FB_BLOCK_H */

// SPDX-License-Identifier: MIT
//
// trigger.cu: the GPU trigger over an ingest ring, the CUDA twin of
// ingest.Reference. Built to PTX by Debian's clang without CUDA's headers
// (see gen.go); the driver compiles the PTX for the GPU at load.
//
// Each buffer goes through a block of FB_TRIGGER_THREADS threads in two
// stages. Stage A runs in parallel across blocks, and within the block in
// parallel over the buffer's slots and records (fb_block.h): stage the
// buffer in shared memory, find its records, decode them and summarise
// each source's. Stage B is the reference's sequential fold, taken in publication order
// through a turn ticket in device memory: each source's summary is applied
// to its running counts, so per-source counts and gaps come out exactly as
// the CPU's; thread 0 closes the window, passes the turn on and publishes
// the result. Many blocks keep many buffers in stage A while one folds.
// Buffers that do not fit the fast path (see fast) replay every record in
// turn instead: the same results, slower.

#include "fb_trigger.h"

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline))
#define __launch_bounds__(n) __attribute__((launch_bounds(n)))

typedef uint32_t u32x4 __attribute__((ext_vector_type(4)));

static __device__ __forceinline__ unsigned tid() { return __nvvm_read_ptx_sreg_tid_x(); }
static __device__ __forceinline__ unsigned bid() { return __nvvm_read_ptx_sreg_ctaid_x(); }
static __device__ __forceinline__ unsigned nblocks() { return __nvvm_read_ptx_sreg_nctaid_x(); }

// Shared words of the ring and the control block live in host memory: sys
// scope. The turn ticket lives in device memory: gpu scope.
static __device__ __forceinline__ uint32_t ld_acquire_sys32(const void *p)
{
	uint32_t v;
	asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
	return v;
}
static __device__ __forceinline__ uint64_t ld_acquire_sys64(const void *p)
{
	uint64_t v;
	asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
	return v;
}
static __device__ __forceinline__ void st_release_sys32(void *p, uint32_t v)
{
	asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
static __device__ __forceinline__ void st_release_sys64(void *p, uint64_t v)
{
	asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
static __device__ __forceinline__ uint64_t ld_acquire_gpu64(const void *p)
{
	uint64_t v;
	asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
	return v;
}
static __device__ __forceinline__ void st_release_gpu64(void *p, uint64_t v)
{
	asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// The buffer's bytes are read past L1 (cached in L2 at most): a buffer
// comes round again with new data at the same addresses.
static __device__ __forceinline__ u32x4 ld_cg128(const void *p)
{
	u32x4 v;
	asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
		     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
		     : "l"(p));
	return v;
}
static __device__ __forceinline__ uint64_t ld_cg64(const void *p)
{
	uint64_t v;
	asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p));
	return v;
}
// ld_volatile_desc reads a descriptor as eight words: state|records, seq,
// bytes|flags, first_ns, last_ns, window_ns, publish_ns, reserved.
static __device__ __forceinline__ void ld_volatile_desc(const void *p, uint64_t w[8])
{
	asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(w[0]), "=l"(w[1]) : "l"(p));
	asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2+16];" : "=l"(w[2]), "=l"(w[3]) : "l"(p));
	asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2+32];" : "=l"(w[4]), "=l"(w[5]) : "l"(p));
	asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2+48];" : "=l"(w[6]), "=l"(w[7]) : "l"(p));
}
static __device__ __forceinline__ uint32_t ld_volatile32(const void *p)
{
	return *(const volatile uint32_t *)p;
}
static __device__ __forceinline__ void pause(uint32_t ns)
{
	asm volatile("nanosleep.u32 %0;" ::"r"(ns));
}
static __device__ __forceinline__ uint64_t globaltimer()
{
	uint64_t t;
	asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
	return t;
}
static __device__ __forceinline__ uint64_t clock64()
{
	uint64_t t;
	asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
	return t;
}
static __device__ __forceinline__ uint32_t atomic_add32(uint32_t *p, uint32_t v)
{
	return (uint32_t)__nvvm_atom_add_gen_i((int *)p, (int)v);
}
static __device__ __forceinline__ void atomic_add64(uint64_t *p, uint64_t v)
{
	__nvvm_atom_add_gen_ll((long long *)p, (long long)v);
}
static __device__ __forceinline__ void atomic_max32(uint32_t *p, uint32_t v)
{
	__nvvm_atom_max_gen_ui(p, v);
}

// Back-off while polling: short at first, for latency; longer when idle,
// so a waiting kernel does not flood the bus with reads.
static __device__ __forceinline__ void backoff(uint32_t *ns, uint32_t cap)
{
	pause(*ns);
	if (*ns < cap)
		*ns *= 2;
}

static __device__ __forceinline__ uint32_t popc32(uint32_t v) { return (uint32_t)__builtin_popcount(v); }
static __device__ __forceinline__ void block_sync() { __syncthreads(); }
static __device__ __forceinline__ void warp_sync() { __nvvm_bar_warp_sync(0xffffffffu); }
static __device__ __forceinline__ uint32_t shfl_up32(uint32_t v, uint32_t d)
{
	return (uint32_t)__nvvm_shfl_sync_up_i32(0xffffffffu, (int)v, (int)d, 0);
}
static __device__ __forceinline__ uint32_t match_any32(uint32_t key)
{
	return __nvvm_match_any_sync_i32(0xffffffffu, (int)key);
}

#define FB_DEV static __device__ __forceinline__
#define FB_DEV_MEMBER __device__
#include "fb_block.h"

static __device__ __forceinline__ void prof_start(struct block_shared *sh, uint64_t now)
{
	sh->prof_mark = now;
	for (uint32_t k = 0; k < FB_TRIGGER_PHASES; k++)
		sh->prof[k] = 0;
}
// phase_done (thread 0) ends a phase of the profile (fb_trigger_phases).
static __device__ __forceinline__ void phase_done(struct block_shared *sh, uint32_t phase)
{
	uint64_t t = clock64();
	sh->prof[phase] += t - sh->prof_mark;
	sh->prof_mark = t;
}

static __device__ __forceinline__ void fail(const struct fb_trigger_args *a, uint32_t code, uint64_t seq, uint32_t record)
{
	struct fb_trigger_ctrl *c = (struct fb_trigger_ctrl *)a->ctrl;
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	if (atomic_add32(&st->failed, 1) == 0) {
		c->error_seq = seq;
		c->error_record = record;
		st_release_sys32(&c->error, code);
	}
}

// stopped says whether block work on seq must end: the host asked for it,
// or another block failed.
static __device__ __forceinline__ int stopped(const struct fb_trigger_args *a, uint64_t seq)
{
	const struct fb_trigger_ctrl *c = (const struct fb_trigger_ctrl *)a->ctrl;
	const struct fb_trigger_state *st = (const struct fb_trigger_state *)a->state;
	return seq >= ld_acquire_sys64(&c->stop_seq) || ld_volatile32(&st->failed) != 0;
}

// wait_ready (thread 0, persistent mode) polls descriptor seq mod N until it
// holds buffer seq, then fills the job from it, checked as ingest.Consumer
// checks it. While the previous occupant (seq - N) is still held by another
// block, the state reads ready with the older sequence number: not ours yet.
static __device__ __forceinline__ int wait_ready(const struct fb_trigger_args *a, uint64_t seq, struct block_shared *sh)
{
	const uint8_t *region = (const uint8_t *)a->region;
	const struct fb_ingest_desc *d =
		(const struct fb_ingest_desc *)(region + a->desc_off) + (uint32_t)(seq % a->buffer_count);
	const struct fb_ingest_header *h = (const struct fb_ingest_header *)region;
	uint64_t w[8];
	uint32_t sources, ns = 32;
	for (uint32_t n = 0;; n++) {
		if (ld_acquire_sys32(&d->state) == FB_INGEST_READY) {
			// The whole descriptor and the source count at once: each
			// read over the bus costs its latency, which they share.
			// The acquire orders them after the producer's writes.
			ld_volatile_desc(d, w);
			sources = ld_volatile32(&h->source_count);
			uint64_t got = w[1];
			if (got == seq)
				break;
			if (got > seq) {
				fail(a, FB_TRIGGER_ESEQ, seq, 0);
				return 0;
			}
		}
		if ((n & 15) == 15 && stopped(a, seq))
			return 0;
		backoff(&ns, 512);
	}
	phase_done(sh, FB_TRIGGER_PH_READY);
	struct fb_trigger_job *j = &sh->job;
	j->seq = seq;
	j->records = (uint32_t)(w[0] >> 32);
	j->bytes = (uint32_t)w[2];
	j->flags = (uint32_t)(w[2] >> 32);
	j->publish_ns = w[6];
	uint64_t first = w[3], last = w[4];
	j->sources = sources < a->max_sources ? sources : a->max_sources;
	j->data = (uint64_t)(region + a->buffers_off + (uint64_t)(seq % a->buffer_count) * a->buffer_size);
	if (j->bytes > a->buffer_size || j->records < 1 || j->records > j->bytes / FB_INGEST_RECORD_HEADER ||
	    last < first) {
		fail(a, FB_TRIGGER_EDESC, seq, 0);
		return 0;
	}
	return 1;
}

// copy_batched copies wide 16-byte words with all threads, each thread's
// reads of a batch of B in flight before it stores any.
template <uint32_t B> static __device__ __forceinline__ void copy_batched(u32x4 *dst, const uint8_t *src, uint32_t wide)
{
	for (uint32_t i = tid(); i < wide; i += B * FB_TRIGGER_THREADS) {
		u32x4 v[B];
#pragma unroll
		for (uint32_t k = 0; k < B; k++)
			if (i + k * FB_TRIGGER_THREADS < wide)
				v[k] = ld_cg128(src + 16 * (i + k * FB_TRIGGER_THREADS));
#pragma unroll
		for (uint32_t k = 0; k < B; k++)
			if (i + k * FB_TRIGGER_THREADS < wide)
				dst[i + k * FB_TRIGGER_THREADS] = v[k];
	}
}

// stage copies the buffer into shared memory with all threads, 16 bytes at
// a time. burst: sixteen reads per thread in flight, 64 KiB for the cost of
// one read's latency over the bus, which a lone block wants; many blocks
// at once that deep swamp the bus (on an H200, 64 blocks drained the ring
// at half the rate of one read each in flight), so they read one at a time.
static __device__ __forceinline__ void stage(const struct fb_trigger_args *a, struct block_shared *sh, uint8_t *smem,
					     int burst)
{
	uint32_t bytes = sh->job.bytes;
	const uint8_t *src = (const uint8_t *)sh->job.data;
	if (bytes > a->stage_bytes) {
		if (tid() == 0)
			sh->data = src;
		return;
	}
	uint32_t wide = bytes / 16;
	if (burst)
		copy_batched<16>((u32x4 *)smem, src, wide);
	else
		copy_batched<1>((u32x4 *)smem, src, wide);
	if (tid() == 0) {
		if (bytes % 16)
			*(uint64_t *)(smem + wide * 16) = ld_cg64(src + wide * 16);
		sh->data = smem;
	}
}

// emit appends a gap to the list the host sorts.
static __device__ __forceinline__ void emit(const struct fb_trigger_args *a, uint64_t seq, uint32_t key, uint32_t source,
					    uint32_t sender, uint32_t want, uint32_t got)
{
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	uint32_t k = atomic_add32(&st->gap_count, 1);
	if (k >= a->gap_capacity) {
		fail(a, FB_TRIGGER_EGAPS, seq, key / 2);
		return;
	}
	struct fb_trigger_gap *g = (struct fb_trigger_gap *)a->gaps + k;
	g->seq = seq;
	g->key = key;
	g->source = source;
	g->sender = sender;
	g->want = want;
	g->got = got;
}

// note_gap counts a gap found in turn and lists it unless it cannot be
// among the reference's first FB_TRIGGER_MAX_GAPS: when as many came
// before it, in earlier buffers, in this buffer from its source (rank) or
// from its source ever (v.gaps). The host sorts the list and keeps the
// first; what is listed needs only to include them.
static __device__ __forceinline__ void note_gap(const struct fb_trigger_args *a, struct block_shared *sh,
						struct fb_trigger_source &v, uint32_t source, uint32_t index, uint32_t sender,
						uint32_t want, uint32_t got, uint32_t *rank)
{
	atomic_add32(&sh->gaps, 1);
	if (sh->gaps_before + *rank < FB_TRIGGER_MAX_GAPS && v.gaps < FB_TRIGGER_MAX_GAPS) {
		v.gaps++;
		emit(a, sh->job.seq, index * 2 + sender, source, sender, want, got);
	}
	(*rank)++;
}

// reassigned says whether a record of generation gen starts the entry
// afresh: it has counted records of another generation. Both sequences
// then start again (the counts add up); no gap is counted across.
static __device__ __forceinline__ int reassigned(const struct fb_trigger_source &v, uint32_t gen)
{
	return v.records != 0 && gen != v.gen;
}

// step is the reference's Process loop body: record i of the chunk, the
// index-th of the buffer, applied to its source's counts v.
static __device__ __forceinline__ void step(const struct fb_trigger_args *a, struct block_shared *sh,
					    struct fb_trigger_source &v, uint32_t s, uint32_t i, uint32_t index,
					    uint32_t *rank)
{
	uint32_t ring = sh->ring[i], plen = sh->plen[i];
	uint64_t rx = *(const uint64_t *)(sh->data + sh->off[i] + 8);
	int fresh = v.records == 0;
	if (reassigned(v, sh->gen[i])) {
		v.reassigned++;
		v.have_seq = 0;
		fresh = 1;
	}
	v.gen = sh->gen[i];
	v.records++;
	v.bytes += plen;
	if (fresh) {
		v.first_rx_ns = rx;
	} else if (ring != v.next_ring) {
		note_gap(a, sh, v, s, index, 0, v.next_ring, ring, rank);
		v.dropped_here += (uint32_t)(ring - v.next_ring);
	}
	v.next_ring = ring + 1;
	v.last_rx_ns = rx;
	if (plen < 4) {
		v.short_payloads++;
		return;
	}
	uint32_t seq = sh->sender[i];
	int32_t d = (int32_t)(seq - v.next_seq);
	if (!v.have_seq) {
		v.first_seq = seq;
		v.have_seq = 1;
		v.next_seq = seq + 1;
	} else if (d == 0) {
		v.next_seq++;
	} else if (d > 0) {
		note_gap(a, sh, v, s, index, 1, v.next_seq, seq, rank);
		v.sender_gaps += (uint64_t)d;
		v.next_seq = seq + 1;
	} else {
		v.sender_backwards++;
	}
	v.last_seq = seq;
}

// fold (all threads, in turn) replays the chunk's records per source, the
// slow path: thread t owns sources t, t+THREADS, ... and scans them all.
static __device__ __forceinline__ void fold(const struct fb_trigger_args *a, struct block_shared *sh, uint32_t first)
{
	struct fb_trigger_source *table = (struct fb_trigger_source *)a->sources;
	uint32_t nsrc = sh->max_source + 1;
	if (sh->n == 0)
		return;
	for (uint32_t s = tid(); s < nsrc; s += FB_TRIGGER_THREADS) {
		struct fb_trigger_source v = table[s];
		uint32_t rank = 0, touched = 0;
		for (uint32_t i = 0; i < sh->n; i++) {
			if (sh->src[i] != s)
				continue;
			touched = 1;
			step(a, sh, v, s, i, first + i, &rank);
		}
		if (touched)
			table[s] = v;
	}
}

// take_turn (all threads) waits until every earlier buffer is folded, and
// takes the running totals as they are then, all in one batch of reads:
// the time from one turn to the next is the fold's limit, and each read
// in it that waits for another costs a round trip to L2. A block with
// others ahead of it polls about once per turn that must pass first (a
// turn takes a µs or more), not as fast as it can: with a block per SM
// waiting, that hammered the turn's line while the block in turn worked.
static __device__ __forceinline__ int take_turn(const struct fb_trigger_args *a, struct block_shared *sh)
{
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	if (tid() == 0) {
		uint64_t seq = sh->job.seq;
		sh->go = 1;
		phase_done(sh, FB_TRIGGER_PH_SUMMARY);
		for (uint32_t n = 0;; n++) {
			uint64_t ahead = seq - ld_acquire_gpu64(&st->turn);
			if (ahead == 0)
				break;
			if ((n & 255) == 255 && stopped(a, seq)) {
				sh->go = 0;
				break;
			}
			pause(ahead == 1 ? 32 : (uint32_t)(ahead < 16 ? ahead - 1 : 15) * 256);
		}
		phase_done(sh, FB_TRIGGER_PH_WAIT);
		sh->gaps_before = st->gaps_before;
		sh->source_slots = st->source_slots;
		sh->window_energy = st->window_energy;
		sh->windows = st->windows;
		sh->triggers = st->triggers;
		sh->buffers = st->buffers;
		sh->records = st->records;
	}
	__syncthreads();
	return sh->go;
}

// fast is the fold of a buffer that is staged, one chunk, and from at most
// FB_TRIGGER_THREADS sources. Before the turn, summarise (fb_block.h)
// checks every record but each source's first against the one before it
// of its source, in parallel with other blocks. The sender sequence's
// state after the first non-short record is that record's (accepted: the
// first ever, or not behind) unless it is behind, which only the turn can
// tell; then the source replays its records in turn, as does one that
// summarise marked. In turn, thread s applies source s's summary: a few
// words per source, not a pass over records.
static __device__ __forceinline__ int fast(const struct fb_trigger_args *a, struct block_shared *sh)
{
	summarise(sh);
	uint32_t s = tid();
	uint32_t count = sh->seg_count[s], start = sh->seg_start[s];
	int present = s < sh->job.sources && count != 0;
	if (!take_turn(a, sh))
		return 0;
	if (present) {
		struct fb_trigger_source *e = (struct fb_trigger_source *)a->sources + s;
		struct fb_trigger_source v = *e;
		const struct source_summary *m = &sh->u.sum.sum[s];
		uint32_t rank = 0, first_i = sh->sorted[start], last_i = sh->sorted[start + count - 1];
		uint32_t gen = sh->gen[first_i];
		int fresh = reassigned(v, gen);
		if (sh->overflow || sh->replay[s] || (m->have_t && v.have_seq && !fresh && (int32_t)(m->t1 - v.next_seq) < 0)) {
			sh->replay[s] = 1;
			for (uint32_t p = start; p < start + count; p++)
				step(a, sh, v, s, sh->sorted[p], sh->sorted[p], &rank);
		} else {
			uint32_t ring1 = sh->ring[first_i];
			if (fresh) {
				v.reassigned++;
				v.have_seq = 0;
			}
			if (v.records == 0 || fresh) {
				v.first_rx_ns = *(const uint64_t *)(sh->data + sh->off[first_i] + 8);
			} else if (ring1 != v.next_ring) {
				note_gap(a, sh, v, s, first_i, 0, v.next_ring, ring1, &rank);
				v.dropped_here += (uint32_t)(ring1 - v.next_ring);
			}
			v.gen = gen;
			v.records += count;
			v.bytes += m->bytes;
			v.dropped_here += m->dropped;
			v.next_ring = sh->ring[last_i] + 1;
			v.last_rx_ns = *(const uint64_t *)(sh->data + sh->off[last_i] + 8);
			v.short_payloads += m->shorts;
			if (m->have_t) {
				if (!v.have_seq) {
					v.first_seq = m->t1;
					v.have_seq = 1;
				} else {
					int32_t d = (int32_t)(m->t1 - v.next_seq);
					if (d > 0) {
						rank = 0;
						note_gap(a, sh, v, s, m->t1_i, 1, v.next_seq, m->t1, &rank);
						v.sender_gaps += (uint64_t)d;
					}
				}
				v.sender_gaps += m->sgaps;
				v.sender_backwards += m->back;
				v.next_seq = m->nexts;
				v.last_seq = m->last_t;
			}
			if (m->gaps)
				atomic_add32(&sh->gaps, m->gaps);
		}
		*e = v;
	}
	__syncthreads();
	// The gaps found before the turn, where they may still count. A
	// source that replayed listed its own.
	if (sh->gaps_before < FB_TRIGGER_MAX_GAPS && !sh->overflow) {
		uint32_t n = sh->nlocal < LOCAL_GAPS ? sh->nlocal : LOCAL_GAPS;
		for (uint32_t i = tid(); i < n; i += FB_TRIGGER_THREADS) {
			struct local_gap g = sh->local[i];
			if (!sh->replay[g.source] && sh->gaps_before + g.rank < FB_TRIGGER_MAX_GAPS)
				emit(a, sh->job.seq, g.key, g.source, g.sender, g.want, g.got);
		}
	}
	__syncthreads();
	return 1;
}

// finish (thread 0, in turn) closes the window and passes the turn on, then
// publishes the result; a bad buffer keeps the turn, so that the blocks
// waiting for it see the failure and fold nothing after it.
static __device__ __forceinline__ void finish(const struct fb_trigger_args *a, struct block_shared *sh, uint32_t records)
{
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	struct fb_trigger_ctrl *c = (struct fb_trigger_ctrl *)a->ctrl;
	uint64_t seq = sh->job.seq;
	uint64_t window = sh->window_energy + sh->energy;
	uint32_t flags = 0;
	st->buffers = sh->buffers + 1;
	st->records = sh->records + records;
	uint32_t slots = sh->max_source + 1;
	if (records && slots > sh->source_slots)
		st->source_slots = slots;
	uint32_t gb = sh->gaps_before + sh->gaps;
	st->gaps_before = gb < FB_TRIGGER_MAX_GAPS ? gb : FB_TRIGGER_MAX_GAPS;
	if (sh->bad) {
		// As the reference: the records before the bad one count, the
		// window stays open.
		st->window_energy = window;
		fail(a, sh->bad, seq, sh->bad_record);
		return;
	}
	if (!(sh->job.flags & FB_INGEST_BUF_CONTINUED)) {
		st->windows = sh->windows + 1;
		flags |= FB_TRIGGER_CLOSED;
		if (window >= a->threshold) {
			st->triggers = sh->triggers + 1;
			flags |= FB_TRIGGER_TRIGGERED;
		}
		st->window_energy = 0;
	} else {
		st->window_energy = window;
	}
	st_release_gpu64(&st->turn, seq + 1);
	phase_done(sh, FB_TRIGGER_PH_TURN);
	uint32_t ns = 32;
	while (seq - sh->results_read >= a->result_slots) {
		sh->results_read = ld_acquire_sys64(&c->results_read);
		if (seq - sh->results_read < a->result_slots)
			break;
		if (stopped(a, seq))
			return;
		backoff(&ns, 1024);
	}
	volatile struct fb_trigger_result *r = (volatile struct fb_trigger_result *)a->results + seq % a->result_slots;
	r->publish_ns = sh->job.publish_ns;
	r->buffer_energy = sh->energy;
	r->window_energy = window;
	r->records = records;
	r->flags = flags;
	r->gpu_ns = globaltimer();
	st_release_sys64((void *)&r->seq1, seq + 1);
}

// Persistent kernels of up to this many blocks stage in bursts (see stage).
#define BURST_BLOCKS 16

// process runs one buffer through both stages; 0 when the block must stop.
// release, in persistent mode, is the descriptor to hand back; burst is
// stage's.
static __device__ __forceinline__ int process(const struct fb_trigger_args *a, struct block_shared *sh, uint8_t *smem,
					      struct fb_ingest_desc *release, int burst)
{
	if (tid() == 0) {
		sh->energy = 0;
		sh->gaps = 0;
		sh->max_source = 0;
		sh->nlocal = 0;
		sh->overflow = 0;
	}
	sh->replay[tid()] = 0;
	stage(a, sh, smem, burst);
	__syncthreads();
	// A staged buffer is ours in shared memory: the producer may have it
	// back at once. The barrier ordered every thread's reads before this.
	int staged = sh->data == smem;
	int fast_path = staged && sh->job.records <= FB_TRIGGER_CHUNK && sh->job.sources <= FB_TRIGGER_THREADS;
	if (tid() == 0) {
		if (release && staged)
			st_release_sys32(&release->state, FB_INGEST_FREE);
		sh->fast = fast_path;
		phase_done(sh, FB_TRIGGER_PH_STAGE);
	}
	if (!(fast_path && sh->job.bytes <= 8 * PAR_SLOTS && parse(sh))) {
		if (tid() == 0)
			walk(sh, 0, 0);
		__syncthreads();
	}
	decode(sh);
	__syncthreads();
	if (tid() == 0)
		phase_done(sh, FB_TRIGGER_PH_PARSE);
	uint32_t first = 0;
	if (sh->fast) {
		if (!fast(a, sh))
			return 0;
		first = sh->n;
	} else {
		if (!take_turn(a, sh))
			return 0;
		for (;;) {
			fold(a, sh, first);
			__syncthreads();
			first += sh->n;
			if (sh->bad || first >= sh->job.records)
				break;
			if (tid() == 0)
				walk(sh, first, sh->next_off);
			__syncthreads();
			decode(sh);
			__syncthreads();
		}
	}
	if (tid() == 0) {
		finish(a, sh, first);
		if (release && !staged && !sh->bad)
			st_release_sys32(&release->state, FB_INGEST_FREE);
	}
	__syncthreads();
	return 1;
}

// fb_trigger_persistent runs until the host's stop_seq: block b takes
// buffers first_seq + b, + b + gridDim, ... as the producer publishes them.
// Every block must be resident at once (the turn passes through all).
extern "C" __global__ void __launch_bounds__(FB_TRIGGER_THREADS) fb_trigger_persistent(const struct fb_trigger_args *a)
{
	extern __shared__ u32x4 stage_mem[];
	__shared__ struct block_shared sh;
	uint8_t *region = (uint8_t *)a->region;
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	uint64_t run_ns = globaltimer(), run_cycles = clock64();
	if (tid() == 0) {
		sh.results_read = 0;
		prof_start(&sh, run_cycles);
	}
	for (uint64_t seq = a->first_seq + bid();; seq += nblocks()) {
		if (tid() == 0) {
			phase_done(&sh, FB_TRIGGER_PH_PUBLISH);
			sh.go = wait_ready(a, seq, &sh);
		}
		__syncthreads();
		if (!sh.go)
			break;
		struct fb_ingest_desc *d = (struct fb_ingest_desc *)(region + a->desc_off) + (uint32_t)(seq % a->buffer_count);
		if (!process(a, &sh, (uint8_t *)stage_mem, d, nblocks() <= BURST_BLOCKS))
			break;
		if (ld_volatile32(&st->failed))
			break;
	}
	if (tid() == 0) {
		for (uint32_t k = 0; k < FB_TRIGGER_PHASES; k++)
			atomic_add64(&st->prof_cycles[k], sh.prof[k]);
		atomic_add64(&st->prof_run_cycles, clock64() - run_cycles);
		atomic_add64(&st->prof_run_ns, globaltimer() - run_ns);
	}
}

// fb_trigger_batch is the host-driven mode: block b takes job b, a buffer
// the host copied to device memory; the turn keeps the fold in order.
extern "C" __global__ void __launch_bounds__(FB_TRIGGER_THREADS) fb_trigger_batch(const struct fb_trigger_args *a)
{
	extern __shared__ u32x4 stage_mem[];
	__shared__ struct block_shared sh;
	if (tid() == 0) {
		sh.results_read = 0;
		prof_start(&sh, clock64()); // kept by persistent blocks only
		const volatile struct fb_trigger_job *j = (const volatile struct fb_trigger_job *)a->jobs + bid();
		sh.job.data = j->data;
		sh.job.seq = j->seq;
		sh.job.publish_ns = j->publish_ns;
		sh.job.records = j->records;
		sh.job.bytes = j->bytes;
		sh.job.flags = j->flags;
		sh.job.sources = j->sources;
		sh.go = sh.job.bytes <= a->buffer_size && sh.job.records >= 1 &&
			sh.job.records <= sh.job.bytes / FB_INGEST_RECORD_HEADER;
		if (!sh.go)
			fail(a, FB_TRIGGER_EDESC, sh.job.seq, 0);
	}
	__syncthreads();
	if (sh.go)
		process(a, &sh, (uint8_t *)stage_mem, 0, 1); // device memory: bursts are cheap
}

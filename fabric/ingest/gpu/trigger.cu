// SPDX-License-Identifier: MIT
//
// trigger.cu: the GPU trigger over an ingest ring, the CUDA twin of
// ingest.Reference. Built to PTX by Debian's clang without CUDA's headers
// (see gen.go); the driver compiles the PTX for the GPU at load.
//
// Each buffer goes through a block of FB_TRIGGER_THREADS threads in two
// stages. Stage A runs in parallel across blocks: stage the buffer in
// shared memory, walk its records (one thread: a record's size says where
// the next starts) and decode them (all threads: source, sequences,
// energies). Stage B is the reference's sequential fold, taken in
// publication order through a turn ticket in device memory: one thread per
// source replays that source's records, so per-source counts and gaps come
// out exactly as the CPU's; thread 0 closes windows and publishes the
// result. Many blocks keep many buffers in stage A while one folds.

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
static __device__ __forceinline__ void backoff(uint32_t *ns)
{
	pause(*ns);
	if (*ns < 2048)
		*ns *= 2;
}

static __device__ __forceinline__ uint32_t be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

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
	uint32_t max_source;
	uint64_t energy;
	uint32_t off[FB_TRIGGER_CHUNK];
	uint32_t ring[FB_TRIGGER_CHUNK];
	uint32_t sender[FB_TRIGGER_CHUNK];
	uint32_t energy_of[FB_TRIGGER_CHUNK];
	uint16_t src[FB_TRIGGER_CHUNK];
	uint16_t plen[FB_TRIGGER_CHUNK];
};

static __device__ void fail(const struct fb_trigger_args *a, uint32_t code, uint64_t seq, uint32_t record)
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
static __device__ int wait_ready(const struct fb_trigger_args *a, uint64_t seq, struct block_shared *sh)
{
	const uint8_t *region = (const uint8_t *)a->region;
	const struct fb_ingest_desc *d =
		(const struct fb_ingest_desc *)(region + a->desc_off) + (uint32_t)(seq % a->buffer_count);
	uint32_t ns = 32;
	for (;;) {
		if (ld_acquire_sys32(&d->state) == FB_INGEST_READY) {
			uint64_t got = *(const volatile uint64_t *)&d->seq;
			if (got == seq)
				break;
			if (got > seq) {
				fail(a, FB_TRIGGER_ESEQ, seq, 0);
				return 0;
			}
		}
		if (stopped(a, seq))
			return 0;
		backoff(&ns);
	}
	const volatile struct fb_ingest_desc *v = d;
	struct fb_trigger_job *j = &sh->job;
	j->seq = seq;
	j->records = v->records;
	j->bytes = v->bytes;
	j->flags = v->flags;
	j->publish_ns = v->publish_ns;
	uint64_t first = v->first_ns, last = v->last_ns;
	const struct fb_ingest_header *h = (const struct fb_ingest_header *)region;
	uint32_t sources = ld_acquire_sys32(&h->source_count);
	j->sources = sources < a->max_sources ? sources : a->max_sources;
	j->data = (uint64_t)(region + a->buffers_off + (uint64_t)(seq % a->buffer_count) * a->buffer_size);
	if (j->bytes > a->buffer_size || j->records < 1 || j->records > j->bytes / FB_INGEST_RECORD_HEADER ||
	    last < first) {
		fail(a, FB_TRIGGER_EDESC, seq, 0);
		return 0;
	}
	return 1;
}

// stage copies the buffer into shared memory with all threads, 16 bytes at
// a time: over the bus, wide reads in flight together are what is fast.
static __device__ void stage(const struct fb_trigger_args *a, struct block_shared *sh, uint8_t *smem)
{
	uint32_t bytes = sh->job.bytes;
	const uint8_t *src = (const uint8_t *)sh->job.data;
	if (bytes > a->stage_bytes) {
		if (tid() == 0)
			sh->data = src;
		return;
	}
	uint32_t wide = bytes / 16;
	const u32x4 *s16 = (const u32x4 *)src;
	u32x4 *d16 = (u32x4 *)smem;
	for (uint32_t i = tid(); i < wide; i += FB_TRIGGER_THREADS)
		d16[i] = s16[i];
	if (tid() == 0) {
		if (bytes % 16)
			*(uint64_t *)(smem + wide * 16) = *(const uint64_t *)(src + wide * 16);
		sh->data = smem;
	}
}

// walk (thread 0) finds up to a chunk of records from off, checking each
// as ingest.RecordIter does.
static __device__ void walk(struct block_shared *sh, uint32_t first, uint32_t off)
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

// decode (all threads) reads each record of the chunk: its source and
// sequences, and its hit energies summed.
static __device__ void decode(struct block_shared *sh)
{
	uint64_t energy = 0;
	uint32_t maxsrc = 0;
	for (uint32_t i = tid(); i < sh->n; i += FB_TRIGGER_THREADS) {
		const uint8_t *r = sh->data + sh->off[i];
		const struct fb_ingest_record *h = (const struct fb_ingest_record *)r;
		uint32_t plen = h->payload_len, e = 0, seq = 0;
		const uint8_t *p = r + FB_INGEST_RECORD_HEADER;
		if (plen >= 4) {
			seq = be32(p);
			for (uint32_t k = 4; k + 2 <= plen; k += 2)
				e += (uint32_t)p[k] << 8 | p[k + 1];
		}
		sh->src[i] = h->source;
		sh->plen[i] = plen;
		sh->ring[i] = h->seq;
		sh->sender[i] = seq;
		sh->energy_of[i] = e;
		energy += e;
		maxsrc = h->source > maxsrc ? h->source : maxsrc;
	}
	if (energy)
		atomic_add64(&sh->energy, energy);
	if (sh->n)
		atomic_max32(&sh->max_source, maxsrc);
}

static __device__ void gap(const struct fb_trigger_args *a, struct block_shared *sh, struct fb_trigger_source *s,
			   uint32_t source, uint32_t index, int sender, uint32_t want, uint32_t got)
{
	atomic_add32(&sh->gaps, 1);
	// A gap is among the reference's first FB_TRIGGER_MAX_GAPS only if
	// fewer came before it: not if the earlier buffers or this source
	// already had that many.
	if (sh->gaps_before >= FB_TRIGGER_MAX_GAPS || s->gaps >= FB_TRIGGER_MAX_GAPS)
		return;
	s->gaps++;
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	uint32_t k = atomic_add32(&st->gap_count, 1);
	if (k >= a->gap_capacity) {
		fail(a, FB_TRIGGER_EGAPS, sh->job.seq, index);
		return;
	}
	struct fb_trigger_gap *g = (struct fb_trigger_gap *)a->gaps + k;
	g->seq = sh->job.seq;
	g->key = index * 2 + sender;
	g->source = source;
	g->sender = sender;
	g->want = want;
	g->got = got;
}

// fold (all threads, in turn) replays the chunk's records per source, the
// reference's Process loop: thread t owns sources t, t+THREADS, ...
static __device__ void fold(const struct fb_trigger_args *a, struct block_shared *sh, uint32_t first)
{
	struct fb_trigger_source *table = (struct fb_trigger_source *)a->sources;
	uint32_t nsrc = sh->max_source + 1;
	if (sh->n == 0)
		return;
	for (uint32_t s = tid(); s < nsrc; s += FB_TRIGGER_THREADS) {
		struct fb_trigger_source v = table[s];
		int touched = 0;
		for (uint32_t i = 0; i < sh->n; i++) {
			if (sh->src[i] != s)
				continue;
			touched = 1;
			const struct fb_ingest_record *h = (const struct fb_ingest_record *)(sh->data + sh->off[i]);
			uint32_t ring = sh->ring[i], plen = sh->plen[i];
			uint64_t rx = h->rx_ns;
			v.records++;
			v.bytes += plen;
			if (v.records == 1) {
				v.first_rx_ns = rx;
			} else if (ring != v.next_ring) {
				gap(a, sh, &v, s, first + i, 0, v.next_ring, ring);
				v.dropped_here += (uint32_t)(ring - v.next_ring);
			}
			v.next_ring = ring + 1;
			v.last_rx_ns = rx;
			if (plen < 4) {
				v.short_payloads++;
				continue;
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
				gap(a, sh, &v, s, first + i, 1, v.next_seq, seq);
				v.sender_gaps += (uint64_t)d;
				v.next_seq = seq + 1;
			} else {
				v.sender_backwards++;
			}
			v.last_seq = seq;
		}
		if (touched)
			table[s] = v;
	}
}

// finish (thread 0, in turn) closes the window, publishes the result and
// reports an error; the caller then passes the turn on.
static __device__ void finish(const struct fb_trigger_args *a, struct block_shared *sh, uint32_t records)
{
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	struct fb_trigger_ctrl *c = (struct fb_trigger_ctrl *)a->ctrl;
	uint64_t seq = sh->job.seq;
	uint64_t window = st->window_energy + sh->energy;
	uint32_t flags = 0;
	st->buffers++;
	st->records += records;
	uint32_t slots = sh->max_source + 1;
	if (records && slots > st->source_slots)
		st->source_slots = slots;
	uint32_t gb = st->gaps_before + sh->gaps;
	st->gaps_before = gb < FB_TRIGGER_MAX_GAPS ? gb : FB_TRIGGER_MAX_GAPS;
	if (sh->bad) {
		// As the reference: the records before the bad one count, the
		// window stays open.
		st->window_energy = window;
		fail(a, sh->bad, seq, sh->bad_record);
		return;
	}
	if (!(sh->job.flags & FB_INGEST_BUF_CONTINUED)) {
		st->windows++;
		flags |= FB_TRIGGER_CLOSED;
		if (window >= a->threshold) {
			st->triggers++;
			flags |= FB_TRIGGER_TRIGGERED;
		}
		st->window_energy = 0;
	} else {
		st->window_energy = window;
	}
	uint32_t ns = 32;
	while (seq - ld_acquire_sys64(&c->results_read) >= a->result_slots) {
		if (stopped(a, seq))
			return;
		backoff(&ns);
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

// process runs one buffer through both stages. release, in persistent
// mode, is the descriptor to hand back to the producer.
static __device__ void process(const struct fb_trigger_args *a, struct block_shared *sh, uint8_t *smem,
			       struct fb_ingest_desc *release)
{
	struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
	uint64_t seq = sh->job.seq;
	if (tid() == 0) {
		sh->energy = 0;
		sh->gaps = 0;
		sh->max_source = 0;
	}
	stage(a, sh, smem);
	__syncthreads();
	// A staged buffer is ours in shared memory: the producer may have it
	// back at once. The barrier ordered every thread's reads before this.
	int staged = sh->data == smem;
	if (release && staged && tid() == 0)
		st_release_sys32(&release->state, FB_INGEST_FREE);
	uint32_t first = 0, off = 0, have_turn = 0;
	for (;;) {
		if (tid() == 0)
			walk(sh, first, off);
		__syncthreads();
		decode(sh);
		__syncthreads();
		if (!have_turn) {
			if (tid() == 0) {
				uint32_t ns = 32;
				sh->go = 1;
				while (ld_acquire_gpu64(&st->turn) != seq) {
					if (stopped(a, seq)) {
						sh->go = 0;
						break;
					}
					backoff(&ns);
				}
				sh->gaps_before = st->gaps_before;
			}
			__syncthreads();
			if (!sh->go)
				return;
			have_turn = 1;
		}
		fold(a, sh, first);
		__syncthreads();
		first += sh->n;
		off = sh->next_off;
		if (sh->bad || first >= sh->job.records)
			break;
		__syncthreads(); // the next walk overwrites what fold read
	}
	if (tid() == 0) {
		finish(a, sh, first);
		// A bad buffer keeps the turn: the blocks waiting for it see
		// the failure and leave without folding anything after it.
		if (!sh->bad) {
			if (release && !staged)
				st_release_sys32(&release->state, FB_INGEST_FREE);
			st_release_gpu64(&st->turn, seq + 1);
		}
	}
	__syncthreads();
}

// fb_trigger_persistent runs until the host's stop_seq: block b takes
// buffers first_seq + b, + b + gridDim, ... as the producer publishes them.
// Every block must be resident at once (the turn passes through all).
extern "C" __global__ void __launch_bounds__(FB_TRIGGER_THREADS) fb_trigger_persistent(const struct fb_trigger_args *a)
{
	extern __shared__ u32x4 stage_mem[];
	__shared__ struct block_shared sh;
	uint8_t *region = (uint8_t *)a->region;
	for (uint64_t seq = a->first_seq + bid();; seq += nblocks()) {
		if (tid() == 0)
			sh.go = wait_ready(a, seq, &sh);
		__syncthreads();
		if (!sh.go)
			return;
		struct fb_ingest_desc *d = (struct fb_ingest_desc *)(region + a->desc_off) + (uint32_t)(seq % a->buffer_count);
		process(a, &sh, (uint8_t *)stage_mem, d);
		struct fb_trigger_state *st = (struct fb_trigger_state *)a->state;
		if (ld_volatile32(&st->failed))
			return;
	}
}

// fb_trigger_batch is the host-driven mode: block b takes job b, a buffer
// the host copied to device memory; the turn keeps the fold in order.
extern "C" __global__ void __launch_bounds__(FB_TRIGGER_THREADS) fb_trigger_batch(const struct fb_trigger_args *a)
{
	extern __shared__ u32x4 stage_mem[];
	__shared__ struct block_shared sh;
	if (tid() == 0) {
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
		process(a, &sh, (uint8_t *)stage_mem, 0);
}

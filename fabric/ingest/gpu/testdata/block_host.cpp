// block_host.cpp runs fb_block.h on the host, a POSIX thread per CUDA
// thread, and checks what one block finds before its turn against plain
// sequential code: the records (parse against walk), their fields and
// energies (decode), and each source's summary and gaps (summarise).
// Barriers stand in for __syncthreads and __syncwarp, an exchange array for
// the warp's shuffles and match.any. TestBlockOnHost builds and runs it.
//
//   block_host [buffers [seed]]   prints "ok N" or the first difference
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static thread_local uint32_t my_tid;
static pthread_barrier_t all_bar, warp_bar[FB_TRIGGER_THREADS_HOST / 32];
static uint32_t xch[FB_TRIGGER_THREADS_HOST / 32][32];

static inline uint32_t tid() { return my_tid; }
static inline void block_sync() { pthread_barrier_wait(&all_bar); }
static inline void warp_sync() { pthread_barrier_wait(&warp_bar[my_tid / 32]); }
static inline uint32_t shfl_up32(uint32_t v, uint32_t d)
{
	uint32_t w = my_tid / 32, l = my_tid % 32;
	xch[w][l] = v;
	warp_sync();
	uint32_t r = l >= d ? xch[w][l - d] : v;
	warp_sync();
	return r;
}
static inline uint32_t match_any32(uint32_t key)
{
	uint32_t w = my_tid / 32, m = 0;
	xch[w][my_tid % 32] = key;
	warp_sync();
	for (uint32_t l = 0; l < 32; l++)
		if (xch[w][l] == key)
			m |= 1u << l;
	warp_sync();
	return m;
}
// One exchange for a whole struct: the device's word by word is the same.
static uint8_t xch_of[FB_TRIGGER_THREADS_HOST / 32][32][64];
template <typename T> static inline T shfl_up_of(T v, uint32_t d)
{
	static_assert(sizeof(T) <= 64, "fits the exchange");
	uint32_t w = my_tid / 32, l = my_tid % 32;
	memcpy(xch_of[w][l], &v, sizeof v);
	warp_sync();
	T r = v;
	if (l >= d)
		memcpy(&r, xch_of[w][l - d], sizeof r);
	warp_sync();
	return r;
}
#define FB_HAVE_SHFL_UP_OF

static inline uint32_t popc32(uint32_t v) { return (uint32_t)__builtin_popcount(v); }
static inline uint32_t atomic_add32(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline void atomic_add64(uint64_t *p, uint64_t v) { __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline void atomic_max32(uint32_t *p, uint32_t v)
{
	uint32_t o = __atomic_load_n(p, __ATOMIC_SEQ_CST);
	while (o < v && !__atomic_compare_exchange_n(p, &o, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
	}
}

#define FB_DEV static inline
#define FB_DEV_MEMBER
#include "../fb_block.h"

static_assert(FB_TRIGGER_THREADS == FB_TRIGGER_THREADS_HOST, "built with the kernel's block size");

static struct block_shared sh;
static uint8_t data[1 << 17] __attribute__((aligned(16)));

// What the kernel does with a staged buffer of the fast path before its turn.
static void *block_thread(void *arg)
{
	my_tid = (uint32_t)(uintptr_t)arg;
	if (tid() == 0) {
		sh.energy = 0;
		sh.max_source = 0;
		sh.nlocal = 0;
		sh.overflow = 0;
	}
	sh.replay[tid()] = 0;
	block_sync();
	if (!(sh.job.bytes <= 8 * PAR_SLOTS && parse(&sh))) {
		if (tid() == 0)
			walk(&sh, 0, 0);
		block_sync();
	}
	decode(&sh);
	block_sync();
	summarise(&sh);
	return 0;
}

static uint64_t rnd_state;
static uint32_t rnd()
{
	rnd_state ^= rnd_state << 13;
	rnd_state ^= rnd_state >> 7;
	rnd_state ^= rnd_state << 17;
	return (uint32_t)(rnd_state >> 11);
}
static uint32_t chance(uint32_t in) { return in && rnd() % in == 0; }

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint32_t rd_be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]; }

// fill writes a buffer of records as a producer would, quirks included,
// and then maybe breaks it; it sets sh.job.
static void fill(int round)
{
	uint32_t sources = 1 + (rnd() % 4 == 0 ? rnd() % 256 : rnd() % 8);
	uint32_t want = round % 11 == 10 ? 600 : 1 + rnd() % (rnd() % 3 ? 1024 : 64);
	uint32_t uniform = rnd() % 2 || round % 11 == 10, fixed = round % 11 == 10 ? 72 : rnd() % 64, quirks = rnd() % 3 ? 50 : 0, big = rnd() % 8 == 0;
	uint32_t ring[256], seq[256], gen[256];
	for (uint32_t s = 0; s < 256; s++)
		ring[s] = rnd() % 3 ? rnd() % 100 : rnd(), seq[s] = rnd() % 2 ? rnd() : rnd() % 1000, gen[s] = rnd() % 3;
	uint32_t limit = big ? sizeof data : 8 * PAR_SLOTS, off = 0, n = 0;
	memset(data, 0, sizeof data);
	while (n < want) {
		uint32_t s = rnd() % sources, plen = uniform ? fixed : rnd() % 80;
		if (chance(quirks))
			plen = rnd() % 4; // too short for a sender sequence
		uint32_t size = (24 + plen + 7) & ~7u;
		if (off + size > limit)
			break;
		if (chance(quirks))
			ring[s] += 1 + rnd() % 5; // dropped here
		if (chance(quirks))
			seq[s] += rnd() % 2 ? 1 + rnd() % 5 : -(1 + rnd() % 3); // sender gap or repeat
		if (chance(quirks * 4))
			seq[s] += (uint32_t)1 << 31; // far off: replays
		if (chance(quirks)) {
			gen[s]++; // the entry went to another source
			ring[s] = 0;
			seq[s] = rnd() % 100;
		}
		uint8_t *r = data + off;
		memcpy(r, &size, 4);
		uint16_t pl = plen, src = s;
		memcpy(r + 4, &pl, 2);
		memcpy(r + 6, &src, 2);
		uint64_t rx = 1000000 + off;
		memcpy(r + 8, &rx, 8);
		memcpy(r + 16, &ring[s], 4);
		memcpy(r + 20, &gen[s], 4);
		for (uint32_t k = 0; k < plen; k++)
			r[24 + k] = rnd();
		if (plen >= 4) {
			r[24] = seq[s] >> 24, r[25] = seq[s] >> 16, r[26] = seq[s] >> 8, r[27] = seq[s];
		}
		if (round % 11 == 10) {
			// Payloads full of records: more candidates than parse follows.
			uint32_t fake[2] = {24, 0};
			for (uint32_t k = 8; k + 8 <= plen; k += 8)
				memcpy(r + 24 + k, fake, 8);
		} else if (round % 5 == 0 && plen >= 16) {
			// A payload that looks like a record header pointing on.
			uint32_t fake = 24 + 8 * (rnd() % 4);
			memcpy(r + 32, &fake, 4);
			r[36] = r[37] = r[38] = r[39] = 0;
		}
		ring[s]++;
		seq[s]++;
		off += size;
		n++;
	}
	sh.job.bytes = off;
	sh.job.records = n;
	sh.job.sources = sources;
	switch (round % 7) {
	case 1: // a record's size broken
		if (n > 1) {
			uint32_t k = rnd() % (off / 8);
			uint32_t v = rnd() % 3 ? 8 * (rnd() % 12) : rnd();
			memcpy(data + 8 * k, &v, 4);
		}
		break;
	case 2: // more or fewer records than the descriptor says
		sh.job.records = n + (rnd() % 2 ? 1 : -1) * (1 + rnd() % 3);
		if (sh.job.records < 1 || sh.job.records > 1024)
			sh.job.records = n;
		break;
	case 3: // fewer sources than named
		sh.job.sources = 1 + rnd() % sources;
		break;
	case 4: // bytes cut short or padded
		sh.job.bytes = off - (rnd() % 2 ? 8 * (rnd() % 4) : 0) + (rnd() % 2 ? 4 : 0);
		break;
	}
	if (sh.job.bytes > sizeof data - 64)
		sh.job.bytes = off;
	sh.data = data;
}

static int failures;
#define CHECK(cond, ...)                                                \
	do {                                                            \
		if (!(cond)) {                                          \
			printf("buffer %d: ", round);                   \
			printf(__VA_ARGS__);                            \
			printf("\n");                                   \
			if (++failures > 20)                            \
				exit(1);                                \
		}                                                       \
	} while (0)

struct want_gap {
	uint32_t key, source, sender, want, got, rank;
};

static int gap_cmp(const void *a, const void *b)
{
	const struct want_gap *x = (const struct want_gap *)a, *y = (const struct want_gap *)b;
	return x->key != y->key ? (x->key < y->key ? -1 : 1) : 0;
}

static void check(int round)
{
	// The records, by walk.
	static struct block_shared w;
	w.job = sh.job;
	w.data = sh.data;
	walk(&w, 0, 0);
	CHECK(w.n == sh.n && w.bad == sh.bad && w.bad_record == sh.bad_record,
	      "records %u bad %u at %u; walk says %u bad %u at %u", sh.n, sh.bad, sh.bad_record, w.n, w.bad, w.bad_record);
	if (w.n != sh.n)
		return;
	uint64_t energy = 0;
	uint32_t maxsrc = 0;
	for (uint32_t i = 0; i < w.n; i++) {
		CHECK(w.off[i] == sh.off[i], "record %u at %u, walk says %u", i, sh.off[i], w.off[i]);
		const uint8_t *r = data + w.off[i];
		uint32_t plen = r[4] | r[5] << 8, src = r[6] | r[7] << 8, seq = plen >= 4 ? rd_be32(r + 24) : 0;
		CHECK(sh.plen[i] == plen && sh.src[i] == src && sh.ring[i] == le32(r + 16) && sh.gen[i] == le32(r + 20) &&
			      sh.sender[i] == seq,
		      "record %u decoded wrong", i);
		for (uint32_t k = 4; plen >= 4 && k + 2 <= plen; k += 2)
			energy += (uint32_t)r[24 + k] << 8 | r[24 + k + 1];
		maxsrc = src > maxsrc ? src : maxsrc;
	}
	CHECK(sh.energy == energy, "energy %llu, want %llu", (unsigned long long)sh.energy, (unsigned long long)energy);
	CHECK(w.n == 0 || sh.max_source == maxsrc, "max source %u, want %u", sh.max_source, maxsrc);
	// Each source's records in order, as the old thread-per-source loop saw them.
	static struct want_gap gaps[4 * 1024], got[LOCAL_GAPS];
	uint32_t ngaps = 0, nreplay = 0;
	for (uint32_t s = 0; s < sh.job.sources; s++) {
		struct source_summary m = {};
		uint32_t k = 0, prev = 0, nexts = 0, replay = 0, first_gen = 0, rank = 0, p = sh.seg_start[s];
		uint32_t list = ngaps;
		for (uint32_t i = 0; i < w.n; i++) {
			if (sh.src[i] != s)
				continue;
			CHECK(p < w.n && sh.sorted[p] == i, "source %u: sorted[%u] = %u, want %u", s, p, sh.sorted[p], i);
			p++;
			uint32_t ring = sh.ring[i], plen = sh.plen[i];
			if (k && sh.gen[i] != first_gen)
				replay = 1;
			first_gen = k ? first_gen : sh.gen[i];
			if (k && ring != prev + 1) {
				gaps[ngaps++] = {i * 2, s, 0, prev + 1, ring, rank++};
				m.dropped += (uint32_t)(ring - (prev + 1));
			}
			k++;
			m.bytes += plen;
			prev = ring;
			if (plen < 4) {
				m.shorts++;
				continue;
			}
			uint32_t t = sh.sender[i];
			if (!m.have_t) {
				m.have_t = 1, m.t1 = t, m.t1_i = i, nexts = t + 1;
			} else {
				int32_t u = (int32_t)(t - m.t1);
				if (u <= -SEQ_WINDOW || u >= SEQ_WINDOW)
					replay = 1;
				int32_t d = (int32_t)(t - nexts);
				if (d == 0) {
					nexts++;
				} else if (d > 0) {
					gaps[ngaps++] = {i * 2 + 1, s, 1, nexts, t, rank++};
					m.sgaps += (uint32_t)d;
					nexts = t + 1;
				} else {
					m.back++;
				}
			}
			m.last_t = t;
		}
		m.nexts = nexts;
		m.gaps = rank;
		CHECK(sh.seg_count[s] == k, "source %u: %u records, want %u", s, sh.seg_count[s], k);
		CHECK(sh.replay[s] == replay, "source %u: replay %u, want %u", s, sh.replay[s], replay);
		nreplay += replay;
		if (replay || !k) {
			ngaps = list; // a replayed source lists its gaps in turn
			continue;
		}
		const struct source_summary *g = &sh.u.sum.sum[s];
		CHECK(g->have_t == m.have_t && g->bytes == m.bytes && g->shorts == m.shorts && g->dropped == m.dropped &&
			      g->gaps == m.gaps,
		      "source %u: summary counts differ", s);
		CHECK(!m.have_t || (g->t1 == m.t1 && g->t1_i == m.t1_i && g->last_t == m.last_t && g->nexts == m.nexts &&
				    g->sgaps == m.sgaps && g->back == m.back),
		      "source %u: sender summary differs: t1 %u/%u i %u/%u last %u/%u next %u/%u gaps %llu/%llu back %u/%u", s,
		      g->t1, m.t1, g->t1_i, m.t1_i, g->last_t, m.last_t, g->nexts, m.nexts, (unsigned long long)g->sgaps,
		      (unsigned long long)m.sgaps, g->back, m.back);
	}
	// The gaps kept aside, of the sources that do not replay.
	uint32_t kept = 0, nlocal = sh.nlocal < LOCAL_GAPS ? sh.nlocal : LOCAL_GAPS;
	for (uint32_t i = 0; i < nlocal; i++) {
		const struct local_gap *l = &sh.local[i];
		if (!sh.replay[l->source])
			got[kept++] = {l->key, l->source, l->sender, l->want, l->got, l->rank};
	}
	uint32_t want = 0;
	for (uint32_t i = 0; i < ngaps; i++)
		if (gaps[i].rank < FB_TRIGGER_MAX_GAPS)
			gaps[want++] = gaps[i];
	if (sh.overflow || nreplay)
		return; // what a replaying source kept aside may differ, and it is void
	qsort(gaps, want, sizeof gaps[0], gap_cmp);
	qsort(got, kept, sizeof got[0], gap_cmp);
	CHECK(kept == want, "%u gaps kept aside, want %u", kept, want);
	for (uint32_t i = 0; i < kept && i < want; i++)
		CHECK(!memcmp(&got[i], &gaps[i], sizeof got[i]), "gap %u: key %u rank %u want %u got %u; want key %u rank %u want %u got %u",
		      i, got[i].key, got[i].rank, got[i].want, got[i].got, gaps[i].key, gaps[i].rank, gaps[i].want, gaps[i].got);
}

int main(int argc, char **argv)
{
	int buffers = argc > 1 ? atoi(argv[1]) : 300;
	rnd_state = argc > 2 ? strtoull(argv[2], 0, 10) : 88172645463325252ull;
	pthread_barrier_init(&all_bar, 0, FB_TRIGGER_THREADS);
	for (uint32_t w = 0; w < FB_TRIGGER_THREADS / 32; w++)
		pthread_barrier_init(&warp_bar[w], 0, 32);
	uint32_t parsed = 0;
	for (int round = 0; round < buffers; round++) {
		fill(round);
		pthread_t th[FB_TRIGGER_THREADS];
		for (uintptr_t t = 0; t < FB_TRIGGER_THREADS; t++)
			pthread_create(&th[t], 0, block_thread, (void *)t);
		for (uint32_t t = 0; t < FB_TRIGGER_THREADS; t++)
			pthread_join(th[t], 0);
		parsed += sh.job.bytes <= 8 * PAR_SLOTS && sh.ncand <= PAR_NODES;
		check(round);
	}
	if (failures)
		return 1;
	printf("ok %d buffers, %u parsed in parallel\n", buffers, parsed);
	return 0;
}

/* SPDX-License-Identifier: MIT
 *
 * fb_ingest.h: the memory layout of a fabricbridge ingest ring (version 1),
 * for C and CUDA consumers that read the region in place. The Go package
 * github.com/fabricbridge/fabricbridge/fabric/ingest is the reference;
 * docs/ingest.md explains the protocol, and the package's tests compile this
 * header and compare every offset with the Go side.
 *
 * All fields are little-endian. Shared words that change after the header
 * is written (state, published, source_count, producer_state, cons_armed)
 * must be read with acquire loads (volatile plus a fence in CUDA) and
 * written with release stores.
 */
#ifndef FB_INGEST_H
#define FB_INGEST_H

#include <stdint.h>

#define FB_INGEST_MAGIC 0x4e494246u /* "FBIN" */
#define FB_INGEST_VERSION 1u
#define FB_INGEST_RECORD_HEADER 24u
#define FB_INGEST_RECORD_ALIGN 8u

enum fb_ingest_flags {
	FB_INGEST_HUGETLB = 1,
	FB_INGEST_LOCKED = 2,
	FB_INGEST_ALIGNED_WINDOWS = 4,
};

enum fb_ingest_state {
	FB_INGEST_FREE = 0,  /* the producer may fill the buffer */
	FB_INGEST_READY = 1, /* published: the consumer's until it stores FREE */
};

enum fb_ingest_buffer_flags {
	FB_INGEST_BUF_WINDOW = 1,    /* its time window closed */
	FB_INGEST_BUF_FULL = 2,      /* the next record did not fit */
	FB_INGEST_BUF_FLUSHED = 4,   /* the producer flushed it */
	FB_INGEST_BUF_CONTINUED = 8, /* aligned windows: the window goes on in the next buffer */
};

struct fb_ingest_header {
	uint32_t magic;
	uint32_t version;
	uint32_t header_len; /* 4096 */
	uint32_t flags;
	uint64_t region_len;
	uint32_t buffer_count;
	uint32_t buffer_size;
	uint64_t desc_off;
	uint64_t sources_off;
	uint32_t max_sources;
	uint32_t record_align;
	uint64_t buffers_off;
	uint64_t window_ns;
	uint32_t buffer_id;
	uint8_t reserved0[128 - 76];
	/* the producer's cache line */
	uint64_t published;
	uint32_t source_count;
	uint32_t producer_state; /* 1 open, 2 closed */
	uint64_t records;
	uint64_t dropped;
	uint32_t cons_armed;
	uint8_t reserved1[256 - 164];
	/* the consumer's cache line */
	uint32_t consumer_state; /* 1 attached, 2 closed */
	uint32_t reserved2;
	uint64_t next_seq;
	uint64_t released;
	uint8_t reserved3[4096 - 280];
};

struct fb_ingest_desc {
	uint32_t state;
	uint32_t records;
	uint64_t seq;
	uint32_t bytes;
	uint32_t flags;
	uint64_t first_ns;
	uint64_t last_ns;
	uint64_t window_ns;
	uint64_t publish_ns;
	uint64_t reserved;
};

struct fb_ingest_source {
	uint8_t addr[16]; /* IPv6, or IPv4-mapped ::ffff:a.b.c.d */
	uint16_t src_port;
	uint16_t dst_port;
	uint32_t flags; /* 1: IPv6 */
	uint64_t first_ns;
};

struct fb_ingest_record {
	uint32_t size; /* to the next record: 24 + payload_len rounded up to 8 */
	uint16_t payload_len;
	uint16_t source; /* < source_count */
	uint64_t rx_ns;
	uint32_t seq; /* per source, counting drops at the bridge */
	uint32_t source_gen; /* changes when the source entry goes to another source; seq restarts */
	/* payload_len bytes of UDP payload follow, 8-byte aligned */
};

#define FB_INGEST_ASSERT(c, m) _Static_assert(c, m)
#ifndef __cplusplus
FB_INGEST_ASSERT(sizeof(struct fb_ingest_header) == 4096, "header is one page");
FB_INGEST_ASSERT(sizeof(struct fb_ingest_desc) == 64, "descriptor is one cache line");
FB_INGEST_ASSERT(sizeof(struct fb_ingest_source) == 32, "source entry is 32 bytes");
FB_INGEST_ASSERT(sizeof(struct fb_ingest_record) == FB_INGEST_RECORD_HEADER, "record header is 24 bytes");
#endif

static inline struct fb_ingest_desc *fb_ingest_desc(void *region, uint32_t k)
{
	struct fb_ingest_header *h = (struct fb_ingest_header *)region;
	return (struct fb_ingest_desc *)((char *)region + h->desc_off) + k;
}

static inline uint8_t *fb_ingest_buffer(void *region, uint32_t k)
{
	struct fb_ingest_header *h = (struct fb_ingest_header *)region;
	return (uint8_t *)region + h->buffers_off + (uint64_t)k * h->buffer_size;
}

#endif /* FB_INGEST_H */

/* SPDX-License-Identifier: MIT
 *
 * fb_trigger.h: what the GPU trigger kernel (trigger.cu) shares with its Go
 * host (package github.com/fabricbridge/fabricbridge/fabric/ingest/gpu).
 * Plain C as well as CUDA, so that the package's tests can compile it with
 * the host's compiler and compare every offset with the Go constants.
 *
 * Three kinds of memory: the ring itself and the control block, job table
 * and result ring are host memory the device reads and writes over the bus
 * (registered and mapped); the state, source table and gap list are device
 * memory the host copies out when the kernel has stopped.
 */
#ifndef FB_TRIGGER_H
#define FB_TRIGGER_H

#include "../fb_ingest.h"

#define FB_TRIGGER_THREADS 256 /* threads per block, both entry points */
#define FB_TRIGGER_CHUNK 1024  /* records parsed per pass over a buffer */
#define FB_TRIGGER_MAX_GAPS 64 /* ingest.MaxGaps: gaps the reference keeps */

/* Result flags. */
enum fb_trigger_result_flags {
	FB_TRIGGER_CLOSED = 1,    /* the buffer closed its window: window_energy is its sum */
	FB_TRIGGER_TRIGGERED = 2, /* ... and the sum reached the threshold */
};

/* Why the kernel stopped with an error (fb_trigger_ctrl.error). */
enum fb_trigger_errors {
	FB_TRIGGER_ESEQ = 1,     /* a descriptor carried the wrong sequence number */
	FB_TRIGGER_EDESC = 2,    /* a descriptor's counts or times are impossible */
	FB_TRIGGER_ERECORD = 3,  /* a record reaches outside its buffer or names no source */
	FB_TRIGGER_ETRAILER = 4, /* bytes after the last record */
	FB_TRIGGER_EGAPS = 5,    /* the gap list overflowed (never, when sized 64 per source) */
};

/* The kernel's arguments, in device memory, written once by the host. */
struct fb_trigger_args {
	uint64_t region;       /* device address of the registered ring (persistent mode) */
	uint64_t ctrl;         /* device address of the mapped control block */
	uint64_t results;      /* mapped result ring, result_slots entries */
	uint64_t jobs;         /* mapped job table (host-driven mode) */
	uint64_t state;        /* device memory: struct fb_trigger_state */
	uint64_t sources;      /* device memory: struct fb_trigger_source[max_sources] */
	uint64_t gaps;         /* device memory: struct fb_trigger_gap[gap_capacity] */
	uint64_t first_seq;    /* persistent mode: block b takes first_seq + b + i*gridDim */
	uint64_t threshold;    /* a window triggers when its energy reaches this */
	uint64_t desc_off;     /* the ring's header, copied */
	uint64_t buffers_off;
	uint32_t buffer_count;
	uint32_t buffer_size;
	uint32_t max_sources;
	uint32_t result_slots;
	uint32_t gap_capacity;
	uint32_t stage_bytes;  /* dynamic shared memory a buffer is staged in */
	uint64_t reserved[2];
};

/* The control block: host memory, mapped. */
struct fb_trigger_ctrl {
	uint64_t stop_seq;     /* host: blocks stop before this sequence number */
	uint64_t results_read; /* host: results consumed; the kernel waits for room */
	uint32_t error;        /* kernel: an fb_trigger_errors code, 0 none */
	uint32_t error_record; /* kernel: the record at fault */
	uint64_t error_seq;    /* kernel: the buffer at fault */
	uint64_t reserved[4];
};

/* One buffer of a host-driven launch: host memory, mapped. */
struct fb_trigger_job {
	uint64_t data;       /* device address of the buffer's copy */
	uint64_t seq;
	uint64_t publish_ns;
	uint32_t records;
	uint32_t bytes;
	uint32_t flags;
	uint32_t sources;    /* valid source-table entries when it was taken */
	uint64_t reserved[3];
};

/* One buffer's result: host memory, mapped, slot seq mod result_slots. */
struct fb_trigger_result {
	uint64_t seq1;          /* seq + 1, stored last with release */
	uint64_t publish_ns;    /* the descriptor's */
	uint64_t buffer_energy; /* hit energies of this buffer */
	uint64_t window_energy; /* the window's sum, if FB_TRIGGER_CLOSED */
	uint32_t records;
	uint32_t flags;
	uint64_t gpu_ns;        /* %globaltimer at publication (not the host's clock) */
	uint64_t reserved[2];
};

/* Running totals: device memory. The turn has a cache line of its own:
 * blocks waiting for it poll that line while the block in turn writes the
 * others. */
struct fb_trigger_state {
	uint64_t window_energy; /* the open window's running sum */
	uint64_t windows;
	uint64_t triggers;
	uint32_t source_slots;  /* highest source index seen + 1 */
	uint32_t gaps_before;   /* gaps in folded buffers, saturating at FB_TRIGGER_MAX_GAPS */
	uint32_t gap_count;     /* entries used in the gap list */
	uint32_t failed;        /* a block found an error: all stop */
	uint64_t buffers;
	uint64_t records;
	uint64_t reserved[9];
	uint64_t turn;          /* the next sequence number to fold in */
	uint64_t reserved_turn[15];
	/* Persistent mode's profile: SM cycles of its blocks' thread 0 in each
	 * phase (enum fb_trigger_phases), summed over buffers, and how many
	 * SM cycles and nanoseconds the blocks ran, for the clock rate. */
	uint64_t prof_cycles[7];
	uint64_t prof_run_cycles;
	uint64_t prof_run_ns;
	uint64_t reserved_prof[7];
};

/* Where a persistent block's thread 0 spends a buffer's time. */
enum fb_trigger_phases {
	FB_TRIGGER_PH_READY,   /* waiting for the buffer, reading its descriptor */
	FB_TRIGGER_PH_STAGE,   /* staging it, handing it back (the release's fence) */
	FB_TRIGGER_PH_PARSE,   /* finding and decoding its records */
	FB_TRIGGER_PH_SUMMARY, /* sorting them by source, summarising each */
	FB_TRIGGER_PH_WAIT,    /* waiting for the turn */
	FB_TRIGGER_PH_TURN,    /* in turn: from the turn's arrival to passing it on */
	FB_TRIGGER_PH_PUBLISH, /* publishing the result, releasing */
	FB_TRIGGER_PHASES
};

/* Per-source counts, ingest.SourceCounts with its private fields: device memory. */
struct fb_trigger_source {
	uint64_t records;
	uint64_t bytes;
	uint64_t dropped_here;
	uint64_t sender_gaps;
	uint64_t sender_backwards;
	uint64_t short_payloads;
	uint64_t first_rx_ns;
	uint64_t last_rx_ns;
	uint32_t next_ring;
	uint32_t next_seq;
	uint32_t first_seq;
	uint32_t last_seq;
	uint32_t have_seq;
	uint32_t gaps;          /* gaps of this source in the list */
	uint64_t reassigned;    /* times the entry went to another source (a new generation) */
	uint32_t gen;           /* the generation of its last record */
	uint32_t reserved;
};

/* One gap, in no particular order: the host sorts by (seq, key). */
struct fb_trigger_gap {
	uint64_t seq;    /* the buffer */
	uint32_t key;    /* record index * 2 + sender: the reference's order within a buffer */
	uint16_t source;
	uint16_t sender; /* 1: in the sender's sequence */
	uint32_t want;
	uint32_t got;
};

#endif /* FB_TRIGGER_H */

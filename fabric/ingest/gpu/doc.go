// Package gpu runs the ingest trigger on an NVIDIA GPU: the consumer of a
// fabric/ingest ring that NaNet's GPU path is, computing exactly what
// ingest.Reference computes on the CPU (per-window energy sums and
// threshold decisions, per-source counts, sequence gaps).
//
// It drives the CUDA driver API through libcuda.so.1, loaded at run time
// with purego: no cgo, no CUDA headers or libraries at build time, so the
// package builds (CGO_ENABLED=0 too) and its tests run where there is no
// GPU. Open returns ErrNoDriver, having loaded nothing, where the library
// is missing.
//
// # The kernel
//
// trigger.cu is CUDA C against ../fb_ingest.h and fb_trigger.h (what the
// kernel shares with this package), built to PTX by clang without CUDA's
// headers (go generate; .ci/run checks that the committed trigger.ptx is
// what clang makes of the source); the driver compiles the PTX for the
// GPU at load. A block of 256 threads takes one buffer: it stages the
// buffer in shared memory, finds, decodes and summarises its records per
// source (fb_block.h: pointer jumping over candidate record starts, a sort
// by source, segmented block scans; a buffer's cost grows with the
// logarithm of its records), in parallel with other blocks; then, in
// publication order (a turn ticket in device memory), it applies the
// summaries to the running per-source counts, closes the window and
// publishes a result. Buffers of more than 1024 records, or from more than
// 256 sources, or larger than the staging area, replay their records in
// turn instead: the same results, slower. A record whose source_gen
// differs from its source's last starts that source afresh (the entry went
// to another source): no gap across, both sequences begin again, and
// ingest.SourceCounts.Reassigned counts it, as in the reference.
//
// # Two modes
//
// Persistent: one launch for the consumer's life. Each block polls the
// descriptor of its next buffer in the ring — host memory registered with
// cuMemHostRegister (DEVICEMAP|PORTABLE) and read over the bus — with
// acquire loads (ld.acquire.sys) and back-off, hands the buffer back with a
// release store (st.release.sys) of state free as soon as it is staged, and
// stores the result into a result ring in registered host memory; the
// host reads results there and stops the kernel through a control block.
// No host thread is on a buffer's path.
//
// HostDriven, the baseline: the ordinary ingest.Consumer wakes up on a
// buffer, copies it and any others ready to device memory
// (cuMemcpyHtoDAsync), launches the kernel over them, waits, reads the
// results and releases the buffers.
//
// # Checking it on a GPU
//
// From the repository root, with Go here and the GPU elsewhere:
//
//	fabric/ingest/gpu/gpucheck.sh build .gpu   # here: .gpu/gpu.test, .gpu/gpucheck.sh
//	bash .gpu/gpucheck.sh run                  # there, no Go needed
//
// It fails (FB_REQUIRE_GPU=1) rather than skips without a GPU, compares
// the GPU's results with the CPU reference's on the same buffers in both
// modes, and measures records/s over a full ring and publish-to-result
// latency over paced buffers for both modes and the CPU reference on one
// core, in a few seconds. docs/gpu-ingest.md has the results.
package gpu

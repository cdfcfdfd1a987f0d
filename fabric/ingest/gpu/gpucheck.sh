#!/usr/bin/env bash
# gpucheck.sh: the GPU consumer's check, for a machine with an NVIDIA GPU
# and its driver but no Go toolchain: build the test binary here, carry it
# there, run it from the repository root.
#
#   here:   fabric/ingest/gpu/gpucheck.sh build [DIR]   (DIR defaults to .gpu)
#   there:  bash DIR/gpucheck.sh run                    (logs to $OUT, or DIR)
#
# The run requires the GPU (FB_REQUIRE_GPU=1: no skipping), checks the GPU
# against the CPU reference record for record, and measures both modes and
# the CPU reference: well under 30 seconds.
set -euo pipefail
case "${1:-}" in
build)
	dir=${2:-.gpu}
	mkdir -p "$dir"
	CGO_ENABLED=0 go test -c -o "$dir/gpu.test" ./fabric/ingest/gpu
	cp "$0" "$dir/gpucheck.sh"
	;;
run)
	dir=$(cd "$(dirname "$0")" && pwd)
	out=${OUT:-$dir}
	{ date -u; uname -a; nvidia-smi; } >"$out/env.txt" 2>&1 || true
	cd "$dir"
	FB_REQUIRE_GPU=1 timeout 200 ./gpu.test -test.v -test.count=1 -test.timeout 190s \
		-test.run 'GPU|NoDriver' 2>&1 | tee "$out/test.txt"
	;;
*)
	echo "usage: $0 build [DIR] | run" >&2
	exit 2
	;;
esac

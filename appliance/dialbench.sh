#!/usr/bin/env bash
# dialbench.sh: issue 17's Dial-rate benchmark (BenchmarkDialRate: an
# application dials a kernel server through the daemon, the bridge host's
# kernel connects to it in the same run; their ratio) for a machine with
# cores to spare and no Go toolchain: build here, carry the folder there,
# run it from the repository root.
#
#   here:   appliance/dialbench.sh build [DIR]   (DIR defaults to .perf)
#   there:  bash DIR/dialbench.sh run [RUNS]     (logs to $OUT, or DIR)
#
# Each run builds its own namespaces and daemon (a few seconds on 16 cores);
# the kernel baseline is measured in the same run, so compare ratios.
set -euo pipefail
case "${1:-}" in
build)
	dir=${2:-.perf}
	mkdir -p "$dir"
	CGO_ENABLED=0 go test -c -ldflags='-s -w' -o "$dir/appliance.test" ./appliance
	cp "$0" "$dir/dialbench.sh"
	;;
run)
	dir=$(cd "$(dirname "$0")" && pwd)
	out=${OUT:-$dir}
	{ date -u; uname -a; nproc; } >"$out/env.txt" 2>&1 || true
	cd "$dir/../appliance"
	for i in $(seq 1 "${2:-5}"); do
		FB_REQUIRE_PRIVILEGED=1 timeout 120 "$dir/appliance.test" -test.run '^$' -test.bench DialRate \
			-test.benchtime 1x -test.v 2>&1 | grep -E 'held:|FAIL|panic' || true
	done | tee "$out/dial.txt"
	;;
*)
	echo "usage: $0 build [DIR] | run [RUNS]" >&2
	exit 2
	;;
esac

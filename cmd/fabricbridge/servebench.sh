#!/usr/bin/env bash
# servebench.sh: issue 14's serving benchmark (BenchmarkServeHTTP: wrk against
# `app http` behind the daemon and against a kernel net/http server, ratios
# from one run) for a machine with cores to spare and no Go toolchain: build
# here, carry the folder there, run it from the repository root.
#
#   here:   cmd/fabricbridge/servebench.sh build [DIR]   (DIR defaults to .perf)
#   there:  bash DIR/servebench.sh run                   (logs to $OUT, or DIR)
#
# build puts the test binary, wrk and iproute2 from Debian (with the libraries
# wrk needs) into DIR; run uses the machine's own ip when it has one.
set -euo pipefail
case "${1:-}" in
build)
	dir=${2:-.perf}
	rm -rf "$dir" && mkdir -p "$dir/deb" "$dir/root" "$dir/bin"
	(cd "$dir/deb" && apt-get download wrk libluajit-5.1-2 iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12 libbsd0 libmd0 >/dev/null)
	for d in "$dir"/deb/*.deb; do dpkg -x "$d" "$dir/root"; done
	rm -rf "$dir/deb"
	cp -L /lib/x86_64-linux-gnu/libssl.so.3 /lib/x86_64-linux-gnu/libcrypto.so.3 "$dir/root/usr/lib/x86_64-linux-gnu/"
	for tool in wrk:usr/bin/wrk ip-fallback:bin/ip; do
		printf '#!/bin/sh\nR=$(cd "$(dirname "$0")/../root" && pwd)\nLD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu exec "$R/%s" "$@"\n' \
			"${tool#*:}" >"$dir/bin/${tool%%:*}"
	done
	chmod +x "$dir"/bin/*
	CGO_ENABLED=0 go test -c -ldflags='-s -w' -o "$dir/cmd.test" ./cmd/fabricbridge
	cp "$0" "$dir/servebench.sh"
	;;
run)
	dir=$(cd "$(dirname "$0")" && pwd)
	out=${OUT:-$dir}
	export PATH=$dir/bin:$PATH
	command -v ip >/dev/null || ln -sf ip-fallback "$dir/bin/ip"
	{ date -u; uname -a; nproc; lscpu | head -20; ip -V; } >"$out/env.txt" 2>&1 || true
	cd "$dir/../cmd/fabricbridge"
	FB_REQUIRE_PRIVILEGED=1 FB_BENCH_ROUNDS=${FB_BENCH_ROUNDS:-3} FB_BENCH_SECONDS=${FB_BENCH_SECONDS:-10} timeout 330 "$dir/cmd.test" \
		-test.run '^$' -test.bench ServeHTTP -test.benchtime 1x -test.v -test.timeout 320s 2>&1 | tee "$out/serve.txt"
	;;
*)
	echo "usage: $0 build [DIR] | run" >&2
	exit 2
	;;
esac

#!/usr/bin/env bash
# servebench.sh: issue 14's serving benchmark (BenchmarkServeHTTP: wrk and ab
# against `app http` behind the daemon and against a kernel net/http server,
# a bulk transfer into `app sink` and into a kernel sink, the same sent by
# socat into a socat sink as the issue measured it, a download from each HTTP
# server, ratios from one run), after BenchmarkEndToEnd (./userstack: the
# 1-byte request/response, goodput and connections/s against the kernel's)
# for a machine with cores to spare and no Go toolchain: build here, carry the
# folder there, run it from the repository root.
#
#   here:   cmd/fabricbridge/servebench.sh build [DIR]   (DIR defaults to .perf)
#   there:  bash DIR/servebench.sh run                   (logs to $OUT, or DIR)
#
# build puts the test binary, wrk, ab, socat and iproute2 from Debian (with
# the libraries they need) into DIR; run uses the machine's own ip when it
# has one. On 8 CPUs or more, run pins the loop, the applications and the
# clients apart unless FB_BENCH_PIN says otherwise (FB_BENCH_PIN=none: no
# pinning), and then serves again with one instance of the application per
# application CPU (the main run has one process with a stack per
# application CPU: FB_BENCH_STACKS).
set -euo pipefail
case "${1:-}" in
build)
	dir=${2:-.perf}
	rm -rf "$dir" && mkdir -p "$dir/deb" "$dir/root" "$dir/bin"
	(cd "$dir/deb" && apt-get download wrk libluajit-5.1-2 apache2-utils socat libwrap0 libapr1 libaprutil1 libexpat1 libcrypt1 libuuid1 iproute2 libbpf1 libelf1 libmnl0 libcap2 libxtables12 libbsd0 libmd0 >/dev/null)
	for d in "$dir"/deb/*.deb; do dpkg -x "$d" "$dir/root"; done
	rm -rf "$dir/deb"
	cp -L /lib/x86_64-linux-gnu/libssl.so.3 /lib/x86_64-linux-gnu/libcrypto.so.3 "$dir/root/usr/lib/x86_64-linux-gnu/"
	# the rest of what the tools link that is not C's own library (socat's
	# libnsl and Kerberos, for one), from this machine
	LD_LIBRARY_PATH=$dir/root/usr/lib/x86_64-linux-gnu:$dir/root/lib/x86_64-linux-gnu \
		ldd "$dir/root/usr/bin/wrk" "$dir/root/usr/bin/ab" "$dir/root/usr/bin/socat" "$dir/root/bin/ip" |
		awk '$2 == "=>" && $3 ~ /^\// && $3 !~ /\/(libc|libm|libpthread|libdl|librt|libresolv)\.so/ {print $3}' | sort -u |
		grep -v "^$dir/" | xargs -r cp -L -t "$dir/root/usr/lib/x86_64-linux-gnu/"
	for tool in wrk:usr/bin/wrk ab:usr/bin/ab socat:usr/bin/socat ip-fallback:bin/ip; do
		printf '#!/bin/sh\nR=$(cd "$(dirname "$0")/../root" && pwd)\nLD_LIBRARY_PATH=$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu exec "$R/%s" "$@"\n' \
			"${tool#*:}" >"$dir/bin/${tool%%:*}"
	done
	chmod +x "$dir"/bin/*
	CGO_ENABLED=0 go test -c -ldflags='-s -w' -o "$dir/cmd.test" ./cmd/fabricbridge
	CGO_ENABLED=0 go test -c -ldflags='-s -w' -o "$dir/userstack.test" ./userstack
	# the device tool carries 64 MiB with the working tree
	rm -rf "$dir/root/usr/share" "$dir/root/usr/include"
	gzip -f "$dir"/*.test
	cp "$0" "$dir/servebench.sh"
	;;
run)
	dir=$(cd "$(dirname "$0")" && pwd)
	out=${OUT:-$dir}
	export PATH=$dir/bin:$PATH
	command -v ip >/dev/null || ln -sf ip-fallback "$dir/bin/ip"
	for t in "$dir"/*.test.gz; do gunzip -c "$t" >"${t%.gz}" && chmod +x "${t%.gz}"; done
	{ date -u; uname -a; nproc; lscpu | head -20; ip -V; } >"$out/env.txt" 2>&1 || true
	cd "$dir/../cmd/fabricbridge"
	cpus=$(nproc)
	pin=${FB_BENCH_PIN:-}
	pinned="FB_BENCH_PIN=$pin as given"
	if [ "$pin" = none ]; then
		pin= pinned="no pinning (FB_BENCH_PIN=none)"
	elif [ -z "$pin" ] && [ "$cpus" -ge 8 ]; then
		pin=loop=1,app=2-3,client=4-7 split=2
		[ "$cpus" -lt 12 ] || pin=loop=2,app=3-5,client=8-11 split=3
		pinned="FB_BENCH_PIN unset on $cpus CPUs, pinning by default: FB_BENCH_PIN=$pin"
	elif [ -z "$pin" ]; then
		pinned="no pinning on $cpus CPUs"
	fi
	export FB_BENCH_PIN=$pin
	# The 1-byte request/response against the kernel's (BenchmarkEndToEnd,
	# unpinned: each loop finds a core of its own on an idle machine), about
	# 10 s a run: as configured by default, and on 8 CPUs or more again with
	# the loops spinning (FB_BENCH_RR_SPIN, 200us) instead of sleeping.
	rr() {
		(cd "$dir/../userstack" && env "$@" FB_REQUIRE_PRIVILEGED=1 timeout 90 "$dir/userstack.test" \
			-test.run '^$' -test.bench EndToEnd -test.benchtime 1x -test.count "${FB_BENCH_RR_RUNS:-3}" -test.v 2>&1) |
			tee -a "$out/rr.txt" || echo "servebench: the request/response benchmark failed ($*)" >&2
	}
	echo "servebench: request/response, loops as configured by default" | tee "$out/rr.txt"
	rr FB_BENCH_SPIN=
	if [ "$cpus" -ge 8 ]; then
		echo "servebench: request/response, loops spinning FB_BENCH_SPIN=${FB_BENCH_RR_SPIN:-200us}" | tee -a "$out/rr.txt"
		rr FB_BENCH_SPIN="${FB_BENCH_RR_SPIN:-200us}"
	fi
	# About 3 minutes on 16 CPUs: wrk 3x2x(10 s + 5 s), ab, the bulk
	# transfers (Go sender and socat), the downloads 3x2 each; the limits
	# keep it within a 5-minute window.
	# The application runs a Go processor per stack, so with the default
	# pinning it gets a stack for each of its CPUs (--stacks).
	split=${FB_BENCH_SPLIT:-${split:-0}}
	stacks=${FB_BENCH_STACKS:-$((split > 1 ? split : 1))}
	{
		echo "servebench: $pinned; one application process with $stacks stacks"
		FB_REQUIRE_PRIVILEGED=1 FB_BENCH_STACKS=$stacks FB_BENCH_ROUNDS=${FB_BENCH_ROUNDS:-3} FB_BENCH_SECONDS=${FB_BENCH_SECONDS:-10} timeout 280 "$dir/cmd.test" \
			-test.run '^$' -test.bench ServeHTTP -test.benchtime 1x -test.v -test.timeout 270s 2>&1
	} | tee "$out/serve.txt"
	# The same cores split between processes, one stack each
	# (FB_BENCH_INSTANCES, GOMAXPROCS 1 apiece) instead of one process
	# with a stack for each: keep-alive only, about 45 s. On by default with the
	# default pinning; FB_BENCH_SPLIT=N asks for N instances.
	if [ "$split" -gt 1 ]; then
		{
			echo "servebench: $split instances of the application on its CPUs"
			FB_REQUIRE_PRIVILEGED=1 FB_BENCH_INSTANCES=$split FB_BENCH_AB=0 FB_BENCH_BULK_MB=0 FB_BENCH_ROUNDS=${FB_BENCH_ROUNDS:-3} FB_BENCH_SECONDS=5 \
				timeout 120 "$dir/cmd.test" -test.run '^$' -test.bench ServeHTTP -test.benchtime 1x -test.v -test.timeout 110s 2>&1
		} | tee "$out/serve-split.txt"
	fi
	;;
*)
	echo "usage: $0 build [DIR] | run" >&2
	exit 2
	;;
esac

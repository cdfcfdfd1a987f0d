package ebpf

// The generated files are committed so that building needs no clang; CI
// regenerates them with Debian's clang and fails if they differ.
//go:generate go tool bpf2go -cc clang -cflags "-O2 -g -Wall -Werror -I/usr/include/x86_64-linux-gnu" -target bpfel -type fb_meta -type fb_ingest_meta -type fb_verdict -type fb_action -type fb_flag -type fb_event -type fb_rule -type fb_ruleset -type fb_counter bpf fabricbridge.c

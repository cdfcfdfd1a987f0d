package ebpf

// The generated files are committed so that building needs no clang; CI
// regenerates them with Debian's clang and fails if they differ. bpf2go runs
// under bpf2go_multiarch.go, which adds the include directory that
// linux/bpf.h needs on Debian whatever the host's architecture.
//go:generate go run bpf2go_multiarch.go -cc clang -cflags "-O2 -g -Wall -Werror" -target bpfel -type fb_meta -type fb_ingest_meta -type fb_limit -type fb_verdict -type fb_action -type fb_flag -type fb_event -type fb_rule -type fb_ruleset -type fb_slot -type fb_spread -type fb_counter bpf fabricbridge.c

//go:build ignore

// bpf2go_multiarch runs bpf2go with the C compiler's multiarch include
// directory added to the compiler flags. Debian keeps the kernel's asm/
// headers, which linux/bpf.h includes, in /usr/include/<triplet>
// (x86_64-linux-gnu, aarch64-linux-gnu, ...), a directory clang does not
// search when it targets BPF. The triplet is the compiler's own answer to
// -print-multiarch, so the headers are the host's; where that directory does
// not exist, as on distributions that keep asm/ in /usr/include, nothing is
// added.
//
// Its arguments are bpf2go's; gen.go's go:generate runs it.
package main

import (
	"errors"
	"fmt"
	"io/fs"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

func main() {
	log.SetFlags(0)
	log.SetPrefix("bpf2go_multiarch: ")
	args := os.Args[1:]
	cc, cflags := os.Getenv("BPF2GO_CC"), -1
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "-cc":
			cc = args[i+1]
		case "-cflags":
			cflags = i + 1
		}
	}
	if cc == "" {
		cc = "clang"
	}
	dir, err := multiarchInclude(cc)
	if err != nil {
		log.Fatal(err)
	}
	if dir != "" {
		if cflags >= 0 {
			args[cflags] += " -I" + dir
		} else {
			os.Setenv("BPF2GO_CFLAGS", strings.TrimSpace(os.Getenv("BPF2GO_CFLAGS")+" -I"+dir))
		}
	}
	cmd := exec.Command("go", append([]string{"tool", "bpf2go"}, args...)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		log.Fatal(err)
	}
}

// multiarchInclude returns /usr/include/<triplet> for the triplet cc reports,
// or "" if cc reports none or the directory does not exist. cc may hold
// arguments after the compiler's name, as bpf2go's -cc may.
func multiarchInclude(cc string) (string, error) {
	argv := strings.Fields(cc)
	out, err := exec.Command(argv[0], append(argv[1:], "-print-multiarch")...).Output()
	if err != nil {
		return "", fmt.Errorf("%s -print-multiarch: %w", cc, err)
	}
	triplet := strings.TrimSpace(string(out))
	if triplet == "" {
		return "", nil
	}
	dir := filepath.Join("/usr/include", triplet)
	if _, err := os.Stat(dir); errors.Is(err, fs.ErrNotExist) {
		return "", nil
	} else if err != nil {
		return "", err
	}
	return dir, nil
}

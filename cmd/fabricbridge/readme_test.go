package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeCommands holds the README's first lines to the two commands a
// newcomer copies: the demo and ./test.
func TestReadmeCommands(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"go run ./cmd/fabricbridge demo", "FB_REQUIRE_PRIVILEGED=1 ./test"} {
		if !strings.Contains(string(readme[:min(len(readme), 600)]), want) {
			t.Errorf("the README does not start with %q", want)
		}
	}
}

// TestTestScriptInstallsWhatIsMissing runs the README's test command on a
// machine that lacks the tests' tools: a PATH holding only bash, a fake
// apt-get that "installs" by creating the commands, and a fake go. The
// script must ask apt-get for exactly the missing packages, then hand its
// arguments to go test.
func TestTestScriptInstallsWhatIsMissing(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "bin")
	if err := os.Mkdir(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	script, err := os.ReadFile("../../test")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "test"), script, 0o755); err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(dir, "log")
	for _, tool := range []string{"bash", "dirname"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Skipf("no %s", tool)
		}
		if err := os.Symlink(p, filepath.Join(bin, tool)); err != nil {
			t.Fatal(err)
		}
	}
	chmod, err := exec.LookPath("chmod")
	if err != nil {
		t.Skip("no chmod")
	}
	fake := map[string]string{
		// Root, so the script installs instead of only telling.
		"id": "echo 0",
		// "Installs" a package by creating the command it provides.
		"apt-get": `echo "apt-get $*" >>` + log + `
[ "$1" = install ] || exit 0
for p in "$@"; do
	case $p in
	iproute2) c=ip;; nftables) c=nft;; tshark) c=tshark;; buildah) c=buildah;; groff-base) c=groff;; man-db) c=man;; bird2) c=bird;; frr) c=vtysh;; xdp-tools) c=xdp-filter;; zsh) c=zsh;; fish) c=fish;; *) continue;;
	esac
	printf '#!` + bash + `\n' >` + bin + `/$c; ` + chmod + ` +x ` + bin + `/$c
done`,
		"go": `echo "go $*" >>` + log,
	}
	for name, body := range fake {
		if err := os.WriteFile(filepath.Join(bin, name), []byte("#!"+bash+"\n"+body+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// nft is already there: the others are missing.
	if err := os.WriteFile(filepath.Join(bin, "nft"), []byte("#!"+bash+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(bash, filepath.Join(dir, "test"), "-count=1", "-run", "X")
	cmd.Env = []string{"PATH=" + bin, "HOME=" + dir}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("./test: %v\n%s", err, out)
	}
	got, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	install := regexp.MustCompile(`(?m)^apt-get install .*$`).FindString(string(got))
	for _, want := range []string{"iproute2", "tshark", "buildah", "groff-base", "man-db", "bird2", "frr", "xdp-tools", "zsh", "fish"} {
		if !strings.Contains(install, " "+want) {
			t.Errorf("apt-get install line %q lacks %s", install, want)
		}
	}
	if strings.Contains(install, "nftables") {
		t.Errorf("apt-get install line %q installs nftables, which was there", install)
	}
	if !strings.Contains(string(got), "go test -count=1 -run X ./...") {
		t.Errorf("./test did not run go test with its arguments; calls:\n%s", got)
	}
}

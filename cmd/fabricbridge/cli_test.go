package main

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// The tests run commands as main does, through execute, by these names.

func appCommand(ctx context.Context, args []string, stdout io.Writer) error {
	return execute(ctx, append([]string{"app"}, args...), stdout, os.Stderr)
}

func triggerCommand(ctx context.Context, args []string, stdout io.Writer) error {
	return execute(ctx, append([]string{"app", "trigger"}, args...), stdout, os.Stderr)
}

func statsCommand(ctx context.Context, args []string, stdout io.Writer) error {
	return execute(ctx, append([]string{"stats"}, args...), stdout, os.Stderr)
}

func captureCommand(ctx context.Context, args []string, stderr io.Writer) error {
	return execute(ctx, append([]string{"capture"}, args...), os.Stdout, stderr)
}

func checkCommand(args []string, stdout, stderr io.Writer) error {
	return execute(context.Background(), append([]string{"check"}, args...), stdout, stderr)
}

// runSelf runs the test binary as fabricbridge (see TestMain) and returns
// its standard output and error and its exit status.
func runSelf(t *testing.T, args ...string) (stdout, stderr string, status int) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var out, errs bytes.Buffer
	c := exec.Command(self, args...)
	c.Env = append(os.Environ(), "FB_TEST_MAIN=1")
	c.Stdout, c.Stderr = &out, &errs
	if err := c.Run(); err != nil && c.ProcessState == nil {
		t.Fatal(err)
	}
	return out.String(), errs.String(), c.ProcessState.ExitCode()
}

// commandTree is the command tree with the help and completion commands
// cobra adds when it runs.
func commandTree() *cobra.Command {
	root := newRootCommand(func(*cobra.Command) {})
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	return root
}

// commandPaths are the command lines of every command of the tree but
// cobra's hidden ones, root first.
func commandPaths(c *cobra.Command) [][]string {
	paths := [][]string{strings.Fields(c.CommandPath())[1:]}
	for _, sub := range c.Commands() {
		if !sub.Hidden {
			paths = append(paths, commandPaths(sub)...)
		}
	}
	return paths
}

// TestHelp: --help, -h and `help` on every command print its description,
// its usage and its flags on standard output and exit 0, as the process
// does.
func TestHelp(t *testing.T) {
	root := commandTree()
	paths := commandPaths(root)
	if len(paths) < 16 {
		t.Fatalf("only %d commands in the tree: %v", len(paths), paths)
	}
	for _, path := range paths {
		c, _, err := root.Find(path)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(strings.Join(append([]string{"fabricbridge"}, path...), " "), func(t *testing.T) {
			// The help text has one source, the command: each says what
			// it does and what its flags are.
			if c.Short == "" || (c.Long == "" && c.Parent() == root) {
				t.Errorf("no Short or no Long description")
			}
			c.LocalFlags().VisitAll(func(f *pflag.Flag) {
				if f.Usage == "" {
					t.Errorf("--%s has no usage", f.Name)
				}
			})
			for _, args := range [][]string{append(path, "--help"), append(path, "-h"), append([]string{"help"}, path...)} {
				stdout, stderr, status := runSelf(t, args...)
				if status != 0 || stderr != "" {
					t.Errorf("%v: exit status %d, stderr %q", args, status, stderr)
				}
				if !strings.Contains(stdout, "Usage:\n  "+c.CommandPath()) {
					t.Errorf("%v: no usage line in\n%s", args, stdout)
				}
				want := strings.TrimSpace(c.Long)
				if want == "" {
					want = c.Short
				}
				if !strings.HasPrefix(stdout, want) {
					t.Errorf("%v: the help does not start with the description:\n%s", args, stdout)
				}
			}
		})
	}
	// The list of commands names each with a complete line.
	stdout, _, _ := runSelf(t, "--help")
	for _, c := range root.Commands() {
		if c.IsAvailableCommand() && !regexp.MustCompile(`(?m)^  `+c.Name()+` +`+regexp.QuoteMeta(c.Short)+`$`).MatchString(stdout) {
			t.Errorf("the command list lacks %s: %s:\n%s", c.Name(), c.Short, stdout)
		}
	}
}

// TestCommandLineErrors: no command or an unknown one is exit status 2
// with a hint on standard error, a bad flag or argument is 1, and flags
// keep the single dash the Go flag package took.
func TestCommandLineErrors(t *testing.T) {
	for _, tc := range []struct {
		args   []string
		status int
		stderr string
	}{
		{nil, 2, "fabricbridge: no command given"},
		{[]string{"stat"}, 2, `fabricbridge: unknown command "stat" (did you mean stats?); fabricbridge --help lists the commands`},
		{[]string{"check", "--config"}, 1, "fabricbridge: fabricbridge check: flag needs an argument: --config (fabricbridge check --help)"},
		{[]string{"check", "--bogus"}, 1, "fabricbridge: fabricbridge check: unknown flag: --bogus (fabricbridge check --help)"},
		{[]string{"check", "-config", "/nonexistent/fb.yaml"}, 1, "fabricbridge: check: "},
		{[]string{"check", "-config=/nonexistent/fb.yaml"}, 1, "/nonexistent/fb.yaml"},
		{[]string{"check", "-help"}, 0, ""},
		{[]string{"app", "ftp"}, 1, `fabricbridge: app: unknown application "ftp"`},
	} {
		_, stderr, status := runSelf(t, tc.args...)
		if status != tc.status || !strings.Contains(stderr, tc.stderr) || (tc.stderr == "") != (stderr == "") {
			t.Errorf("%v: exit status %d, stderr %q; want %d, %q", tc.args, status, stderr, tc.status, tc.stderr)
		}
	}
}

// TestVersion: the version, commit, Go and gVisor versions, from the build
// information of this binary and from go.mod.
func TestVersion(t *testing.T) {
	var out bytes.Buffer
	if err := execute(context.Background(), []string{"version"}, &out, io.Discard); err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", out.String())
	gomod, err := os.ReadFile("../../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	gvisor := regexp.MustCompile(`(?m)^\s*` + regexp.QuoteMeta(gvisorModule) + ` (\S+)`).FindSubmatch(gomod)
	if gvisor == nil {
		t.Fatal("go.mod requires no gVisor")
	}
	commit := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				commit = s.Value
			}
		}
	}
	for _, want := range []string{
		`^fabricbridge \S+\n`,
		`\ncommit  ` + regexp.QuoteMeta(commit) + `( \(modified\))?\n`,
		`\ngo      ` + regexp.QuoteMeta(runtime.Version()+" "+runtime.GOOS+"/"+runtime.GOARCH) + `\n`,
		`\ngvisor  ` + regexp.QuoteMeta(string(gvisor[1])) + `\n$`,
	} {
		if !regexp.MustCompile(want).MatchString(out.String()) {
			t.Errorf("version output does not match %q:\n%s", want, out.String())
		}
	}

	defer func(v string) { version = v }(version)
	version = "v1.2.3"
	out.Reset()
	execute(context.Background(), []string{"version"}, &out, io.Discard)
	if !strings.HasPrefix(out.String(), "fabricbridge v1.2.3\n") {
		t.Errorf("with main.version set:\n%s", out.String())
	}
}

// TestVersionOfBuild builds fabricbridge as CI and a release would:
// without version control information, and with the version given at link
// time.
func TestVersionOfBuild(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the command")
	}
	gocmd, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command")
	}
	bin := filepath.Join(t.TempDir(), "fabricbridge")
	build := exec.Command(gocmd, "build", "-buildvcs=false", "-ldflags=-X main.version=v0.9.0-test", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("%v: %v\n%s", build.Args, err, out)
	}
	out, err := exec.Command(bin, "version").Output()
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^fabricbridge v0\.9\.0-test\ncommit  unknown\ngo      go\S+ \S+\ngvisor  v\S+\n$`).Match(out) {
		t.Errorf("version of a -buildvcs=false build:\n%s", out)
	}
}

// TestCompletion: the completion scripts are there for each shell and
// parse, where the shell is installed (bash always, zsh and fish under
// FB_REQUIRE_PRIVILEGED=1 or CI).
func TestCompletion(t *testing.T) {
	for _, tc := range []struct {
		shell string
		check []string // the shell's syntax check of the file
	}{
		{"bash", []string{"bash", "-n"}},
		{"zsh", []string{"zsh", "-n"}},
		{"fish", []string{"fish", "--no-execute"}},
		{"powershell", nil},
	} {
		var out bytes.Buffer
		if err := execute(context.Background(), []string{"completion", tc.shell}, &out, io.Discard); err != nil {
			t.Fatalf("%s: %v", tc.shell, err)
		}
		if out.Len() < 1000 || !strings.Contains(out.String(), "fabricbridge") {
			t.Errorf("%s: a completion script of %d bytes:\n%s", tc.shell, out.Len(), out.String())
		}
		if tc.check == nil {
			continue
		}
		shell, err := exec.LookPath(tc.check[0])
		if err != nil {
			// ./test installs zsh and fish; a run that was meant to
			// check everything must not pass without them.
			if tc.shell == "bash" || os.Getenv("FB_REQUIRE_PRIVILEGED") == "1" || os.Getenv("CI") != "" {
				t.Errorf("no %s to check its completion script (./test installs it)", tc.shell)
			} else {
				t.Logf("no %s to check its completion script", tc.shell)
			}
			continue
		}
		file := filepath.Join(t.TempDir(), "fabricbridge."+tc.shell)
		os.WriteFile(file, out.Bytes(), 0o644)
		if msg, err := exec.Command(shell, append(tc.check[1:], file)...).CombinedOutput(); err != nil || len(msg) > 0 {
			t.Errorf("%s %v: %v\n%s", shell, tc.check[1:], err, msg)
		}
	}

	// What bash completes: the commands, and the flags of one.
	bash, err := exec.LookPath("bash")
	if err != nil {
		return
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ line, want string }{
		{"fabricbridge st", "stats"},
		{"fabricbridge capture --str", "--stream"},
		{"fabricbridge app ", "trigger"},
	} {
		// The script asks the command itself (fabricbridge __complete),
		// here the test binary.
		// _get_comp_words_by_ref stands in for the bash-completion
		// package's.
		script := `_get_comp_words_by_ref() { cur=${COMP_WORDS[COMP_CWORD]}; prev=${COMP_WORDS[COMP_CWORD-1]}; words=("${COMP_WORDS[@]}"); cword=$COMP_CWORD; }
source <(fabricbridge completion bash)
COMP_LINE="$1"; COMP_WORDS=($1); [[ "$1" == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$((${#COMP_WORDS[@]}-1)); COMP_POINT=${#COMP_LINE}
__start_fabricbridge fabricbridge
printf '%s\n' "${COMPREPLY[@]}"`
		c := exec.Command(bash, "-c", "fabricbridge() { FB_TEST_MAIN=1 \"$SELF\" \"$@\"; }\n"+script, "bash", tc.line)
		c.Env = append(os.Environ(), "SELF="+self)
		out, err := c.CombinedOutput()
		if err != nil || !regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(tc.want)+`\s*$`).Match(out) {
			t.Errorf("completing %q: %v, got\n%s", tc.line, err, out)
		}
	}
}

// TestSignals: SIGTERM and Ctrl-C end `check` at once, by their default
// action, and end the context of the other commands, which clean up and
// return: stats here, waiting between scrapes.
func TestSignals(t *testing.T) {
	scraped := make(chan struct{}, 16)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case scraped <- struct{}{}:
		default:
		}
		io.WriteString(w, "fabricbridge_start_time_seconds 1\n")
	}))
	defer srv.Close()
	fifo := filepath.Join(t.TempDir(), "never.yaml")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args   []string
		sig    syscall.Signal
		killed bool
	}{
		{[]string{"check", "--config", fifo}, syscall.SIGTERM, true},
		{[]string{"check", "--config", fifo}, syscall.SIGINT, true},
		{[]string{"stats", "--metrics", strings.TrimPrefix(srv.URL, "http://"), "--interval", "1h"}, syscall.SIGTERM, false},
		{[]string{"stats", "--metrics", strings.TrimPrefix(srv.URL, "http://"), "--interval", "1h"}, syscall.SIGINT, false},
	} {
		c := exec.Command(self, tc.args...)
		c.Env = append(os.Environ(), "FB_TEST_MAIN=1")
		out := &testenv.Output{}
		c.Stdout, c.Stderr = out, out
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- c.Wait() }()
		// Signal it once it waits: check blocks reading its configuration,
		// stats once it scrapes (a signal during the scrape stops it too).
		if tc.args[0] == "check" {
			defer awaitReader(t, fifo).Close()
		} else {
			select {
			case <-scraped:
			case <-time.After(20 * time.Second):
				t.Fatalf("%v did not scrape within 20s", tc.args)
			}
		}
		c.Process.Signal(tc.sig)
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			c.Process.Kill()
			<-done
			t.Fatalf("%v still running 5s after %v", tc.args, tc.sig)
		}
		ws := c.ProcessState.Sys().(syscall.WaitStatus)
		if tc.killed && !(ws.Signaled() && ws.Signal() == tc.sig) {
			t.Errorf("%v ended with %v, want to die of %v\n%s", tc.args, c.ProcessState, tc.sig, out.String())
		}
		if !tc.killed && (ws.Signaled() || ws.ExitStatus() != 0) {
			t.Errorf("%v ended with %v, want exit status 0\n%s", tc.args, c.ProcessState, out.String())
		}
	}
}

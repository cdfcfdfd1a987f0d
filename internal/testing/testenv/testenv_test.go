package testenv

import (
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

const allCaps = 1<<capNetAdmin | 1<<capSysAdmin | 1<<capBPF

func TestDecide(t *testing.T) {
	for _, tc := range []struct {
		name    string
		p       privileges
		env     string
		want    verdict
		mention []string
	}{
		{"root with caps", privileges{euid: 0, effective: allCaps}, "", run, nil},
		{"root with caps, required", privileges{euid: 0, effective: allCaps}, "1", run, nil},
		{"sys_admin stands in for bpf", privileges{euid: 0, effective: 1<<capNetAdmin | 1<<capSysAdmin}, "", run, nil},
		{"user", privileges{euid: 1000}, "", skip,
			[]string{"root (euid is 1000)", "CAP_NET_ADMIN", "CAP_SYS_ADMIN", "CAP_BPF", RequireEnv}},
		{"user, required", privileges{euid: 1000}, "1", fail, []string{"root (euid is 1000)", RequireEnv + "=1"}},
		{"user, env not exactly 1", privileges{euid: 1000}, "true", skip, []string{"root"}},
		{"user, env 0", privileges{euid: 1000}, "0", skip, []string{"root"}},
		{"root without net_admin", privileges{euid: 0, effective: 1<<capSysAdmin | 1<<capBPF}, "", skip, []string{"CAP_NET_ADMIN"}},
		{"root with only bpf", privileges{euid: 0, effective: 1<<capNetAdmin | 1<<capBPF}, "1", fail, []string{"CAP_SYS_ADMIN"}},
		{"root, caps unreadable", privileges{euid: 0, capsErr: errors.New("ENOSYS")}, "", run, nil},
		{"user, caps unreadable", privileges{euid: 7, capsErr: errors.New("ENOSYS")}, "", skip, []string{"euid is 7"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, msg := decide(tc.p, tc.env)
			if got != tc.want {
				t.Fatalf("decide(%+v, %q) = %v, %q; want %v", tc.p, tc.env, got, msg, tc.want)
			}
			if got == run && msg != "" {
				t.Errorf("run verdict with message %q", msg)
			}
			for _, m := range tc.mention {
				if !strings.Contains(msg, m) {
					t.Errorf("message %q does not mention %q", msg, m)
				}
			}
			if got != run && strings.Contains(msg, "CAP_BPF") && tc.p.effective&(1<<capBPF) != 0 {
				t.Errorf("message %q names CAP_BPF although it is present", msg)
			}
		})
	}
}

// recorder stands in for testing.TB to observe which of Skip and Fatal
// require calls. Unlike the real ones, these return, so require's own return
// value is visible too.
type recorder struct {
	testing.TB
	skipped, fatal []any
}

func (r *recorder) Helper()           {}
func (r *recorder) Skip(args ...any)  { r.skipped = append(r.skipped, args...) }
func (r *recorder) Fatal(args ...any) { r.fatal = append(r.fatal, args...) }

func TestRequire(t *testing.T) {
	user := privileges{euid: 1000}
	root := privileges{euid: 0, effective: allCaps}

	r := &recorder{}
	if require(r, user, "") || len(r.skipped) != 1 || len(r.fatal) != 0 {
		t.Errorf("user, no env: skipped=%v fatal=%v", r.skipped, r.fatal)
	}
	r = &recorder{}
	if require(r, user, "1") || len(r.skipped) != 0 || len(r.fatal) != 1 {
		t.Errorf("user, env=1: skipped=%v fatal=%v", r.skipped, r.fatal)
	}
	r = &recorder{}
	if !require(r, root, "1") || len(r.skipped)+len(r.fatal) != 0 {
		t.Errorf("root: skipped=%v fatal=%v", r.skipped, r.fatal)
	}
}

// TestRequirePrivileged runs the real probe. As root it must let the test
// through and leave RLIMIT_MEMLOCK lifted as far as allowed; as a user it
// skips, which is also a correct outcome.
func TestRequirePrivileged(t *testing.T) {
	if p := current(); p.euid != os.Geteuid() {
		t.Fatalf("current().euid = %d, want %d", p.euid, os.Geteuid())
	}
	RequirePrivileged(t)
	if v, msg := decide(current(), ""); v != run {
		t.Fatalf("RequirePrivileged let the test run but decide says %v: %s", v, msg)
	}
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_MEMLOCK, &lim); err != nil {
		t.Fatal(err)
	}
	// Without CAP_SYS_RESOURCE the hard limit stays; the soft one must reach it.
	if lim.Cur != lim.Max {
		t.Errorf("RLIMIT_MEMLOCK soft %d, hard %d after RequirePrivileged; want soft raised to hard", lim.Cur, lim.Max)
	}
	const capSysResource = 24
	if current().effective&(1<<capSysResource) != 0 && lim.Cur != unix.RLIM_INFINITY {
		t.Errorf("RLIMIT_MEMLOCK = %d with CAP_SYS_RESOURCE, want infinity", lim.Cur)
	}
}

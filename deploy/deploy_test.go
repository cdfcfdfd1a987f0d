package deploy

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/fabricbridge/fabricbridge/appliance/config"
	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
)

// What README.md ("Containers") says the container needs, whatever else
// the systemd unit grants.
var (
	neededCaps = []string{"NET_ADMIN", "BPF", "NET_RAW", "SYS_NICE"}
	neededDirs = []string{"/sys/fs/bpf"}
)

// unitCaps are the capabilities configs/fabricbridge.service grants the
// daemon, without the CAP_ prefix.
func unitCaps(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../configs/fabricbridge.service")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapabilityBoundingSet="); ok {
			var caps []string
			for _, c := range strings.Fields(v) {
				caps = append(caps, strings.TrimPrefix(c, "CAP_"))
			}
			slices.Sort(caps)
			return caps
		}
	}
	t.Fatal("configs/fabricbridge.service has no CapabilityBoundingSet")
	return nil
}

type k8sObject struct {
	Kind     string
	Metadata struct{ Name, Namespace string }
	Data     map[string]string
	Spec     struct {
		Template struct {
			Spec struct {
				HostNetwork bool `yaml:"hostNetwork"`
				Containers  []struct {
					Name            string
					Image           string
					Args            []string
					SecurityContext struct {
						Privileged   *bool
						Capabilities struct{ Add, Drop []string }
					} `yaml:"securityContext"`
					LivenessProbe  probe `yaml:"livenessProbe"`
					ReadinessProbe probe `yaml:"readinessProbe"`
					VolumeMounts   []struct {
						Name      string
						MountPath string `yaml:"mountPath"`
					} `yaml:"volumeMounts"`
				}
				Volumes []struct {
					Name      string
					HostPath  *struct{ Path string } `yaml:"hostPath"`
					ConfigMap *struct{ Name string } `yaml:"configMap"`
				}
			}
		}
	}
}

type probe struct {
	HTTPGet struct {
		Host, Path string
		Port       int
	} `yaml:"httpGet"`
}

// TestDaemonSet parses the example DaemonSet and holds it to the daemon's
// needs: the host's network, the capabilities the systemd unit grants
// (README's four among them) and no privileged mode, bpffs and the
// runtime directory from the host, a configuration that `fabricbridge
// check` accepts, and probes on the address that configuration serves.
func TestDaemonSet(t *testing.T) {
	f, err := os.Open("kubernetes/daemonset.yaml")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	byKind := map[string]k8sObject{}
	dec := yaml.NewDecoder(f)
	dec.KnownFields(false)
	for {
		var o k8sObject
		if err := dec.Decode(&o); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		byKind[o.Kind] = o
	}
	ds, ok := byKind["DaemonSet"]
	if !ok || len(ds.Spec.Template.Spec.Containers) != 1 {
		t.Fatalf("no DaemonSet with one container: %+v", byKind)
	}
	pod := ds.Spec.Template.Spec
	c := pod.Containers[0]
	if !pod.HostNetwork {
		t.Error("hostNetwork is not true: XDP must attach to the node's interface")
	}
	sc := c.SecurityContext
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("privileged: the capabilities are enough")
	}
	add := slices.Sorted(slices.Values(sc.Capabilities.Add))
	if want := unitCaps(t); !slices.Equal(add, want) {
		t.Errorf("capabilities %v, want the systemd unit's %v", add, want)
	}
	for _, need := range neededCaps {
		if !slices.Contains(add, need) {
			t.Errorf("capability %s missing", need)
		}
	}
	if !slices.Equal(sc.Capabilities.Drop, []string{"ALL"}) {
		t.Errorf("drops %v, want ALL", sc.Capabilities.Drop)
	}

	// Each mount and where its volume comes from.
	from := map[string]string{}
	for _, m := range c.VolumeMounts {
		for _, v := range pod.Volumes {
			switch {
			case v.Name != m.Name:
			case v.HostPath != nil:
				from[m.MountPath] = "host:" + v.HostPath.Path
			case v.ConfigMap != nil:
				from[m.MountPath] = "configmap:" + v.ConfigMap.Name
			}
		}
	}
	for _, dir := range neededDirs {
		if from[dir] != "host:"+dir {
			t.Errorf("%s is not the host's %s: %q", dir, dir, from[dir])
		}
	}

	// The configuration: where the container reads it, that it passes
	// check, and that the sockets and the probes agree with it.
	cm, ok := byKind["ConfigMap"]
	if !ok || cm.Data["fabricbridge.yaml"] == "" {
		t.Fatal("no ConfigMap with fabricbridge.yaml")
	}
	i := slices.Index(c.Args, "--config")
	if len(c.Args) == 0 || c.Args[0] != "run" || i < 0 || i+1 == len(c.Args) {
		t.Fatalf("args %q: want run --config FILE", c.Args)
	}
	if dir := filepath.Dir(c.Args[i+1]); from[dir] != "configmap:"+cm.Metadata.Name {
		t.Errorf("--config %s is not in the ConfigMap's mount: %q", c.Args[i+1], from[dir])
	}
	path := filepath.Join(t.TempDir(), "fabricbridge.yaml")
	if err := os.WriteFile(path, []byte(cm.Data["fabricbridge.yaml"]), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(path)
	if err != nil {
		t.Fatalf("the ConfigMap's configuration: %v", err)
	}
	if run := filepath.Dir(cfg.Control.Socket); from[run] != "host:"+run {
		t.Errorf("the control socket's directory %s is not the host's: %q (applications on the node open it)", run, from[run])
	}
	host, port, err := net.SplitHostPort(string(cfg.Metrics.Address))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []struct {
		name, path string
		probe
	}{{"liveness", "/healthz", c.LivenessProbe}, {"readiness", "/readyz", c.ReadinessProbe}} {
		g := p.HTTPGet
		if g.Path != p.path || g.Host != host || port != strconv.Itoa(g.Port) {
			t.Errorf("%s probe %+v, want %s on the metrics address %s", p.name, g, p.path, cfg.Metrics.Address)
		}
	}
}

// buildah runs buildah on storage of the test's own (vfs, which needs no
// overlay support and leaves no mounts), with chroot isolation (no OCI
// runtime, works as root in a VM).
type buildah struct {
	t       *testing.T
	storage []string
}

func (b buildah) run(ctx context.Context, args ...string) string {
	b.t.Helper()
	cmd := exec.CommandContext(ctx, "buildah", append(slices.Clone(b.storage), args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		b.t.Fatalf("buildah %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	return out.String()
}

// TestImage builds deploy/Containerfile around a static binary, the way
// README.md says, checks that the image holds nothing else, and runs
// `fabricbridge check` on its configuration inside it: with buildah, and
// with podman where podman can run.
func TestImage(t *testing.T) {
	testenv.RequirePrivileged(t)
	if _, err := exec.LookPath("buildah"); err != nil {
		if os.Getenv(testenv.RequireEnv) == "1" {
			t.Fatal("buildah is not installed: apt-get install buildah (.ci/run does)")
		}
		t.Skip("buildah is not installed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// Not t.TempDir: buildah's storage can still be settling when the test
	// ends (its unlinks race the removal, "directory not empty"); removed
	// here with retries, and only logged if it cannot be.
	dir, err := os.MkdirTemp("", "fbimage")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var err error
		for range 20 {
			if err = os.RemoveAll(dir); err == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("could not remove %s: %v", dir, err)
	})
	build := filepath.Join(dir, "context")
	if err := os.MkdirAll(filepath.Join(build, "configs"), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg, err := os.ReadFile("../configs/fabricbridge.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(build, "configs", "fabricbridge.yaml"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(build, "fabricbridge")
	// The nogpu tag leaves out the GPU consumer, whose run-time loading of
	// libcuda (purego) would make the binary dynamically linked.
	gb := exec.CommandContext(ctx, "go", "build", "-tags", "nogpu", "-o", bin, "../cmd/fabricbridge")
	gb.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := gb.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	if f, err := elf.Open(bin); err != nil {
		t.Fatal(err)
	} else {
		libs, _ := f.ImportedLibraries()
		if f.Section(".interp") != nil || len(libs) > 0 {
			t.Fatalf("the binary is not static: interpreter %v, libraries %v", f.Section(".interp") != nil, libs)
		}
		f.Close()
	}

	b := buildah{t: t, storage: []string{"--root", filepath.Join(dir, "root"), "--runroot", filepath.Join(dir, "runroot"), "--storage-driver", "vfs"}}
	const image = "localhost/fabricbridge:test"
	start := time.Now()
	b.run(ctx, "build", "--isolation", "chroot", "--pull-never", "-f", "Containerfile", "-t", image, build)
	t.Logf("buildah build: %v", time.Since(start).Round(time.Millisecond))

	ctr := strings.TrimSpace(b.run(ctx, "from", "--pull-never", image))
	defer b.run(context.Background(), "rm", ctr)
	// FROM scratch: the binary and the configuration, nothing else.
	root := strings.TrimSpace(b.run(ctx, "mount", ctr))
	var files []string
	filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			files = append(files, strings.TrimPrefix(p, root))
		}
		return err
	})
	b.run(ctx, "umount", ctr)
	if want := []string{"/etc/fabricbridge/fabricbridge.yaml", "/usr/bin/fabricbridge"}; !slices.Equal(files, want) {
		t.Errorf("the image holds %q, want %q", files, want)
	}
	check := []string{"/usr/bin/fabricbridge", "check", "--config", "/etc/fabricbridge/fabricbridge.yaml"}
	want := "/etc/fabricbridge/fabricbridge.yaml: ok:"
	if out := b.run(ctx, append([]string{"run", "--isolation", "chroot", ctr, "--"}, check...)...); !strings.HasPrefix(out, want) {
		t.Errorf("check in the image (buildah run): %q, want %q...", out, want)
	}

	t.Run("podman", func(t *testing.T) {
		if _, err := exec.LookPath("podman"); err != nil {
			t.Skip("podman is not installed; the image was run with buildah only")
		}
		podman := append(slices.Clone(b.storage), "--cgroup-manager", "cgroupfs", "--events-backend", "none")
		if out, err := exec.CommandContext(ctx, "podman", append(podman, "info")...).CombinedOutput(); err != nil {
			t.Skipf("podman cannot run on this machine; the image was run with buildah only: %v\n%s", err, out)
		}
		// The entrypoint is the binary: podman's arguments are its.
		args := append(podman, "run", "--rm", "--network", "none", "--pull", "never", image)
		out, err := exec.CommandContext(ctx, "podman", append(args, check[1:]...)...).CombinedOutput()
		// 125 and 126 are podman's and the OCI runtime's own failures, before
		// the binary runs (here, a VM that denies root CAP_SYS_RESOURCE makes
		// crun's setrlimit fail).
		var exit *exec.ExitError
		if errors.As(err, &exit) && (exit.ExitCode() == 125 || exit.ExitCode() == 126) && strings.Contains(string(out), "OCI") {
			t.Skipf("podman cannot start containers on this machine; the image was run with buildah only: %v\n%s", err, out)
		}
		if err != nil || !strings.HasPrefix(string(out), want) {
			t.Errorf("check in the image (podman run): %v\n%s", err, out)
		}
	})
}

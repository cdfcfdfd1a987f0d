package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/spf13/cobra"
)

// version is what `fabricbridge version` reports, set at link time with
//
//	go build -ldflags "-X main.version=v1.2.3" ./cmd/fabricbridge
//
// Left empty, it is the main module's version in the build information:
// the tag `go install ...@v1.2.3` fetched, a pseudo-version derived from
// the checkout's VCS tags, or (devel).
var version string

// gvisorModule is the module whose netstack the user-space stacks run on;
// its version matters when a TCP problem is reported.
const gvisorModule = "gvisor.dev/gvisor"

// buildVersion is what the binary knows about its own making.
type buildVersion struct {
	Version, Commit, Go, GVisor string
}

func readBuildVersion() buildVersion {
	v := buildVersion{Version: version, Commit: "unknown", Go: runtime.Version(), GVisor: "unknown"}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		if v.Version == "" {
			v.Version = "unknown"
		}
		return v
	}
	if v.Version == "" {
		v.Version = bi.Main.Version
	}
	if v.Version == "" {
		v.Version = "(devel)"
	}
	// Builds with -buildvcs=false, CI's among them, record no revision.
	modified := false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Commit = s.Value
		case "vcs.modified":
			modified = s.Value == "true"
		}
	}
	if modified && v.Commit != "unknown" {
		v.Commit += " (modified)"
	}
	for _, m := range bi.Deps {
		if m.Path != gvisorModule {
			continue
		}
		if m.Replace != nil {
			m = m.Replace
		}
		v.GVisor = m.Version
	}
	return v
}

func (v buildVersion) print(w io.Writer) {
	fmt.Fprintf(w, "fabricbridge %s\ncommit  %s\ngo      %s %s/%s\ngvisor  %s\n",
		v.Version, v.Commit, v.Go, runtime.GOOS, runtime.GOARCH, v.GVisor)
}

func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, the commit and the Go and gVisor versions",
		Long: `Prints the version of fabricbridge, the commit it was built from ("unknown"
when it was built without version control information, -buildvcs=false), the
Go release that compiled it and the version of the gVisor netstack its
user-space stacks run on.`,
		Args: cobra.NoArgs,
		Run: func(c *cobra.Command, _ []string) {
			readBuildVersion().print(c.OutOrStdout())
		},
	}
}

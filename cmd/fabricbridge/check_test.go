package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCheckCommand(t *testing.T) {
	var out, errs bytes.Buffer
	if err := checkCommand([]string{"--config", "../../configs/fabricbridge.yaml"}, &out, &errs); err != nil {
		t.Fatalf("%v\n%s", err, errs.String())
	}
	if want := "fabricbridge.yaml: ok: 1 interface(s), 2 address(es), 1 listener(s), 4 rule(s)"; !strings.Contains(out.String(), want) {
		t.Errorf("output %q lacks %q", out.String(), want)
	}

	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("interfaces: [{name: eth1}]\naddresses: [198.18.0.1]\nrules:\n  - {id: 1, action: steer, app: x}\n  - {id: 1, action: drop}\n"), 0o644)
	out.Reset()
	err := checkCommand([]string{"-config", bad}, &out, &errs)
	if err == nil || err.Error() != "check: 2 problem(s) in "+bad {
		t.Errorf("error %v", err)
	}
	want := bad + ":4:28: rules[0].app: application \"x\" is not in applications\n" + bad + ":5:6: rules[1].id: 1 is already used by rules[0]\n"
	if errs.String() != want {
		t.Errorf("stderr:\n%s\nwant:\n%s", errs.String(), want)
	}
	if out.Len() != 0 {
		t.Errorf("stdout on failure: %q", out.String())
	}
	if err := checkCommand(nil, &out, &errs); err == nil || !strings.Contains(err.Error(), "usage") {
		t.Errorf("no --config: %v", err)
	}
}

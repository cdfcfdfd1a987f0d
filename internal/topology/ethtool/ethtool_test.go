package ethtool

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func TestDisableTxChecksum(t *testing.T) {
	testenv.RequirePrivileged(t)
	_, b, v := topology.Pair(t, topology.VethOptions{})
	if on, err := TxChecksum(b, v.B.Name); err != nil || !on {
		t.Fatalf("a new veth has tx checksum offload %v, %v; want on", on, err)
	}
	if err := DisableTxChecksum(b, v.B.Name); err != nil {
		t.Fatal(err)
	}
	if on, err := TxChecksum(b, v.B.Name); err != nil || on {
		t.Errorf("after disabling: %v, %v", on, err)
	}
	if err := DisableTxChecksum(b, "nosuchif0"); err == nil {
		t.Error("unknown interface accepted")
	}
}

package ethtool

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/internal/testing/testenv"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

func TestSetOffloads(t *testing.T) {
	testenv.RequirePrivileged(t)
	_, b, v := topology.Pair(t, topology.VethOptions{})
	for _, on := range []bool{false, true, false} {
		if err := SetOffloads(b, v.B.Name, on); err != nil {
			t.Fatal(err)
		}
		if got, err := TxChecksum(b, v.B.Name); err != nil || got != on {
			t.Fatalf("after SetOffloads(%v): tx checksum %v, %v", on, got, err)
		}
	}
}

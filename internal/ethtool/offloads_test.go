package ethtool

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/internal/netns"
	"github.com/fabricbridge/fabricbridge/internal/testenv"
)

func TestSetOffloads(t *testing.T) {
	testenv.RequirePrivileged(t)
	_, b, v := netns.Pair(t, netns.VethOptions{})
	for _, on := range []bool{false, true, false} {
		if err := SetOffloads(b, v.B.Name, on); err != nil {
			t.Fatal(err)
		}
		if got, err := TxChecksum(b, v.B.Name); err != nil || got != on {
			t.Fatalf("after SetOffloads(%v): tx checksum %v, %v", on, got, err)
		}
	}
}

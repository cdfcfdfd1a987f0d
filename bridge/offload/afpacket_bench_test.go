package offload_test

import (
	"testing"

	"github.com/fabricbridge/fabricbridge/bridge"
	"github.com/fabricbridge/fabricbridge/bridge/offload"
	"github.com/fabricbridge/fabricbridge/classifier"
	"github.com/fabricbridge/fabricbridge/fabric/ingest"
	"github.com/fabricbridge/fabricbridge/internal/topology"
)

// The package's own tests cannot import the bridge (it imports this
// package); this file, in the external test package, can, and lends
// BenchmarkIngest the AF_PACKET path.
func init() { offload.OpenAFPacketPath = openAFPacketPath }

// openAFPacketPath opens the bridge on its AF_PACKET path on ifname in br,
// with rules, and its offload engine (fed by the bridge) producing rings; close
// stops feeding, closes the bridge and the engine, and leaves the rings
// open for another producer.
func openAFPacketPath(tb testing.TB, br *topology.NS, ifname string, rules []classifier.Rule, rings map[uint32]*ingest.Ring) (close func()) {
	var b *bridge.Bridge
	if err := br.Do(func() (err error) {
		b, err = bridge.Open(bridge.Config{Interface: ifname, Path: bridge.PathAFPacket, Mode: bridge.ModeStrict})
		return err
	}); err != nil {
		tb.Fatal(err)
	}
	tables, err := classifier.Compile(&classifier.RuleSet{Rules: rules})
	if err == nil {
		err = b.SetTables(tables)
	}
	var off *bridge.Offload
	if err == nil {
		off, err = b.StartOffload(bridge.OffloadConfig{}, rings)
	}
	close = func() {
		if off != nil {
			off.Close()
		}
		b.Close()
	}
	if err != nil {
		close()
		tb.Fatal(err)
	}
	return close
}

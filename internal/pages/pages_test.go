package pages

import (
	"bytes"
	"testing"
)

// Touching changes no byte, and reaches every page, the last partial one
// included.
func TestTouchChangesNothing(t *testing.T) {
	mem := make([]byte, 3*size+100)
	for i := range mem {
		mem[i] = byte(i*7 + 1)
	}
	want := bytes.Clone(mem)
	AddZero(mem)
	MapWritable(mem) // not a shared mapping: refused or not, nothing changes
	if !bytes.Equal(mem, want) {
		t.Fatal("AddZero or MapWritable changed the memory")
	}
	zero := make([]byte, 3*size+1)
	WriteZero(zero)
	if !bytes.Equal(zero, make([]byte, len(zero))) {
		t.Fatal("WriteZero wrote something other than zeros")
	}
}

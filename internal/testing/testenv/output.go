package testenv

import (
	"bytes"
	"sync"
)

// Output collects what a child process or a goroutine writes while a test
// reads it: a bytes.Buffer safe for one writer and concurrent readers.
type Output struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (o *Output) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

// String is everything written so far.
func (o *Output) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

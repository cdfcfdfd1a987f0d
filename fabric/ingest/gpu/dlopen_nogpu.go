//go:build nogpu

package gpu

import "fmt"

// openDriver, in a binary built with the nogpu tag (the static binary of the
// container image), loads nothing: the GPU consumer is not built in.
func openDriver(name string) (*driver, error) {
	return nil, fmt.Errorf("%w: this binary was built with the nogpu tag, without the GPU consumer", ErrNoDriver)
}

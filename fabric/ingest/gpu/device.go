package gpu

// kernel names one of the module's two entry points.
type kernel int

const (
	kernelPersistent kernel = iota // fb_trigger_persistent
	kernelBatch                    // fb_trigger_batch
)

// deviceInfo describes the GPU a consumer runs on.
type deviceInfo struct {
	Name            string
	Multiprocessors int
	StageMax        int // dynamic shared memory a block may stage a buffer in
}

// device is what the host side needs of a GPU: memory, copies, launches.
// cudaDevice drives a real one; the tests' fake runs the kernels' state
// machine on the CPU over the same memory layout, so the host protocol is
// tested where there is no GPU.
type device interface {
	info() deviceInfo
	// register pins host memory and maps it for the device: the returned
	// address reaches it from kernels.
	register(mem []byte) (uint64, error)
	unregister(mem []byte) error
	alloc(n int) (uint64, error)
	free(p uint64) error
	copyIn(dst uint64, src []byte) error
	copyOut(dst []byte, src uint64) error
	// copyInAsync queues a copy from registered memory before the next
	// batch launch.
	copyInAsync(dst uint64, src []byte) error
	// launch starts k over blocks blocks with stage bytes of dynamic
	// shared memory; params holds its argument (see cudaDevice.launch).
	launch(k kernel, blocks, stage int, params []byte) error
	// wait waits for k's launches to end; for kernelBatch it returns the
	// device time of the last launch in seconds.
	wait(k kernel) (float64, error)
	// running says whether the persistent kernel has not ended.
	running() (bool, error)
	close() error
}

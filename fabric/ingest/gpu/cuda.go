package gpu

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// ErrNoDriver says that the CUDA driver library could not be loaded: no
// NVIDIA driver on this machine, or no GPU container runtime. Nothing was
// loaded.
var ErrNoDriver = errors.New("gpu: no CUDA driver (libcuda.so.1)")

// driverLibrary is what loadDriver opens; tests point it elsewhere.
var driverLibrary = "libcuda.so.1"

// cuResult is CUresult; 0 is CUDA_SUCCESS.
type cuResult int32

// Driver-API constants used here (cuda.h).
const (
	cuMemHostRegisterPortable  = 0x01
	cuMemHostRegisterDeviceMap = 0x02
	cuStreamNonBlocking        = 0x01
	cuEventDefault             = 0x00
	cuErrorNotReady            = 600

	cuDevAttrMultiprocessorCount        = 16
	cuDevAttrMaxSharedMemoryPerBlockOpt = 97
	cuFuncAttrMaxDynamicSharedSize      = 8
	cuFuncAttrSharedSizeBytes           = 1
)

// driver is the CUDA driver API, resolved from libcuda.so.1 at run time
// with purego: no cgo, no CUDA headers or libraries at build time. The
// versioned names (_v2) are the ones cuda.h maps the plain names to.
type driver struct {
	lib uintptr

	cuInit                    func(flags uint32) cuResult
	cuDeviceGet               func(dev *int32, ordinal int32) cuResult
	cuDeviceGetName           func(name *byte, n int32, dev int32) cuResult
	cuDeviceGetAttribute      func(v *int32, attr int32, dev int32) cuResult
	cuDevicePrimaryCtxRetain  func(ctx *uintptr, dev int32) cuResult
	cuDevicePrimaryCtxRelease func(dev int32) cuResult
	cuCtxSetCurrent           func(ctx uintptr) cuResult
	cuMemHostRegister         func(p unsafe.Pointer, n uintptr, flags uint32) cuResult
	cuMemHostUnregister       func(p unsafe.Pointer) cuResult
	cuMemHostGetDevicePointer func(d *uint64, p unsafe.Pointer, flags uint32) cuResult
	cuModuleLoadData          func(mod *uintptr, image unsafe.Pointer) cuResult
	cuModuleUnload            func(mod uintptr) cuResult
	cuModuleGetFunction       func(fn *uintptr, mod uintptr, name *byte) cuResult
	cuFuncSetAttribute        func(fn uintptr, attr int32, v int32) cuResult
	cuFuncGetAttribute        func(v *int32, attr int32, fn uintptr) cuResult
	cuLaunchKernel            func(fn uintptr, gx, gy, gz, bx, by, bz, smem uint32, stream uintptr, params unsafe.Pointer, extra unsafe.Pointer) cuResult
	cuStreamCreate            func(s *uintptr, flags uint32) cuResult
	cuStreamSynchronize       func(s uintptr) cuResult
	cuStreamQuery             func(s uintptr) cuResult
	cuStreamDestroy           func(s uintptr) cuResult
	cuMemAlloc                func(d *uint64, n uintptr) cuResult
	cuMemFree                 func(d uint64) cuResult
	cuMemcpyHtoD              func(dst uint64, src unsafe.Pointer, n uintptr) cuResult
	cuMemcpyHtoDAsync         func(dst uint64, src unsafe.Pointer, n uintptr, s uintptr) cuResult
	cuMemcpyDtoH              func(dst unsafe.Pointer, src uint64, n uintptr) cuResult
	cuEventCreate             func(e *uintptr, flags uint32) cuResult
	cuEventRecord             func(e uintptr, s uintptr) cuResult
	cuEventElapsedTime        func(ms *float32, start, end uintptr) cuResult
	cuEventDestroy            func(e uintptr) cuResult
	cuGetErrorString          func(r cuResult, s **byte) cuResult
}

var (
	driverOnce sync.Once
	driverVal  *driver
	driverErr  error
)

// loadDriver opens the driver library once per process and resolves every
// function, or returns ErrNoDriver and keeps nothing open.
func loadDriver() (*driver, error) {
	driverOnce.Do(func() { driverVal, driverErr = openDriver(driverLibrary) })
	return driverVal, driverErr
}

// CUDAError is a failed driver call.
type CUDAError struct {
	Call   string
	Code   int
	String string
}

func (e *CUDAError) Error() string {
	return fmt.Sprintf("gpu: %s: CUDA error %d (%s)", e.Call, e.Code, e.String)
}

func (d *driver) err(r cuResult, call string) error {
	if r == 0 {
		return nil
	}
	msg := "unknown"
	var s *byte
	if d.cuGetErrorString(r, &s) == 0 && s != nil {
		msg = cString(s)
	}
	return &CUDAError{Call: call, Code: int(r), String: msg}
}

func cString(p *byte) string {
	var b []byte
	for q := unsafe.Pointer(p); *(*byte)(q) != 0; q = unsafe.Add(q, 1) {
		b = append(b, *(*byte)(q))
	}
	return string(b)
}

// cudaDevice is one GPU's primary context with the trigger module loaded.
// Each method makes the context current on its goroutine's locked thread:
// a context is current per OS thread, and goroutines move.
type cudaDevice struct {
	d          *driver
	dev        int32
	ctx        uintptr
	mod        uintptr
	persistent uintptr
	batch      uintptr
	pstream    uintptr // the persistent kernel's stream
	bstream    uintptr // the host-driven copies and launches
	evStart    uintptr
	evEnd      uintptr
	name       string
	sms        int
	stageMax   int
	registered map[unsafe.Pointer]struct{}
}

func (c *cudaDevice) enter() func() {
	runtime.LockOSThread()
	c.d.cuCtxSetCurrent(c.ctx)
	return runtime.UnlockOSThread
}

// openCUDA retains device ordinal's primary context and loads the PTX.
func openCUDA(ordinal int, ptx []byte) (_ *cudaDevice, err error) {
	d, err := loadDriver()
	if err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c := &cudaDevice{d: d, registered: map[unsafe.Pointer]struct{}{}}
	if err := d.err(d.cuDeviceGet(&c.dev, int32(ordinal)), "cuDeviceGet"); err != nil {
		return nil, err
	}
	if err := d.err(d.cuDevicePrimaryCtxRetain(&c.ctx, c.dev), "cuDevicePrimaryCtxRetain"); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			c.close()
		}
	}()
	if err := d.err(d.cuCtxSetCurrent(c.ctx), "cuCtxSetCurrent"); err != nil {
		return nil, err
	}
	var name [256]byte
	if d.cuDeviceGetName(&name[0], int32(len(name)), c.dev) == 0 {
		c.name = cString(&name[0])
	}
	var v int32
	if err := d.err(d.cuDeviceGetAttribute(&v, cuDevAttrMultiprocessorCount, c.dev), "cuDeviceGetAttribute"); err != nil {
		return nil, err
	}
	c.sms = int(v)
	if err := d.err(d.cuDeviceGetAttribute(&v, cuDevAttrMaxSharedMemoryPerBlockOpt, c.dev), "cuDeviceGetAttribute"); err != nil {
		return nil, err
	}
	optin := int(v)
	image := append(append([]byte(nil), ptx...), 0)
	if err := d.err(d.cuModuleLoadData(&c.mod, unsafe.Pointer(&image[0])), "cuModuleLoadData"); err != nil {
		return nil, err
	}
	for _, f := range []struct {
		fn   *uintptr
		name string
	}{{&c.persistent, "fb_trigger_persistent"}, {&c.batch, "fb_trigger_batch"}} {
		n := append([]byte(f.name), 0)
		if err := d.err(d.cuModuleGetFunction(f.fn, c.mod, &n[0]), "cuModuleGetFunction "+f.name); err != nil {
			return nil, err
		}
		// What the compiled kernel declares may exceed the PTX's.
		if err := d.err(d.cuFuncGetAttribute(&v, cuFuncAttrSharedSizeBytes, *f.fn), "cuFuncGetAttribute"); err != nil {
			return nil, err
		}
		if c.stageMax == 0 || optin-int(v) < c.stageMax {
			c.stageMax = optin - int(v)
		}
	}
	// Leave room for what the driver reserves per block.
	c.stageMax = (c.stageMax - 1024) &^ 1023
	for _, fn := range []uintptr{c.persistent, c.batch} {
		if err := d.err(d.cuFuncSetAttribute(fn, cuFuncAttrMaxDynamicSharedSize, int32(c.stageMax)), "cuFuncSetAttribute"); err != nil {
			return nil, err
		}
	}
	for _, s := range []*uintptr{&c.pstream, &c.bstream} {
		if err := d.err(d.cuStreamCreate(s, cuStreamNonBlocking), "cuStreamCreate"); err != nil {
			return nil, err
		}
	}
	for _, e := range []*uintptr{&c.evStart, &c.evEnd} {
		if err := d.err(d.cuEventCreate(e, cuEventDefault), "cuEventCreate"); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func (c *cudaDevice) info() deviceInfo {
	return deviceInfo{Name: c.name, Multiprocessors: c.sms, StageMax: c.stageMax}
}

func (c *cudaDevice) register(mem []byte) (uint64, error) {
	defer c.enter()()
	p := unsafe.Pointer(&mem[0])
	if err := c.d.err(c.d.cuMemHostRegister(p, uintptr(len(mem)), cuMemHostRegisterPortable|cuMemHostRegisterDeviceMap), "cuMemHostRegister"); err != nil {
		return 0, err
	}
	c.registered[p] = struct{}{}
	var dp uint64
	if err := c.d.err(c.d.cuMemHostGetDevicePointer(&dp, p, 0), "cuMemHostGetDevicePointer"); err != nil {
		c.d.cuMemHostUnregister(p)
		delete(c.registered, p)
		return 0, err
	}
	return dp, nil
}

func (c *cudaDevice) unregister(mem []byte) error {
	defer c.enter()()
	p := unsafe.Pointer(&mem[0])
	delete(c.registered, p)
	return c.d.err(c.d.cuMemHostUnregister(p), "cuMemHostUnregister")
}

func (c *cudaDevice) alloc(n int) (uint64, error) {
	defer c.enter()()
	var p uint64
	return p, c.d.err(c.d.cuMemAlloc(&p, uintptr(n)), "cuMemAlloc")
}

func (c *cudaDevice) free(p uint64) error {
	defer c.enter()()
	return c.d.err(c.d.cuMemFree(p), "cuMemFree")
}

func (c *cudaDevice) copyIn(dst uint64, src []byte) error {
	defer c.enter()()
	return c.d.err(c.d.cuMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uintptr(len(src))), "cuMemcpyHtoD")
}

func (c *cudaDevice) copyOut(dst []byte, src uint64) error {
	defer c.enter()()
	return c.d.err(c.d.cuMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uintptr(len(dst))), "cuMemcpyDtoH")
}

// copyInAsync queues a copy from registered host memory on the batch
// stream: a DMA the launch after it waits for.
func (c *cudaDevice) copyInAsync(dst uint64, src []byte) error {
	defer c.enter()()
	return c.d.err(c.d.cuMemcpyHtoDAsync(dst, unsafe.Pointer(&src[0]), uintptr(len(src)), c.bstream), "cuMemcpyHtoDAsync")
}

// launch starts kernel k with blocks blocks. params is registered host
// memory holding the kernel's one argument (the device address of its
// fb_trigger_args) and, 8 bytes on, the array of one pointer to it that
// cuLaunchKernel reads: memory the Go collector never moves or scans.
func (c *cudaDevice) launch(k kernel, blocks, stage int, params []byte) error {
	defer c.enter()()
	fn, s := c.persistent, c.pstream
	if k == kernelBatch {
		fn, s = c.batch, c.bstream
		if err := c.d.err(c.d.cuEventRecord(c.evStart, s), "cuEventRecord"); err != nil {
			return err
		}
	}
	*(*uintptr)(unsafe.Pointer(&params[8])) = uintptr(unsafe.Pointer(&params[0]))
	r := c.d.cuLaunchKernel(fn, uint32(blocks), 1, 1, threads, 1, 1, uint32(stage), s, unsafe.Pointer(&params[8]), nil)
	if err := c.d.err(r, "cuLaunchKernel"); err != nil {
		return err
	}
	if k == kernelBatch {
		return c.d.err(c.d.cuEventRecord(c.evEnd, s), "cuEventRecord")
	}
	return nil
}

// wait waits for kernel k's stream; for the batch stream it also returns
// the time between the events around the last launch.
func (c *cudaDevice) wait(k kernel) (float64, error) {
	defer c.enter()()
	if k == kernelPersistent {
		return 0, c.d.err(c.d.cuStreamSynchronize(c.pstream), "cuStreamSynchronize")
	}
	if err := c.d.err(c.d.cuStreamSynchronize(c.bstream), "cuStreamSynchronize"); err != nil {
		return 0, err
	}
	var ms float32
	err := c.d.err(c.d.cuEventElapsedTime(&ms, c.evStart, c.evEnd), "cuEventElapsedTime")
	return float64(ms) / 1e3, err
}

// running says whether the persistent kernel is still running.
func (c *cudaDevice) running() (bool, error) {
	defer c.enter()()
	switch r := c.d.cuStreamQuery(c.pstream); r {
	case 0:
		return false, nil
	case cuErrorNotReady:
		return true, nil
	default:
		return false, c.d.err(r, "cuStreamQuery")
	}
}

func (c *cudaDevice) close() error {
	defer c.enter()()
	var errs []error
	for p := range c.registered {
		errs = append(errs, c.d.err(c.d.cuMemHostUnregister(p), "cuMemHostUnregister"))
	}
	clear(c.registered)
	for _, e := range []uintptr{c.evStart, c.evEnd} {
		if e != 0 {
			c.d.cuEventDestroy(e)
		}
	}
	for _, s := range []uintptr{c.pstream, c.bstream} {
		if s != 0 {
			c.d.cuStreamDestroy(s)
		}
	}
	if c.mod != 0 {
		errs = append(errs, c.d.err(c.d.cuModuleUnload(c.mod), "cuModuleUnload"))
	}
	if c.ctx != 0 {
		errs = append(errs, c.d.err(c.d.cuDevicePrimaryCtxRelease(c.dev), "cuDevicePrimaryCtxRelease"))
	}
	c.ctx = 0
	return errors.Join(errs...)
}

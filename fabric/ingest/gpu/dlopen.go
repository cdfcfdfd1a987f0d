//go:build !nogpu

package gpu

import (
	"fmt"

	"github.com/ebitengine/purego"
)

// openDriver opens the driver library and resolves every function the
// package calls, or returns ErrNoDriver and keeps nothing open. purego makes
// a binary that imports it dynamically linked (it needs the C library's
// dlopen); build with the nogpu tag for a static binary without the GPU
// consumer.
func openDriver(name string) (*driver, error) {
	lib, err := purego.Dlopen(name, purego.RTLD_NOW|purego.RTLD_LOCAL)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoDriver, err)
	}
	d := &driver{lib: lib}
	syms := []struct {
		fn   any
		name string
	}{
		{&d.cuInit, "cuInit"},
		{&d.cuDeviceGet, "cuDeviceGet"},
		{&d.cuDeviceGetName, "cuDeviceGetName"},
		{&d.cuDeviceGetAttribute, "cuDeviceGetAttribute"},
		{&d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
		{&d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"},
		{&d.cuCtxSetCurrent, "cuCtxSetCurrent"},
		{&d.cuMemHostRegister, "cuMemHostRegister_v2"},
		{&d.cuMemHostUnregister, "cuMemHostUnregister"},
		{&d.cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2"},
		{&d.cuModuleLoadData, "cuModuleLoadData"},
		{&d.cuModuleUnload, "cuModuleUnload"},
		{&d.cuModuleGetFunction, "cuModuleGetFunction"},
		{&d.cuFuncSetAttribute, "cuFuncSetAttribute"},
		{&d.cuFuncGetAttribute, "cuFuncGetAttribute"},
		{&d.cuLaunchKernel, "cuLaunchKernel"},
		{&d.cuStreamCreate, "cuStreamCreate"},
		{&d.cuStreamSynchronize, "cuStreamSynchronize"},
		{&d.cuStreamQuery, "cuStreamQuery"},
		{&d.cuStreamDestroy, "cuStreamDestroy_v2"},
		{&d.cuMemAlloc, "cuMemAlloc_v2"},
		{&d.cuMemFree, "cuMemFree_v2"},
		{&d.cuMemcpyHtoD, "cuMemcpyHtoD_v2"},
		{&d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"},
		{&d.cuMemcpyDtoH, "cuMemcpyDtoH_v2"},
		{&d.cuEventCreate, "cuEventCreate"},
		{&d.cuEventRecord, "cuEventRecord"},
		{&d.cuEventElapsedTime, "cuEventElapsedTime"},
		{&d.cuEventDestroy, "cuEventDestroy_v2"},
		{&d.cuGetErrorString, "cuGetErrorString"},
	}
	for _, s := range syms {
		p, err := purego.Dlsym(lib, s.name)
		if err != nil {
			purego.Dlclose(lib)
			return nil, fmt.Errorf("%w: %s: %v", ErrNoDriver, s.name, err)
		}
		purego.RegisterFunc(s.fn, p)
	}
	if r := d.cuInit(0); r != 0 {
		err := d.err(r, "cuInit")
		purego.Dlclose(lib)
		return nil, err
	}
	return d, nil
}

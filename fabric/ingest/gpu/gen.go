package gpu

import _ "embed"

// The kernel is CUDA C built to PTX by clang without CUDA's headers or
// libraries; the driver compiles the PTX for the GPU at load. sm_70 is the
// oldest target with ld.acquire/st.release; ptx63 for nanosleep.
//
//go:generate clang --cuda-gpu-arch=sm_70 -nocudainc -nocudalib --cuda-device-only -S -O2 -Xclang -target-feature -Xclang +ptx63 -o trigger.ptx trigger.cu

//go:embed trigger.ptx
var ptx []byte

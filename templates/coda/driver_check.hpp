// coda-cutlass: CUDA driver calls made by CUTLASS's host code, checked before any launch.
//
// Included before every other CUTLASS header of a generated kernel. CUTLASS encodes the TMA
// descriptors on the host through the driver (cuTensorMapEncodeTiled); on failure it prints to
// stderr and asserts, and -DNDEBUG (always on: see docs/DESIGN.md) compiles the assert out, so the
// kernel would launch with a garbage descriptor (an illegal instruction that kills the CUDA
// context). Here every such call goes through a wrapper that remembers the failure, and
// coda::run() returns kDriverCall instead of launching.
//
// The commonest cause was a thread with no current CUDA context: PyTorch runs backward on its
// own device threads, and c10::cuda::SetDevice() skips cudaSetDevice() when the thread's device
// index already matches, so a backward whose first CUDA work is our kernel (y.backward(dy)) found
// no context (CUDA_ERROR_INVALID_CONTEXT, 201). coda::ensure_context() binds the primary context
// first.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "cutlass/cuda_host_adapter.hpp"

namespace coda {

// The last failed driver result of this thread's host-side CUTLASS calls (0: none).
inline thread_local int driver_error = 0;

inline CUresult record_driver_result(CUresult result) {
  if (result != CUDA_SUCCESS) driver_error = static_cast<int>(result);
  return result;
}

// True when a CUDA context is current on this thread (the driver's view, shared by every copy of
// the CUDA runtime in the process: torch's and the one linked into this kernel).
inline bool context_current() {
  using GetCurrent = CUresult (*)(CUcontext*);
  static GetCurrent get = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if (__CUDACC_VER_MAJOR__ > 12)
    cudaError_t err = cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &pfn, 12000, cudaEnableDefault, &found);
#else
    cudaError_t err = cudaGetDriverEntryPoint("cuCtxGetCurrent", &pfn, cudaEnableDefault, &found);
#endif
    return (err == cudaSuccess && found == cudaDriverEntryPointSuccess) ? reinterpret_cast<GetCurrent>(pfn)
                                                                        : static_cast<GetCurrent>(nullptr);
  }();
  CUcontext ctx = nullptr;
  return get != nullptr && get(&ctx) == CUDA_SUCCESS && ctx != nullptr;
}

// Make the primary context of this thread's current device current, if no context is. False when
// that fails.
inline bool ensure_context() {
  if (context_current()) return true;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  return cudaSetDevice(device) == cudaSuccess && context_current();  // cudaSetDevice binds the primary context
}

}  // namespace coda

// Every driver call in CUTLASS's host code (TMA descriptor encoding) goes through
// record_driver_result. cuda_host_adapter.hpp is include-guarded, so this definition stays.
#undef CUTLASS_CUDA_DRIVER_WRAPPER_CALL
#define CUTLASS_CUDA_DRIVER_WRAPPER_CALL(func) \
  [](auto... args) { return ::coda::record_driver_result(cutlass::call_##func(args...)); }

// coda-cutlass: the host side shared by every generated kernel: argument checks, launch, status.
//
// Every check here runs before any launch. CUTLASS's can_implement checks shapes and strides but
// not pointer alignment, and a failed TMA descriptor encode is only an assert (compiled out with
// NDEBUG), so a misaligned pointer or a thread without a CUDA context would otherwise launch with a
// bad descriptor: the context is bound first and every encode is checked (coda/driver_check.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>
#include <cuda_runtime.h>

#include "cutlass/cutlass.h"

#include "coda/driver_check.hpp"

#define CODA_EXPORT __attribute__((visibility("default")))

namespace coda {

enum Status : int {
  kOk = 0,
  kBadShape = 1,         // M, N or K not positive
  kNullPointer = 2,      // a required pointer is null
  kMisaligned = 3,       // a TMA-accessed pointer is not 16-byte aligned
  kBadStride = 4,        // a row stride is too small or its bytes are not a multiple of 16
  kCannotImplement = 5,  // CUTLASS's can_implement refused the problem
  kWorkspace = 6,        // workspace missing or too small
  kInitialize = 7,       // Gemm::initialize failed (workspace init or smem attribute)
  kLaunch = 8,           // the kernel launch failed
  kDevice = 9,           // no current CUDA device
  kContext = 10,         // no CUDA context could be made current on this thread
  kDriverCall = 11,      // a CUDA driver call of CUTLASS's host code (TMA descriptor encode) failed
};

inline const char* status_string(int status) {
  switch (status) {
    case kOk: return "ok";
    case kBadShape: return "M, N and K must be positive";
    case kNullPointer: return "a required tensor pointer is null";
    case kMisaligned: return "a tensor accessed by TMA is not 16-byte aligned";
    case kBadStride: return "a row stride is smaller than the row or not a multiple of 16 bytes";
    case kCannotImplement: return "CUTLASS can_implement() refused the problem (shape or alignment)";
    case kWorkspace: return "the workspace is missing or too small";
    case kInitialize: return "Gemm::initialize() failed";
    case kLaunch: return "the kernel launch failed";
    case kDevice: return "could not query the current CUDA device";
    case kContext: return "no CUDA context is current on this thread and the device's primary context could not be bound";
    case kDriverCall:
      return "CUTLASS could not encode a TMA descriptor (cuTensorMapEncodeTiled failed; its arguments are printed "
             "on stderr); nothing was launched";
    default: return "unknown status";
  }
}

enum class SlotKind : int { Tile, Vector, Partials, End };

struct SlotSpec {
  SlotKind kind;
  int elem_bytes;
};

inline bool aligned16(void const* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Current device and its SM count, cached per device.
inline int current_device(int* sm_count) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return -1;
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return -1;
  if (counts[device] == 0) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return -1;
    counts[device] = count;
  }
  *sm_count = counts[device];
  return device;
}

template <class Gemm, class Launch, class MakeArgs>
int workspace_size(MakeArgs make, int M, int N, int K, int n_tensors, int n_scalars, size_t* bytes) {
  if (M <= 0 || N <= 0 || K <= 0) return kBadShape;
  std::vector<void*> tensors(n_tensors + 1, nullptr);
  std::vector<int64_t> ld(n_tensors + 1, N);
  std::vector<float> scalars(n_scalars + 1, 0.f);
  int sm_count = 0;
  int device = current_device(&sm_count);
  if (device < 0) { device = 0; sm_count = 1; }
  Launch p{nullptr, K, nullptr, K, M, N, K, tensors.data(), ld.data(), scalars.data(), 0, 1, device, sm_count};
  *bytes = Gemm::get_workspace_size(make(p));
  return kOk;
}

template <class Gemm, class Launch, class MakeArgs>
int run(MakeArgs make, Launch p, SlotSpec const* slots, void* workspace, size_t workspace_bytes,
        cudaStream_t stream) {
  if (p.M <= 0 || p.N <= 0 || p.K <= 0) return kBadShape;
  if (!p.A || !p.B) return kNullPointer;
  if (!aligned16(p.A) || !aligned16(p.B)) return kMisaligned;
  if ((p.lda * 2) % 16 != 0 || (p.ldb * 2) % 16 != 0 || p.lda < p.K) return kBadStride;
  for (int i = 0; slots[i].kind != SlotKind::End; ++i) {
    void* ptr = p.tensors[i];
    if (!ptr) return kNullPointer;
    if (slots[i].kind == SlotKind::Tile) {
      if (!aligned16(ptr)) return kMisaligned;
      if (p.ld[i] < p.N || (p.ld[i] * slots[i].elem_bytes) % 16 != 0) return kBadStride;
    } else if (slots[i].kind == SlotKind::Partials) {
      if (!aligned16(ptr)) return kMisaligned;
    }
  }
  if (!ensure_context()) return kContext;
  p.device = current_device(&p.sm_count);
  if (p.device < 0) return kDevice;

  auto args = make(p);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return kCannotImplement;
  size_t needed = Gemm::get_workspace_size(args);
  if (needed > 0 && (workspace == nullptr || workspace_bytes < needed)) return kWorkspace;
  // initialize() builds the kernel Params (TMA descriptors) and sets the smem size attribute.
  driver_error = 0;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return kInitialize;
  if (driver_error != 0) return kDriverCall;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return kLaunch;
  return kOk;
}

}  // namespace coda

// coda-cutlass: device and host helpers of map kernels (an epilogue program applied to an existing
// M x N tensor, no GEMM): vector loads and stores of 8 consecutive columns, the strided views that
// let a kernel read e.g. attention gradients laid out as (B, H, S, head_dim) as if they were
// (B * S) x (H * head_dim), warp reductions, and the launch.
//
// Work split: a warp owns one row at a time; lane l of the warp holds columns n0 .. n0 + 7 of that
// row, n0 = 256 * blockIdx.y + 8 * l, so one warp covers a 256-wide column tile. A block of 8 warps
// walks 32 rows (128 when an output is transposed with 128 x 1 block scales: one run per column).
// Row reductions are per (row, 256-wide column tile) partials, finished on the host.
#pragma once

#include <atomic>
#include <cstdint>
#include <cuda_runtime.h>

#include "cutlass/numeric_types.h"
#include "coda/fp8_scale.hpp"
#include "coda/functors.hpp"

namespace coda {
namespace map {

constexpr int kVec = 8;                   // columns per thread (one 16-byte vector of 16-bit values)
constexpr int kWarps = 8;                 // warps per block
constexpr int kRowsPerBlock = 32;         // rows per block (each warp takes every 8th row)
constexpr int kTileN = 32 * kVec;         // columns per block: one warp-wide column tile

// Element (m, n) of a view is at
//   (m / inner_m) * outer_m + (m % inner_m) * stride_m + (n / inner_n) * outer_n + (n % inner_n)
// elements from its base. A plain row-major matrix: inner_m = M, stride_m = ld, inner_n = N.
// A (B, S, H, D) tensor seen as (B*S) x (H*D): inner_m = S, inner_n = D and the strides of B, S, H.
struct View {
  int64_t outer_m, stride_m, inner_m, outer_n, inner_n;
};

// A 64-bit division is a software routine of ~100 instructions; evaluated for every row and slot it
// made the map kernels issue-bound (ncu: 76% SM throughput at 53% of DRAM bandwidth). Plain
// matrices never divide (m < inner_m), strided views divide in 32 bits where the values fit.
CUTLASS_DEVICE int64_t split_offset(int64_t i, int64_t inner, int64_t outer, int64_t stride) {
  if (i < inner) return i * stride;
  if (i <= INT32_MAX && inner <= INT32_MAX) {
    const uint32_t q = uint32_t(i) / uint32_t(inner);
    return int64_t(q) * outer + (i - int64_t(q) * inner) * stride;
  }
  return (i / inner) * outer + (i % inner) * stride;
}
CUTLASS_DEVICE int64_t row_offset(View const& v, int64_t m) {
  return split_offset(m, v.inner_m, v.outer_m, v.stride_m);
}
CUTLASS_DEVICE int64_t col_offset(View const& v, int64_t n) {
  return split_offset(n, v.inner_n, v.outer_n, 1);
}

template <class T> CUTLASS_DEVICE float to_float(T x) { return float(x); }
template <class T> CUTLASS_DEVICE T from_float(float x) { return T(x); }   // round to nearest even

// Round through T and back (a cast in the middle of a program).
template <class T> CUTLASS_DEVICE float round_to(float x) { return float(T(x)); }

// 8 consecutive elements (16-bit: one 16-byte load; fp32: two).
template <class T>
CUTLASS_DEVICE void load8(void const* base, int64_t offset, float (&out)[kVec]) {
  static_assert(sizeof(T) == 2 || sizeof(T) == 4, "tile elements are 16 or 32 bits");
  T const* p = static_cast<T const*>(base) + offset;
  if constexpr (sizeof(T) == 2) {
    uint4 raw = *reinterpret_cast<uint4 const*>(p);
    T const* e = reinterpret_cast<T const*>(&raw);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) out[i] = to_float(e[i]);
  } else {
    float4 a = reinterpret_cast<float4 const*>(p)[0];
    float4 b = reinterpret_cast<float4 const*>(p)[1];
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
  }
}

template <class T>
CUTLASS_DEVICE void store8(void* base, int64_t offset, float const (&in)[kVec]) {
  T* p = static_cast<T*>(base) + offset;
  if constexpr (sizeof(T) == 1) {                 // FP8: one 8-byte store (conversion saturates)
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) e[i] = from_float<T>(in[i]);
    *reinterpret_cast<uint2*>(p) = raw;
  } else if constexpr (sizeof(T) == 2) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) e[i] = from_float<T>(in[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(in[0], in[1], in[2], in[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(in[4], in[5], in[6], in[7]);
  }
}

// The even columns of 8 (half-width output: column i of the output from the pair 2i, 2i + 1).
template <class T>
CUTLASS_DEVICE void store_even4(void* base, int64_t offset, float const (&in)[kVec]) {
  T* p = static_cast<T*>(base) + offset;
  if constexpr (sizeof(T) == 1) {
    uint32_t raw;
    T* e = reinterpret_cast<T*>(&raw);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec / 2; ++i) e[i] = from_float<T>(in[2 * i]);
    *reinterpret_cast<uint32_t*>(p) = raw;
  } else if constexpr (sizeof(T) == 2) {
    uint2 raw;
    T* e = reinterpret_cast<T*>(&raw);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec / 2; ++i) e[i] = from_float<T>(in[2 * i]);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[2], in[4], in[6]);
  }
}

// A transposed output's staging tile: the block's Rows rows x 256 columns of FP8 codes. Each lane
// stages its 8 columns of a row (8 contiguous bytes); after the row loop thread t reads column t
// down the rows and writes them as one contiguous run of the N x M output's row t (16-byte stores;
// a last, partial block of rows byte by byte). The 16-byte row pad keeps the lanes' 8-byte stores
// aligned; the column reads of a warp fall in 8 distinct banks.
template <class T, int Rows = kRowsPerBlock>
struct TransposedTile {
  static_assert(sizeof(T) == 1, "transposed outputs are FP8 codes (cc.quantize(..., transpose=True))");
  static_assert(Rows % 16 == 0, "whole 16-byte runs per column");
  alignas(16) uint8_t tile[Rows][kTileN + 16];   // the codes' bytes (no constructor: plain shared memory)

  CUTLASS_DEVICE void stage(int row, int col, float const (&in)[kVec]) {
    alignas(8) T v[kVec];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) v[i] = from_float<T>(in[i]);     // saturating, as store8
    *reinterpret_cast<uint2*>(&tile[row][col]) = *reinterpret_cast<uint2 const*>(v);
  }

  // Column ``col`` of the tile (its first ``rows`` rows) to ``base + offset`` (elements; 16-byte
  // aligned: the host checks the leading dimension and the pointer, and m0 is a multiple of Rows).
  CUTLASS_DEVICE void write(void* base, int64_t offset, int col, int rows) const {
    uint8_t* p = static_cast<uint8_t*>(base) + offset;
    if (rows == Rows) {
      CUTLASS_PRAGMA_UNROLL
      for (int r0 = 0; r0 < Rows; r0 += 16) {
        alignas(16) uint8_t v[16];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 16; ++r) v[r] = tile[r0 + r][col];
        reinterpret_cast<uint4*>(p + r0)[0] = *reinterpret_cast<uint4 const*>(v);
      }
    } else {
      for (int r = 0; r < rows; ++r) p[r] = tile[r][col];
    }
  }
};

// 8 values as 8 FP8 codes (byte i: value i; saturating, as store8 converts).
template <class T>
CUTLASS_DEVICE uint2 pack8(float const (&in)[kVec]) {
  static_assert(sizeof(T) == 1, "FP8 codes");
  uint2 raw;
  T* e = reinterpret_cast<T*>(&raw);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kVec; ++i) e[i] = from_float<T>(in[i]);
  return raw;
}

// Four rows a, b, c, d of four bytes (byte k: column k) -> the four columns (byte r: row r).
CUTLASS_DEVICE void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d, uint32_t (&col)[4]) {
  const uint32_t ab01 = __byte_perm(a, b, 0x5140), ab23 = __byte_perm(a, b, 0x7362);   // a0 b0 a1 b1 | a2 b2 a3 b3
  const uint32_t cd01 = __byte_perm(c, d, 0x5140), cd23 = __byte_perm(c, d, 0x7362);
  col[0] = __byte_perm(ab01, cd01, 0x5410);   // a0 b0 c0 d0
  col[1] = __byte_perm(ab01, cd01, 0x7632);   // a1 b1 c1 d1
  col[2] = __byte_perm(ab23, cd23, 0x5410);
  col[3] = __byte_perm(ab23, cd23, 0x7632);
}

// A block-scaled transposed output (two-pass map kernels): a thread's codes of 16 consecutive rows
// m0 .. m0 + 15 (row j: rows[j], byte i = column n0 + i) are, transposed, 16 contiguous bytes of each
// of the rows n0 .. n0 + 7 of the N x M output (leading dimension ld, elements = bytes). One 16-byte
// store per row when all 16 rows exist (m0 a multiple of 16, ld and the base 16-byte aligned: the
// host checks), else the first ``rows`` bytes one by one (the last block's last rows).
CUTLASS_DEVICE void write_transposed16(void* base, int64_t ld, int64_t n0, int64_t m0, int rows,
                                       uint2 const (&tq)[16]) {
  if (rows <= 0) return;
  uint32_t cols[kVec][4];                 // cols[i][g]: column i, rows 4g .. 4g + 3
  CUTLASS_PRAGMA_UNROLL
  for (int g = 0; g < 4; ++g) {
    uint32_t lo[4], hi[4];
    transpose4x4(tq[4 * g].x, tq[4 * g + 1].x, tq[4 * g + 2].x, tq[4 * g + 3].x, lo);
    transpose4x4(tq[4 * g].y, tq[4 * g + 1].y, tq[4 * g + 2].y, tq[4 * g + 3].y, hi);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 4; ++i) {
      cols[i][g] = lo[i];
      cols[4 + i][g] = hi[i];
    }
  }
  uint8_t* out = static_cast<uint8_t*>(base);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kVec; ++i) {
    uint8_t* p = out + (n0 + i) * ld + m0;
    if (rows == 16) {
      *reinterpret_cast<uint4*>(p) = make_uint4(cols[i][0], cols[i][1], cols[i][2], cols[i][3]);
    } else {                              // unrolled: cols stays in registers
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 16; ++r)
        if (r < rows) p[r] = uint8_t(cols[i][r >> 2] >> (8 * (r & 3)));
    }
  }
}

// The 128 x 1 block scales of a transposed output: the block's 128 rows are one run of each of its
// 256 columns. Before the codes are computed, every thread holds the amax of its 8 columns over the
// rows its warp visited (a first pass over the rows); ``finish`` meets the 8 warps' partials in
// shared memory, thread t turns column t's amax into its scale (the same rule as the 1 x 128 runs:
// coda::quant::scales) and writes it, and every thread takes the multipliers of its own 8 columns.
// Group > 1: Group neighbouring columns (lanes) share one scale, the max of their amaxes (a Group x
// 128 block of the transpose; columns past N hold 0, which never wins).
template <class T, bool Pow2, int Group = 1>
struct ColumnScales {
  static_assert(Group >= 1 && Group <= 32 && (Group & (Group - 1)) == 0 && kTileN % Group == 0,
                "coda map kernel: a column group is a power of two of at most one warp's lanes");
  alignas(16) float part[kWarps][kTileN];
  float inv[kTileN];

  // scale: the scales' row for this block's run (length ceil(N / Group)); n_block: the block's first
  // column (a multiple of kTileN).
  CUTLASS_DEVICE void finish(float const (&amax)[kVec], int warp, int lane, float* scale, int64_t n_block,
                             int64_t N, float (&mult)[kVec]) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) part[warp][lane * kVec + i] = amax[i];
    __syncthreads();
    const int t = threadIdx.x;
    float a = 0.0f;
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < kWarps; ++w) a = coda::quant::nan_max(a, part[w][t]);
    if constexpr (Group > 1) a = coda::quant::shuffle_max(a, Group - 1);
    float s, iv;
    coda::quant::scales<T, Pow2>(a, s, iv);
    inv[t] = iv;
    if (n_block + t < N && t % Group == 0) scale[(n_block + t) / Group] = s;
    __syncthreads();
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kVec; ++i) mult[i] = inv[lane * kVec + i];
  }
};

// A staged input (map.cu.j2, two-pass kernels): the 8 columns of one row, 16 bytes, copied from global
// to shared memory with cp.async (global: 16-byte aligned, as load8 needs; the host checks).
template <class T>
CUTLASS_DEVICE void stage8(T* smem, int offset, void const* base, int64_t g_offset) {
  static_assert(sizeof(T) == 2, "staged inputs are 16-bit (lower/map.py MapGraph.staged)");
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem + offset));
  T const* g = static_cast<T const*>(base) + g_offset;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g) : "memory");
}

// Every cp.async of this thread has landed (and is visible to it).
CUTLASS_DEVICE void stage_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// One element of a per-row or per-column vector (any dtype: index vectors are read as fp32).
template <class T>
CUTLASS_DEVICE float load1(void const* base, int64_t i) {
  return float(static_cast<T const*>(base)[i]);
}

template <class F>
CUTLASS_DEVICE float warp_reduce(float x) {
  F f;
  CUTLASS_PRAGMA_UNROLL
  for (int d = 16; d > 0; d >>= 1) x = f(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
}

// ---- host side ---------------------------------------------------------------------------------

enum Status : int { kOk = 0, kBadShape = 1, kNullPointer = 2, kLaunch = 8 };

inline const char* status_string(int status) {
  switch (status) {
    case kOk: return "ok";
    case kBadShape: return "M and N must be positive and N a multiple of 8";
    case kNullPointer: return "a required tensor pointer is null";
    case kLaunch: return "the kernel launch failed";
    default: return "unknown status";
  }
}

// A block taking more than 48 KB of shared memory needs the kernel's opt-in, once per device
// (``done``: the kernel's record, one bit for each of the first 64 devices; past those, every launch).
inline bool allow_dynamic_smem(void const* kernel, int bytes, std::atomic<uint64_t>& done) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  const uint64_t bit = device < 64 ? (uint64_t(1) << device) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return true;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess) return false;
  done.fetch_or(bit, std::memory_order_relaxed);
  return true;
}

inline dim3 grid(int64_t M, int64_t N, int rows) {
  return dim3(static_cast<unsigned>((M + rows - 1) / rows),
              static_cast<unsigned>((N + kTileN - 1) / kTileN));
}

}  // namespace map
}  // namespace coda

// coda-cutlass: what FP8 GEMM kernels add to the host side: the row-stride check of 1-byte
// operands, and the layouts of the block scales the blockwise-scaled mainloop reads
// (coda_cutlass/fp8/scales.py describes the same layouts from the Python side).
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "coda/host_abi.hpp"

namespace coda::fp8 {

// A and W hold 1-byte elements: TMA needs every row stride to be a multiple of 16 bytes (the
// shared check in host_abi.hpp assumes 2-byte elements).
inline int check_operands(int64_t lda, int64_t ldb) {
  return (lda % 16 != 0 || ldb % 16 != 0) ? kBadStride : kOk;
}

// Scales of an operand with `rows` rows in blocks of GranMN rows x GranK columns, the rows
// contiguous: element (r, j) at r + j * ld (scale_a; scale_b of 1x128 W blocks). Passing the
// padded ld as `rows` keeps each K block's column a whole number of 16-byte TMA units.
template <class LayoutSF, int GranMN, int GranK>
LayoutSF mn_major_scales(int rows, int K, int ld) {
  using namespace cute;
  int const row_blocks = ceil_div(rows, GranMN);
  int const k_blocks = ceil_div(K, GranK);
  return make_layout(make_shape(make_shape(Int<GranMN>{}, row_blocks), make_shape(Int<GranK>{}, k_blocks), 1),
                     make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), ld * k_blocks));
}

// Scales in blocks of GranMN rows x GranK columns with the K blocks contiguous: element (i, j) at
// i * ld + j (scale_b of 128x128 W blocks: a row-major [N/128, K/128] tensor, rows ld apart).
template <class LayoutSF, int GranMN, int GranK>
LayoutSF k_major_scales(int rows, int K, int ld) {
  using namespace cute;
  int const row_blocks = ceil_div(rows, GranMN);
  int const k_blocks = ceil_div(K, GranK);
  return make_layout(make_shape(make_shape(Int<GranMN>{}, row_blocks), make_shape(Int<GranK>{}, k_blocks), 1),
                     make_stride(make_stride(_0{}, ld), make_stride(_0{}, _1{}), ld * row_blocks));
}

}  // namespace coda::fp8

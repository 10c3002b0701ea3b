// coda-cutlass: per-row sums over fixed-width column segments (per attention head) in one pass.
//
// For a CTA tile N wide holding K = N / W segments of width W, every thread keeps one fp32
// accumulator per (row, segment) it touches; after the tile's last epilogue subtile the lanes that
// share a row reduce with warp shuffles and one lane per row writes the tile's K partial sums to
// partials[(n_tile * K + s) * M_pad + m] (M_pad = M rounded up to the tile height), the layout the
// runtime finishes. Compile-time checks: warps do not split N (no cross-warp pass is needed) and
// the lanes that share a row cover at most 8 adjacent columns (so, with W a multiple of 8, they
// hold the same segments).
#pragma once

#include <utility>

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "coda/pairwise.hpp"
#include "coda/pointer_node.hpp"

namespace coda {

namespace detail {

// Bit b of the lane index is an "N lane bit" when stepping it moves to another column of the same
// row. Returns the mask of such bits, or -1 when a lane bit moves both row and column (unsupported).
template <class FlatThr>
CUTE_HOST_DEVICE constexpr int n_lane_bits() {
  int mask = 0;
  for (int b = 0; b < 5; ++b) {
    auto d = FlatThr{}(1 << b) - FlatThr{}(0);
    int dm = row_of(d), dn = col_of(d);
    if (dm == 0 && dn != 0) mask |= 1 << b;
    else if (dm != 0 && dn != 0) return -1;
  }
  return mask;
}

// True when no thread-index bit above the lane bits (the warp index) changes the column.
template <class FlatThr, int Threads>
CUTE_HOST_DEVICE constexpr bool warps_keep_columns() {
  for (int t = 32; t < Threads; t *= 2) {
    if (col_of(FlatThr{}(t) - FlatThr{}(0)) != 0) return false;
  }
  return true;
}

// The widest column span covered by the N lanes of one row (from lane 0).
template <class FlatThr>
CUTE_HOST_DEVICE constexpr int n_lane_span(int mask) {
  int span = 0;
  for (int b = 0; b < 5; ++b) {
    if (mask & (1 << b)) span += col_of(FlatThr{}(1 << b) - FlatThr{}(0));
  }
  return span;
}

}  // namespace detail

struct SegmentRowSumArguments {
  float* ptr = nullptr;   // partials [ceil(N / TileN) * K, M_pad]
};

template <int Width, class CtaTileShapeMNK>
struct SegmentRowSum : PointerNode<SegmentRowSumArguments> {
  using PointerNode<SegmentRowSumArguments>::PointerNode;
  static constexpr int TileM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});
  static_assert(Width % 8 == 0 && TileN % Width == 0, "segment width must be a multiple of 8 dividing the tile");
  static constexpr int K = TileN / Width;   // segments per tile

  template <class RegTensor, class GmemTensor, class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(RegTensor acc, GmemTensor out, CoordTensor tCcD, Residue residue,
                                          int lane_mask, bool writer)
        : acc(acc), out(out), tCcD(tCcD), residue(residue), lane_mask(lane_mask), writer(writer) {}
    RegTensor acc;        // (CPY, CPY_M, CPY_N, EPI_M, EPI_N), stride 0 within a segment
    GmemTensor out;       // the same shape over the partials buffer
    CoordTensor tCcD;
    Residue residue;
    int lane_mask;        // lane bits that step along N within a row
    bool writer;          // lane with all N lane bits zero

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementInput, FragmentSize> const& frg) {
      using namespace cute;
      Tensor a = acc(_, _, _, epi_m, epi_n);
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        if (elem_less(c(epi_v * FragmentSize + i), residue)) {
          a(epi_v * FragmentSize + i) += float(frg[i]);
        }
      }
      return frg;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int, bool is_last_iteration, VTensor) {
      using namespace cute;
      if (!is_last_iteration) return;
      Tensor unique = filter(acc);          // one register per (row, segment)
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size(unique); ++j) {
        float v = unique(j);
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < 5; ++b) {
          if (lane_mask & (1 << b)) v += __shfl_xor_sync(0xffffffffu, v, 1 << b);
        }
        unique(j) = v;
      }
      if (writer) {
        Tensor dst = filter(out);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size(unique); ++j) dst(j) = unique(j);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    using TiledCopy = cute::remove_cvref_t<decltype(args.tiled_copy)>;
    using EpiTileShape = decltype(shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
    using Thr = decltype(get<0>(TiledCopy::tidfrg_S(make_identity_layout(EpiTileShape{}))));
    using FlatThr = decltype(flatten(Thr{}));
    constexpr int mask = detail::n_lane_bits<FlatThr>();
    static_assert(mask >= 0, "coda segment sums: a lane index bit moves both row and column");
    static_assert(detail::n_lane_span<FlatThr>(mask) < 8,
                  "coda segment sums: the lanes of one row span more than 8 columns");
    // Warps must not split N: then every (row, segment) of the tile is reduced within one warp.
    static_assert(detail::warps_keep_columns<FlatThr, decltype(size(Thr{}))::value>(),
                  "coda segment sums: warps split the tile along N");

    auto [M, N, Kdim, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    int m_pad = (int(M) + TileM - 1) / TileM * TileM;
    float* base = params.ptr + (int64_t(n) * K) * m_pad + int64_t(m) * TileM;
    auto layout = make_layout(make_shape(Int<TileM>{}, make_shape(Int<Width>{}, Int<K>{})),
                              make_stride(_1{}, make_stride(_0{}, int64_t(m_pad))));
    Tensor gSeg = make_tensor(make_gmem_ptr(base), layout);                       // (CTA_M, CTA_N)
    Tensor tCgSeg = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        gSeg, args.epi_tile, args.tiled_copy, args.thread_idx);                  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N)
    Tensor tCrSeg = make_tensor_like<float>(tCgSeg);
    fill(tCrSeg, 0.0f);
    int lane = args.thread_idx % 32;
    // a CTA entirely past M or N (cluster padding) has no rows of the partials buffer to write
    bool in_bounds = int(m) * TileM < int(M) && int(n) * TileN < int(N);
    return ConsumerStoreCallbacks<decltype(tCrSeg), decltype(tCgSeg), decltype(args.tCcD), decltype(args.residue_tCcD)>(
        tCrSeg, tCgSeg, args.tCcD, args.residue_tCcD, mask, in_bounds && (lane & mask) == 0);
  }
};

}  // namespace coda

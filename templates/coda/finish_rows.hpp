// coda-cutlass: per-row reductions (sum / max / min over N) finished inside the GEMM kernel.
//
// CUTLASS's Sm90ColReduction (FinalReduction = false) leaves one fp32 partial per row and N-tile in
// partials[n_tile * M_pad + m]; finishing them used to take a second launch after the GEMM (about
// 9 us on an H200 at M = 8192: 2% of an out-proj GEMM). This node wraps that reduction and lets the
// last CTA to finish a row block do the final pass:
//   - after a CTA has written its partials (the wrapped reduce() ends with a barrier), every thread
//     fences, and one thread counts the CTA in with atomicInc on the row block's counter;
//   - the CTA that arrives last sums the row block's partials over all N-tiles, always in N-tile
//     order (so the result does not depend on which CTA is last: bitwise deterministic), converts
//     and writes the output. atomicInc wraps the counter back to 0 on the last arrival, so the
//     counters are zero again after every launch: no memset launch, no workspace. The runtime keeps
//     one zeroed counter buffer per device and stream (kernels on one stream never overlap).
// The partials stay in the caller's buffer, so `partial_reductions=True` callers still get them.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "coda/pointer_node.hpp"

namespace coda {

// Reduction: the wrapped Sm90ColReduction<..., FinalReduction=false> (writes partials).
// FinalFn: the scalar combine of the final pass (cutlass::plus / maximum / minimum <float>).
template <class Reduction, template <class> class FinalFn, class ElementOutput, class CtaTileShapeMNK>
struct FinishedRowReduction : Reduction, NoWorkspace {
  static constexpr int TileM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});

  struct Arguments {
    typename Reduction::Arguments reduction;   // {partials, identity, stride}
    ElementOutput* out = nullptr;              // [M] finished values
    unsigned* counters = nullptr;              // [ceil(M / TileM)], zero before and after a launch
  };
  struct Params {
    typename Reduction::Params reduction;
    ElementOutput* out = nullptr;
    unsigned* counters = nullptr;
  };
  using SharedStorage = typename Reduction::SharedStorage;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const& shape, Arguments const& args, void* workspace) {
    return {Reduction::to_underlying_arguments(shape, args.reduction, workspace), args.out, args.counters};
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& shape, Arguments const& args) {
    return Reduction::can_implement(shape, args.reduction) && args.reduction.ptr_col != nullptr &&
           args.out != nullptr && args.counters != nullptr;
  }
  // The wrapped reduction needs no workspace without FinalReduction; the counters come from the caller.
  using NoWorkspace::get_workspace_size;
  using NoWorkspace::initialize_workspace;

  CUTLASS_HOST_DEVICE FinishedRowReduction() {}
  CUTLASS_HOST_DEVICE FinishedRowReduction(Params const& params, SharedStorage const& shared)
      : Reduction(params.reduction, shared), finish(params) {}
  Params finish;

  template <class Inner>
  struct Callbacks : Inner {
    CUTLASS_DEVICE Callbacks(Inner&& inner, Params const& p, float const* partials, int m_tile, int M, int m_pad,
                             int n_tiles, int thread_idx, int threads, bool in_bounds)
        : Inner(static_cast<Inner&&>(inner)), p(p), partials(partials), m_tile(m_tile), M(M), m_pad(m_pad),
          n_tiles(n_tiles), thread_idx(thread_idx), threads(threads), in_bounds(in_bounds) {}
    Params const& p;
    float const* partials;
    int m_tile, M, m_pad, n_tiles, thread_idx, threads;
    bool in_bounds;          // false for a CTA past M or N (cluster padding): it writes no partials
    bool last = false;       // this CTA finishes the row block

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem, SyncFn const& sync_fn, int epi_m, int epi_n, bool is_last_iteration,
                               VTensor visit_results) {
      Inner::reduce(smem, sync_fn, epi_m, epi_n, is_last_iteration, visit_results);
      if (!is_last_iteration || !in_bounds) return;
      // The wrapped reduce() wrote this CTA's partials and ended with a barrier. Publish them, then
      // count the CTA in; the smem stage buffer it was handed is free again after its barrier.
      __threadfence();
      sync_fn();
      unsigned* flag = reinterpret_cast<unsigned*>(cute::raw_pointer_cast(smem.data()));
      if (thread_idx == 0) *flag = atomicInc(&p.counters[m_tile], unsigned(n_tiles - 1));
      sync_fn();
      last = *flag == unsigned(n_tiles - 1);
      sync_fn();
    }

    CUTLASS_DEVICE void end() {
      Inner::end();
      if (!last) return;
      __threadfence();   // see every other CTA's partials (published before its arrival)
      FinalFn<float> combine{};
      cutlass::NumericConverter<ElementOutput, float, cutlass::FloatRoundStyle::round_to_nearest> convert{};
      for (int r = thread_idx; r < TileM; r += threads) {
        int row = m_tile * TileM + r;
        if (row >= M) break;
        float const* col = partials + row;
        float acc = __ldcg(col);   // L2: partials written by other SMs are not in this SM's L1
#pragma unroll 8
        for (int t = 1; t < n_tiles; ++t) acc = combine(acc, __ldcg(col + int64_t(t) * m_pad));
        p.out[row] = convert(acc);
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto inner = Reduction::template get_consumer_store_callbacks<ReferenceSrc>(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    int m_tiles = (int(M) + TileM - 1) / TileM;
    int n_tiles = (int(N) + TileN - 1) / TileN;
    bool in_bounds = int(m) < m_tiles && int(n) < n_tiles;
    return Callbacks<decltype(inner)>(
        static_cast<decltype(inner)&&>(inner), finish, static_cast<float const*>(finish.reduction.ptr_col), int(m),
        int(M), m_tiles * TileM, n_tiles, int(args.thread_idx), int(cute::size(args.tiled_copy)), in_bounds);
  }
};

}  // namespace coda

// coda-cutlass: per-row partial reductions (row sums / max / min, and the per-row partials of total
// reductions) with a bounds test on columns only.
//
// CUTLASS's Sm90ColReduction (FinalReduction = false) tests each value's row and column against the
// problem before reducing it (2 ISETP per value and reduction) and, with EnableNullptr, tests the
// output pointer on every visit. Neither is needed here:
// - rows past M: no stage mixes rows (the register, shuffle and smem stages all reduce along N), and
//   a row past M stores its partial into the padded rows of the buffer, [ceil(N / TileN),
//   round_up(M, TileM)], whose values never reach a row < M (coda_cutlass/partials.py: finishing
//   reduces each row on its own and keeps rows [:M]; partial views are rows [:M]);
// - columns past N must not be reduced, but a thread's values share few distinct columns, so the
//   test is one compare per value against N alone (the row half of CUTLASS's test goes);
// - the runtime passes every reduction a buffer (can_implement refuses a null one).
// Static counts of the 8B FP8 epilogues: 5-7% fewer SASS instructions, and no spills left in the
// ping-pong down dX kernel; H100: the same bits, 0-4.5% faster (docs/RESULTS.md).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"

namespace coda {

template <template <class> class ReduceFn, class CtaTileShapeMNK, class StrideMNL, cutlass::FloatRoundStyle RoundStyle>
struct ColumnCheckedRowReduction
    : cutlass::epilogue::fusion::Sm90ColReduction<ReduceFn, ReduceFn, ReduceFn, /*Stages=*/0, CtaTileShapeMNK, float,
                                                  float, RoundStyle, StrideMNL, /*Alignment=*/4,
                                                  /*EnableNullptr=*/false, /*FinalReduction=*/false,
                                                  /*VisitCheckOOB=*/true> {
  using Base = cutlass::epilogue::fusion::Sm90ColReduction<ReduceFn, ReduceFn, ReduceFn, 0, CtaTileShapeMNK, float,
                                                           float, RoundStyle, StrideMNL, 4, false, false, true>;
  using Base::Base;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, typename Base::Arguments const& args) {
    return args.ptr_col != nullptr && Base::can_implement(problem_shape, args);
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : Base::template ConsumerStoreCallbacks<ArgsTuple> {
    using Super = typename Base::template ConsumerStoreCallbacks<ArgsTuple>;
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, typename Base::Params const& params)
        : Super(std::move(args_tuple), params) {}

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_input) {
      using namespace cute;
      auto& args = this->args_tuple;
      // Sm90ColReduction's callback tuple: 1 = tCrCol (the per-thread partials), 2 = tCcCol (their
      // coordinates), 13 = residue_tCcCol (the problem's extent in those coordinates)
      Tensor tCrCol_mn = get<1>(args)(_, _, _, epi_m, epi_n);
      Tensor tCcCol_mn = get<2>(args)(_, _, _, epi_m, epi_n);
      int const columns = get<1>(get<13>(args));
      ReduceFn<float> reduce{};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        if (get<1>(tCcCol_mn(epi_v * FragmentSize + i)) < columns) {
          float& r = tCrCol_mn(epi_v * FragmentSize + i);
          r = reduce(r, static_cast<float>(frg_input[i]));
        }
      }
      return frg_input;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto base = Base::template get_consumer_store_callbacks<ReferenceSrc>(args);
    return ConsumerStoreCallbacks<decltype(base.args_tuple)>(std::move(base.args_tuple), this->params);
  }
};

}  // namespace coda

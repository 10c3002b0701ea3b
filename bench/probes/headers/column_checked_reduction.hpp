// Probe variant (bench/probes/epilogue_outputs.py, "(column checks)"): CUTLASS's per-row partial
// reduction (Sm90ColReduction, FinalReduction = false) with a cheaper bounds test per value.
//
// CUTLASS tests each value's (row, column) against the problem before reducing it, ~2 ISETP per
// value and reduction (the FP8 down-proj dX epilogue: ~680 of its ~6100 epilogue instructions for
// three reductions). Rows past M need no test: their partials land in the rows of the padded
// partials buffer [ceil(N / TileN), round_up(M, TileM)] that the runtime slices off
// (coda_cutlass/partials.py). Columns past N must not be reduced, but a thread's values share few
// distinct columns, so one test per column serves all of a fragment's rows. The per-visit
// null-pointer test is off too (the runtime passes every reduction a buffer). Not used by the
// library until the H200 has timed and checked it.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/epilogue/fusion/sm90_visitor_store_tma_warpspecialized.hpp"

namespace coda {

template <template <class> class ReduceFn, class CtaTileShapeMNK, class StrideMNL, cutlass::FloatRoundStyle RoundStyle>
struct ColumnCheckedRowReduction
    : cutlass::epilogue::fusion::Sm90ColReduction<ReduceFn, ReduceFn, ReduceFn, 0, CtaTileShapeMNK, float, float,
                                                  RoundStyle, StrideMNL, 4, false, false, true> {
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
      Tensor tCrCol_mn = get<1>(args)(_, _, _, epi_m, epi_n);
      Tensor tCcCol_mn = get<2>(args)(_, _, _, epi_m, epi_n);
      int const columns = get<1>(get<13>(args));         // residue_tCcCol's N
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

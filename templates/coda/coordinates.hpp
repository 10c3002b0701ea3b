// coda-cutlass: a leaf visitor node that yields each element's row or column index (as fp32).
//
// Used for gathers (compare the column index with a per-row target index) and position-dependent
// math. Indices are exact in fp32 below 2^24; the runtime refuses larger M or N for programs
// that use them.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace coda {

// Axis 0: the row index m; axis 1: the column index n (of the GEMM output).
template <int Axis>
struct IndexFetch : cutlass::epilogue::fusion::Sm90VisitorImpl<> {
  using cutlass::epilogue::fusion::Sm90VisitorImpl<>::Sm90VisitorImpl;

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor tCcD, int origin) : tCcD(tCcD), origin(origin) {}
    CoordTensor tCcD;   // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) coordinates relative to the thread's origin
    int origin;         // the thread's absolute coordinate along Axis

    template <typename ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      cutlass::Array<float, FragmentSize> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        out[i] = float(origin + int(get<Axis>(c(epi_v * FragmentSize + i))));
      }
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    // residue = (M, N) - the thread's absolute origin
    int extent = Axis == 0 ? int(M) : int(N);
    int origin = extent - int(cute::get<Axis>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, origin);
  }
};

}  // namespace coda

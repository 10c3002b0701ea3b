// coda-cutlass: a store node for half-width outputs of pairwise 2 -> 1 ops (SwiGLU and friends).
//
// The input value is meaningful on the even column of each pair (2i, 2i+1); it is written to
// column i of an M x N/2 row-major tensor. Each thread stores its own results straight from
// registers (no shared memory, so no extra epilogue smem next to the mainloop's stages); the
// four threads of a quad write adjacent elements, which L2 merges into full sectors.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_conversion.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "coda/pairwise.hpp"

namespace coda {

template <class Element>
struct HalfWidthStore {
  struct SharedStorage {};
  struct Arguments {
    Element* ptr = nullptr;
    int64_t ld = 0;   // row stride of the M x N/2 output, in elements
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr != nullptr;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE HalfWidthStore() {}
  CUTLASS_HOST_DEVICE HalfWidthStore(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Element* row0, int64_t ld, int col0, CoordTensor tCcD, Residue residue)
        : row0(row0), ld(ld), col0(col0), tCcD(tCcD), residue(residue) {}
    Element* row0;      // the output row of the thread's origin
    int64_t ld;
    int col0;           // the thread's origin column in the full-width tile (even)
    CoordTensor tCcD;   // coordinates relative to the thread's origin
    Residue residue;    // (M, N) - origin: elements at or past it are out of bounds

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementInput, FragmentSize> const& frg) {
      using namespace cute;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      cutlass::NumericConverter<Element, ElementInput, cutlass::FloatRoundStyle::round_to_nearest> convert;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < FragmentSize; k += 2) {
        auto crd = c(epi_v * FragmentSize + k);
        if (elem_less(crd, residue)) {
          row0[int64_t(get<0>(crd)) * ld + (col0 + int(get<1>(crd))) / 2] = convert(frg[k]);
        }
      }
      return frg;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    detail::check_pair_layout(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    int row_origin = int(M) - int(cute::get<0>(args.residue_tCcD));
    int col_origin = int(N) - int(cute::get<1>(args.residue_tCcD));
    Element* row0 = params.ptr + int64_t(row_origin) * params.ld;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        row0, params.ld, col_origin, args.tCcD, args.residue_tCcD);
  }
};

}  // namespace coda

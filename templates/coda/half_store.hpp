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
#include "coda/pointer_node.hpp"

namespace coda {

template <class Element>
struct HalfWidthStoreArguments {
  Element* ptr = nullptr;
  int64_t ld = 0;   // row stride of the M x N/2 output, in elements
};

template <class Element>
struct HalfWidthStore : PointerNode<HalfWidthStoreArguments<Element>> {
  using Base = PointerNode<HalfWidthStoreArguments<Element>>;
  using Base::Base;
  using typename Base::Params;

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
    Element* row0 = this->params.ptr + int64_t(row_origin) * this->params.ld;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(
        row0, this->params.ld, col_origin, args.tCcD, args.residue_tCcD);
  }
};

}  // namespace coda

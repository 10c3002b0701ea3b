// coda-cutlass: visitor helpers for generated epilogues.
#pragma once

#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace coda {

// A topological visitor for kernels without a D tensor (ElementD = void). The sm90 collective
// still allocates a D staging buffer, which cross-warp reductions borrow as scratch, and sizes it
// with the element type of the callbacks' aux output; CUTLASS derives that type only for its own
// named fusions, so this wrapper states it.
template <class ElementAux_, class ElementCompute, class EdgeTuple, class... Ops>
struct TopologicalVisitorNoD
    : cutlass::epilogue::fusion::Sm90TopologicalVisitor<ElementCompute, EdgeTuple, Ops...> {
  using Base = cutlass::epilogue::fusion::Sm90TopologicalVisitor<ElementCompute, EdgeTuple, Ops...>;
  using ElementAux = ElementAux_;
  using Base::Base;
};

}  // namespace coda

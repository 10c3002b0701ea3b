// coda-cutlass: host and setup plumbing shared by visitor nodes that write straight from registers
// to a caller-provided global buffer (no shared memory, workspace or producer loads).
//
// A node derives from PointerNode<Arguments> (Arguments must hold a `ptr` member; it is also the
// node's Params) and supplies only its ConsumerStoreCallbacks and get_consumer_store_callbacks.
#pragma once

#include <cstddef>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

namespace coda {

// The host hooks of a node that needs no workspace.
struct NoWorkspace {
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
};

template <class Arguments_>
struct PointerNode : NoWorkspace {
  struct SharedStorage {};
  using Arguments = Arguments_;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) { return args.ptr != nullptr; }

  CUTLASS_HOST_DEVICE PointerNode() {}
  CUTLASS_HOST_DEVICE PointerNode(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }
};

}  // namespace coda

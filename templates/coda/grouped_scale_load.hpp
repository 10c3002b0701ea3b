// coda-cutlass: the producer's W-scale loads for blocks of 2..16 W rows (scaling "block_16x128").
//
// CUTLASS 4.2's blockwise mainloop loads scales that TMA does not with cp.async from one producer
// warp, partitioning the tile's N scale mode (GranN x ScaleNsPerTile, the GranN part stride 0)
// over the 32 lanes and keeping lanes below ScaleNsPerTile: with 16-row blocks those lanes reach
// only the even row blocks (lane i fetches element i + 32 j, row block (i + 32 j) / 16), so the odd
// ones stay unloaded. Here lane i < ScaleNsPerTile copies row block (tile n) * ScaleNsPerTile + i of
// each K block into the place CUTLASS's (and coda's) consumers read it from, and every lane
// arrives on the stage's barrier once its copy has landed, as CUTLASS's loader does. A's scales
// (one per row: TMA, in the base collective's load) are untouched.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace coda::fp8 {

template <class Base>
struct GroupedScaleLoad : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;
  using typename Base::SmemLayoutSFB;
  using typename Base::ElementBlockScale;
  static constexpr int ScaleNsPerTile = Base::ScaleNsPerTile;
  static_assert(!Base::IsTmaLoadSFB && Base::IsTmaLoadSFA && Base::ScaleGranularityN > 1 &&
                    Base::ScaleGranularityN < 32 && ScaleNsPerTile <= 32,
                "coda::fp8::GroupedScaleLoad: W scales in blocks of 2..16 rows, A scales one per row (TMA)");

  template <class TensorA, class TensorB, class TensorScaleA, class TensorScaleB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorScaleA, TensorScaleB> const&,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int thread_idx, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    auto const& sf = params.layout_SFB;     // ((GranN, row blocks), (GranK, K blocks), L)
    int const row_block = int(get<1>(blk_coord)) * ScaleNsPerTile + thread_idx;
    bool const fetch = thread_idx < ScaleNsPerTile && row_block < int(size<0, 1>(sf));
    ElementBlockScale const* src = params.ptr_SFB + int64_t(row_block) * stride<0, 1>(sf) +
                                   int64_t(get<3>(blk_coord)) * stride<2>(sf);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      if (fetch) {
        int const k_block = *k_tile_iter;        // tile_k = 128: one scale block per K tile
        auto* dst = shared_tensors.smem_SFB.data() +
                    SmemLayoutSFB{}(make_coord(make_coord(0, thread_idx), make_coord(0, 0), smem_pipe_write.index()));
        SM80_CP_ASYNC_CACHEALWAYS<ElementBlockScale>::copy(src[int64_t(k_block) * stride<1, 1>(sf)], *dst);
      }
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace coda::fp8

// coda-cutlass: the consumer loop of CUTLASS's sm90 blockwise-scaled FP8 mainloop, with each K
// block's scale-and-add hidden behind the next K block's wgmma.
//
// CUTLASS 4.2's loop (sm90_mma_tma_gmma_ss_warpspecialized_fp8_blockwise_scaling.hpp) issues a K
// block's wgmma into a partial accumulator, waits for it, then multiplies the partial sums by
// their A and W scales and adds them into the fp32 accumulators; the tensor cores idle during
// that scale-and-add. With 1 x 128 scales on both operands (the weight-gradient GEMMs) it is two
// fp32 operations per accumulator and 32 scale loads per thread every K block: measured 1.7-1.8x
// the per-tensor GEMM. Here each warp group keeps two partial accumulators: it issues block k
// into one, then scales and adds block k-1 from the other while block k runs, so the CUDA-core
// work overlaps the tensor cores'. The arithmetic is CUTLASS's, in the same order (the results
// are bit for bit those of its loop); only the schedule differs. Everything else (producer,
// shared memory, parameters, scale loads) is the base collective's.
//
// Registers: a 64 x 128 warp-group tile (cooperative 128 x 128) holds 64 accumulators and 2 x 64
// partial sums per thread, within the 232 a cooperative consumer gets. Larger per-warp-group
// tiles do not fit, so lower/mainloop.py uses this loop for cooperative 128-row tiles only.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

namespace coda::fp8 {

template <class Base>
struct OverlappedBlockScaledMma : Base {
  using typename Base::TiledMma;
  using typename Base::TileShape;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::Params;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::SmemLayoutSFA;
  using typename Base::SmemLayoutSFB;
  using typename Base::ElementBlockScale;
  static constexpr int ScaleMsPerTile = Base::ScaleMsPerTile;
  static constexpr int ScaleNsPerTile = Base::ScaleNsPerTile;
  static_assert(Base::ScalePromotionInterval == 4,
                "one scale block per 128-deep K tile (lower/mainloop.py checks tile_k = 128)");

  // A scale tensor's shared memory seen with the accumulator tile's shape, (BLK_M, BLK_N, (k, PIPE)),
  // stride 0 along the dimension its scales are constant in: partition_C then hands each thread
  // the scales of its own accumulators.
  static constexpr auto sfa_view() {
    using namespace cute;
    auto s = SmemLayoutSFA{};  // (BLK_M, k, PIPE)
    return make_layout(
        make_shape(get<0>(shape(s)), get<1>(TileShape{}), make_shape(get<1>(shape(s)), get<2>(shape(s)))),
        make_stride(get<0>(stride(s)), _0{}, make_stride(get<1>(stride(s)), get<2>(stride(s)))));
  }
  static constexpr auto sfb_view() {
    using namespace cute;
    auto s = SmemLayoutSFB{};  // (BLK_N, k, PIPE)
    return make_layout(
        make_shape(get<0>(TileShape{}), get<0>(shape(s)), make_shape(get<1>(shape(s)), get<2>(shape(s)))),
        make_stride(_0{}, get<0>(stride(s)), make_stride(get<1>(stride(s)), get<2>(stride(s)))));
  }

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx, TensorStorage& shared_tensors,
                          Params const& /*mainloop_params*/) {
    using namespace cute;
    static_assert(is_rmem<FrgTensorC>::value, "accumulators must be in registers");

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), sfa_view());
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), sfb_view());

    constexpr int WarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    int const warp_group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto wg_mma = tiled_mma.get_slice(make_layout(Int<WarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{})(warp_group));
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE) descriptors
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA, MMA_M, MMA_N, (k, PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);

    Tensor part0 = make_fragment_like(accum);
    Tensor part1 = make_fragment_like(accum);
    clear(accum);
    // Defined before any wgmma: an undefined partial sum lets the compiler merge its registers with
    // the other one's, and copying those while a wgmma writes them makes ptxas wait for it.
    clear(part0);
    clear(part1);

    // One K block's wgmma into `part`, left running.
    auto issue = [&](auto& part, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
    };

    // accum += part * scale_a * scale_b, in CUTLASS's association: a scale that is one value per
    // tile is folded into the other first (one FFMA per accumulator), else (part * sa) * sb.
    auto promote = [&](auto& part, int stage) {
      Tensor sfa = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));
      Tensor sfb = make_tensor_like<ElementBlockScale>(tCsSFB(_, _, _, _0{}));
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
      warpgroup_fence_operand(part);
      if constexpr (ScaleNsPerTile == 1) {
        ElementBlockScale const sb = sfb(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfa)); ++i) filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * sb;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * sfa(i);
      } else if constexpr (ScaleMsPerTile == 1) {
        ElementBlockScale const sa = sfa(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfb)); ++i) filter_zeros(sfb)(i) = filter_zeros(sfb)(i) * sa;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * sfb(i);
      } else if constexpr (ScaleNsPerTile < size<1>(TileShape{})) {
        // W scales shared by groups of rows (16 x 128): a thread's accumulators see a few distinct
        // (sa, sb) pairs, so one product per pair (the compiler keeps one per pair of registers)
        // and one FFMA per accumulator, as the single-scale cases above. part * (sa * sb) rounds as
        // (part * sa) * sb when the scales are powers of two (what cc.quantize writes by default).
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * (sfa(i) * sfb(i));
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * sfa(i) * sfb(i);
      }
      warpgroup_fence_operand(part);
    };

    // K block 0 starts; each step then starts block k and finishes block k-1, two steps an
    // iteration so that each partial accumulator stays one fixed set of registers.
    pipeline.consumer_wait(smem_pipe_read);
    PipelineState previous = smem_pipe_read;
    issue(part0, smem_pipe_read.index());
    ++smem_pipe_read;
    --k_tile_count;

    auto step = [&](auto& next, auto& done) {
      pipeline.consumer_wait(smem_pipe_read);
      issue(next, smem_pipe_read.index());
      warpgroup_wait<1>();                      // block k-1's wgmma is done, block k's runs on
      promote(done, previous.index());
      pipeline.consumer_release(previous);      // its scales were read: the stage can refill
      previous = smem_pipe_read;
      ++smem_pipe_read;
    };
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count >= 2; k_tile_count -= 2) {
      step(part1, part0);
      step(part0, part1);
    }
    warpgroup_fence_operand(accum);
    if (k_tile_count == 1) {
      step(part1, part0);
      warpgroup_wait<0>();
      promote(part1, previous.index());
    } else {
      warpgroup_wait<0>();
      promote(part0, previous.index());
    }
    // The last stage stays held: mma_tail releases it, as after CUTLASS's own loop.
    warpgroup_fence_operand(accum);
  }
};

}  // namespace coda::fp8

// coda-cutlass: FP8 outputs that quantise themselves inside the epilogue (cc.quantize).
//
// QuantRowStore:    codes [rows, cols] row-major with one fp32 dequantisation scale per 1 x Block run
//                   of each row, the run's amax computed from the tile (the run lies inside it);
// TransposedStore:  the transpose [cols, rows] (M contiguous: a K-major operand when K is the token
//                   dimension), either of a value already scaled (per-tensor scale, Block == 0) or
//                   quantised per Block x 1 run down each column (the tile's 128 rows). One-byte
//                   codes are staged in shared memory either way; 16-bit values go out from registers.
//
// Both buffer the values they receive in registers until a run is complete (the collective visits
// the tile in subtiles, columns outer, rows inner), then reduce |x| (NaN-propagating) with warp
// shuffles (and, down a column, across warps through shared memory), derive the scale, convert
// with round-to-nearest-even saturated to the format's largest finite value, and stage one
// subtile's codes in shared memory, laid out as the output is (rows, or the transpose's rows), so
// that they leave in 16-byte stores: one byte per thread per store, at a stride of the row length
// for the transpose, cost more than the GEMM itself (docs/RESULTS.md, ninth session). The scale semantics are coda_cutlass/quantization.py's, bit for bit:
//   Pow2:  v = amax / fp8_max, scale = v if v is a power of two else the next one up (>= 2^-126),
//          codes = x * (1 / scale) (exact);
//   else:  scale = amax / fp8_max, codes = x * (fp8_max / amax);
//   amax == 0: scale 1; amax inf or NaN: scale NaN and NaN codes.
// Scales are written "MN-major", scale[run][row] (ld = the row count): the layout CUTLASS's sm90
// blockwise-scaled mainloop reads for an operand's scales by default.
#pragma once

#include <cstdint>
#include <cmath>
#include <utility>

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "coda/fp8_scale.hpp"
#include "coda/pairwise.hpp"
#include "coda/pointer_node.hpp"
#include "coda/segments.hpp"

namespace coda {

namespace quant {

template <class TiledCopy, class EpiTileShape>
using FlatThreads = detail::FlatThreads<TiledCopy, EpiTileShape>;   // (coda/pairwise.hpp)

// Lane bits that step along M within one column (the mirror of detail::n_lane_bits).
template <class FlatThr>
CUTE_HOST_DEVICE constexpr int m_lane_bits() {
  int mask = 0;
  for (int b = 0; b < 5; ++b) {
    auto d = FlatThr{}(1 << b) - FlatThr{}(0);
    int dm = detail::row_of(d), dn = detail::col_of(d);
    if (dn == 0 && dm != 0) mask |= 1 << b;
    else if (dm != 0 && dn != 0) return -1;
  }
  return mask;
}

// Whether the kernel's fragments hold column pairs (2i, 2i+1) in adjacent registers (what
// detail::check_pair_layout requires of pairwise ops), so two codes can be converted and staged
// at a time.
template <class Args>
CUTE_HOST_DEVICE constexpr bool fragments_hold_pairs() {
  using TiledCopy = cute::remove_cvref_t<decltype(std::declval<Args>().tiled_copy)>;
  using EpiTileShape = decltype(cute::shape(cute::remove_cvref_t<decltype(std::declval<Args>().epi_tile)>{}));
  using CoordLayout = cute::remove_cvref_t<decltype(std::declval<Args>().tCcD.layout())>;
  return detail::thread_origins_even<TiledCopy, EpiTileShape>() &&
         detail::coordinate_pairs_adjacent<CoordLayout>();
}

// |x| of a thread's values (a half-width output's: those on even columns) into their amax
// registers a (views: the stores' register tensors). A tile inside the problem (inside: nearly all
// of them) skips the per-value bounds checks, which cost more instructions than the max itself.
template <bool Half, class BufT, class AmaxT, class CoordT, class Residue>
CUTLASS_DEVICE void accumulate_amax(BufT const& b, AmaxT a, CoordT const& c, Residue const& residue, bool inside) {
  using namespace cute;
  if (inside) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(b); ++i) {
      if (!Half || i % 2 == 0) a(i) = nan_max(a(i), fabsf(b(i)));
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(b); ++i) {
      if ((!Half || i % 2 == 0) && elem_less(c(i), residue)) a(i) = nan_max(a(i), fabsf(b(i)));
    }
  }
}

}  // namespace quant

// ------------------------------------------------------------------------------------------------
// Row-major codes, 1 x Block runs along N (Half: along the half-width output's columns, i.e. the
// even columns of 2 * Block tile columns).
// ------------------------------------------------------------------------------------------------
template <class Element>
struct QuantStoreArguments {
  Element* ptr = nullptr;
  int64_t ld = 0;            // row stride of the codes, in elements
  float* scale = nullptr;    // scale[run * scale_ld + row]
  int64_t scale_ld = 0;
};

template <class Element, class CtaTileShapeMNK, class EpilogueTile, int Threads, int Block, bool Half, bool Pow2>
struct QuantRowStore : NoWorkspace {
  static constexpr int TileM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});
  static constexpr int Span = Half ? 2 * Block : Block;        // tile columns of one run
  static_assert(TileN % Span == 0, "coda quantised store: the CTA tile width must be a multiple of the run "
                                   "(128 output columns: 256 tile columns for a half-width output)");
  static constexpr int Runs = TileN / Span;
  static constexpr int EpiN = cute::size<1>(EpilogueTile{});
  static constexpr int OutCols = Half ? EpiN / 2 : EpiN;        // output columns of one subtile
  static constexpr int Vec = OutCols % 16 == 0 ? 16 : 8;        // bytes per global store
  static_assert(OutCols % 8 == 0, "coda quantised store: a subtile's output columns are written in 8-byte runs");
  static constexpr int Pitch = OutCols + 16;                    // staged row: 16-byte aligned, rows in other banks

  struct SharedStorage {
    alignas(16) uint8_t codes[TileM][Pitch];
  };
  using Arguments = QuantStoreArguments<Element>;
  using Params = Arguments;
  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr != nullptr && args.scale != nullptr;
  }
  CUTLASS_HOST_DEVICE QuantRowStore() {}
  CUTLASS_HOST_DEVICE QuantRowStore(Params const& params, SharedStorage const& smem)
      : params(params), smem(const_cast<SharedStorage*>(&smem)) {}
  Params params;
  SharedStorage* smem = nullptr;
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // Pairs: the fragments hold column pairs (2i, 2i+1) in adjacent registers
  // (quant::fragments_hold_pairs), so a full-width output converts and stages two codes at a time.
  template <class Buf, class Amax, class RunOff, class CoordTensor, class Residue, int PerRun, int EpiM, bool Pairs>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Buf buf, Amax amax, RunOff run_off, CoordTensor tCcD, Residue residue,
                                          QuantStoreArguments<Element> const& p, SharedStorage* smem, int row0,
                                          int col0, int m_tile, int n_tile, int lane_mask, bool writer, int thread)
        : buf(buf), amax(amax), run_off(run_off), tCcD(tCcD), residue(residue), p(p), smem(smem), row0(row0),
          col0(col0), m_tile(m_tile), n_tile(n_tile), lane_mask(lane_mask), writer(writer), thread(thread) {}
    Buf buf;              // (CPY, CPY_M, CPY_N, EPI_M, PerRun): the values of the run being filled
    Amax amax;            // (CPY, CPY_M, CPY_N, EPI_M, EPI_N), one register per (row, run)
    RunOff run_off;       // the same shape: row + run * TileM of each element (decodes amax registers)
    CoordTensor tCcD;     // coordinates relative to the thread's origin
    Residue residue;
    QuantStoreArguments<Element> p;
    SharedStorage* smem;
    int row0, col0;       // the thread's origin in the output (rows; tile columns)
    int m_tile, n_tile;
    int lane_mask;        // lane bits that step along N within a row
    bool writer;          // the lane that writes its rows' scales
    int thread;           // index among the epilogue's threads

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementInput, FragmentSize> const& frg) {
      using namespace cute;
      Tensor b = buf(_, _, _, epi_m, epi_n % PerRun);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) b(epi_v * FragmentSize + i) = float(frg[i]);
      return frg;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& synchronize, int epi_m, int epi_n, bool, VTensor) {
      using namespace cute;
      if (epi_m != EpiM - 1 || (epi_n + 1) % PerRun != 0) return;   // the run is not complete yet
      int const run = epi_n / PerRun;
      int const M = int(get<0>(residue)) + row0;
      int const N = int(get<1>(residue)) + col0;
      // 1. |x| into the (row, run) registers: per thread (no bounds checks inside the problem),
      // then across the lanes of a row
      bool const inside = (m_tile + 1) * TileM <= M && (n_tile + 1) * TileN <= N;
      CUTLASS_PRAGMA_UNROLL
      for (int em = 0; em < EpiM; ++em) {
        CUTLASS_PRAGMA_UNROLL
        for (int en = 0; en < PerRun; ++en) {
          Tensor b = buf(_, _, _, em, en);
          Tensor a = amax(_, _, _, em, run * PerRun + en);
          Tensor c = tCcD(_, _, _, em, run * PerRun + en);
          quant::accumulate_amax<Half>(b, a, c, residue, inside);
        }
      }
      Tensor ua = filter(amax);
      Tensor uo = filter(run_off);
      int const out_cols = Half ? N / 2 : N;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size(ua); ++j) {
        if (uo(j) / TileM != run) continue;
        float s, inv;
        quant::scales<Element, Pow2>(quant::shuffle_max(ua(j), lane_mask), s, inv);
        ua(j) = inv;                                       // the run's multiplier from here on
        int m = m_tile * TileM + uo(j) % TileM;
        int r = n_tile * Runs + run;                       // run index along the output's columns
        if (writer && m < M && r * Block < out_cols) p.scale[int64_t(r) * p.scale_ld + m] = s;
      }
      // 2. the codes, one subtile's columns at a time: into shared memory (values outside the problem
      // are staged but never written out), then out with Vec-byte stores along each row
      bool const vec = p.ld % Vec == 0 && reinterpret_cast<uintptr_t>(p.ptr) % Vec == 0;
      auto* out = reinterpret_cast<uint8_t*>(p.ptr);
      int const m_base = m_tile * TileM;
      constexpr int Chunks = OutCols / Vec;
      CUTLASS_PRAGMA_UNROLL
      for (int en = 0; en < PerRun; ++en) {
        int const n_sub = n_tile * TileN + (run * PerRun + en) * EpiN;   // the subtile's first tile column
        CUTLASS_PRAGMA_UNROLL
        for (int em = 0; em < EpiM; ++em) {
          Tensor b = buf(_, _, _, em, en);
          Tensor a = amax(_, _, _, em, run * PerRun + en);
          Tensor c = tCcD(_, _, _, em, run * PerRun + en);
          if constexpr (Pairs && !Half) {
            // (2i, 2i+1) of one row: one conversion and one 2-byte store for both
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(b); i += 2) {
              auto crd = c(i);
              int col = col0 + int(get<1>(crd)) - n_sub;
              auto two = quant::convert2<Element>(b(i) * a(i), b(i + 1) * a(i + 1));
              *reinterpret_cast<uint16_t*>(&smem->codes[row0 + int(get<0>(crd)) - m_base][col]) = two;
            }
          } else {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(b); ++i) {
              if (!Half || i % 2 == 0) {
                auto crd = c(i);
                int col = col0 + int(get<1>(crd)) - n_sub;
                smem->codes[row0 + int(get<0>(crd)) - m_base][Half ? col / 2 : col] =
                    quant::convert<Element>(b(i) * a(i)).storage;
              }
            }
          }
        }
        synchronize();
        int const out_n0 = Half ? n_sub / 2 : n_sub;
        CUTLASS_PRAGMA_UNROLL
        for (int t = thread; t < TileM * Chunks; t += Threads) {
          int row = t / Chunks, n = out_n0 + (t % Chunks) * Vec;
          int m = m_base + row;
          if (m >= M || n >= out_cols) continue;
          uint8_t const* src = &smem->codes[row][(t % Chunks) * Vec];
          uint8_t* dst = out + int64_t(m) * p.ld + n;
          if (vec && n + Vec <= out_cols) {
            if constexpr (Vec == 16) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
            else *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<uint2 const*>(src);
          } else {
            for (int e = 0; e < Vec && n + e < out_cols; ++e) dst[e] = src[e];
          }
        }
        synchronize();                         // the buffer is free for the next subtile
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    if constexpr (Half) detail::check_pair_layout(args);
    using EpiTileShape = decltype(shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
    using FlatThr = quant::FlatThreads<cute::remove_cvref_t<decltype(args.tiled_copy)>, EpiTileShape>;
    constexpr int mask = detail::n_lane_bits<FlatThr>();
    static_assert(mask >= 0, "coda quantised store: a lane index bit moves both row and column");
    static_assert(detail::warps_keep_columns<FlatThr, decltype(size(FlatThr{}))::value>(),
                  "coda quantised store: warps split the tile along N");
    constexpr int EpiN = decltype(size<1>(EpiTileShape{}))::value;
    static_assert(Span % EpiN == 0, "coda quantised store: the epilogue subtile must not straddle two runs");
    constexpr int PerRun = Span / EpiN;

    auto run_layout = make_layout(make_shape(Int<TileM>{}, make_shape(Int<Span>{}, Int<Runs>{})),
                                  make_stride(_1{}, make_stride(_0{}, Int<TileM>{})));
    Tensor tCoRun = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        make_tensor(counting_iterator<int>(0), run_layout), args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tCrAmax = make_tensor_like<float>(tCoRun);
    fill(tCrAmax, 0.0f);
    auto full = shape(args.tCcD);                                       // (CPY, CPY_M, CPY_N, EPI_M, EPI_N)
    constexpr int EpiM = decltype(size<3>(decltype(full){}))::value;
    Tensor tCrBuf = make_tensor<float>(make_shape(get<0>(full), get<1>(full), get<2>(full), get<3>(full), Int<PerRun>{}));

    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    int row0 = int(M) - int(get<0>(args.residue_tCcD));
    int col0 = int(N) - int(get<1>(args.residue_tCcD));
    int lane = args.thread_idx % 32;
    constexpr bool Pairs = quant::fragments_hold_pairs<cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...>>();
    return ConsumerStoreCallbacks<decltype(tCrBuf), decltype(tCrAmax), decltype(tCoRun), decltype(args.tCcD),
                                  decltype(args.residue_tCcD), PerRun, EpiM, Pairs>(
        tCrBuf, tCrAmax, tCoRun, args.tCcD, args.residue_tCcD, params, smem, row0, col0, int(m), int(n), mask,
        (lane & mask) == 0, args.thread_idx);
  }
};

// ------------------------------------------------------------------------------------------------
// The transpose, [cols, rows]: Block == 0 stores the value as it comes (already scaled: per-tensor
// quantisation, or any dtype); Block == TileM quantises each column's run over the tile's rows.
// Group > 1: Group neighbouring output columns (stored rows) share one scale per run, the max of
// their runs' amaxes: Group x 128 blocks of the stored transpose, scale[run][stored row / Group].
// A group lies inside one epilogue subtile, so it costs a few shuffles over the per-column path.
// ------------------------------------------------------------------------------------------------
template <class Element, class CtaTileShapeMNK, class EpilogueTile, int Threads, int Block, bool Half, bool Pow2,
          int Group = 1>
struct TransposedStore {
  static constexpr int TileM = cute::size<0>(CtaTileShapeMNK{});
  static constexpr int EpiN = cute::size<1>(EpilogueTile{});
  static constexpr int Warps = Threads / 32;
  static_assert(Block == 0 || Block == TileM,
                "coda quantised transposed store: 128 x 1 runs need a CTA tile exactly 128 rows high");
  static constexpr int GroupCols = Group * (Half ? 2 : 1);   // tile columns of one group
  static_assert(Group == 1 || (Block != 0 && EpiN % GroupCols == 0 && 32 % GroupCols == 0),
                "coda quantised transposed store: a column group must lie inside one epilogue subtile and one "
                "warp's lanes (lower/kinds/quantized.py checks the configuration)");
  static_assert(TileM % 16 == 0, "coda transposed store: the tile's rows are written in 16-byte runs");

  static constexpr int OutCols = Half ? EpiN / 2 : EpiN;    // output rows (tile columns) of one subtile
  static constexpr int Pitch = TileM + 16;                   // bytes per staged output row: 16-byte aligned,
                                                             // and neighbouring rows start in other banks
  // one-byte codes leave through shared memory in 16-byte stores (a byte per thread at a stride of
  // the row length, straight from registers, cost more than the GEMM: docs/RESULTS.md)
  static constexpr bool Staged = Block != 0 || sizeof(Element) == 1;
  struct SharedStorage {
    float amax[Block ? Warps : 1][Block ? EpiN : 1];
    float inv[Block ? EpiN : 1];          // each column's multiplier, computed once per column
    alignas(16) uint8_t codes[Staged ? OutCols : 1][Staged ? Pitch : 16];
  };
  using Arguments = QuantStoreArguments<Element>;
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) { return args; }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr != nullptr && (Block == 0 || args.scale != nullptr);
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE TransposedStore() {}
  CUTLASS_HOST_DEVICE TransposedStore(Params const& params, SharedStorage const& smem)
      : params(params), smem(const_cast<SharedStorage*>(&smem)) {}
  Params params;
  SharedStorage* smem = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <class Buf, class Amax, class ColOff, class CoordTensor, class Residue, int EpiM>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Buf buf, Amax amax, ColOff col_off, CoordTensor tCcD, Residue residue,
                                          Arguments const& p, SharedStorage* smem, int row0, int col0, int m_tile,
                                          int n_tile, int lane_mask, int lane, int warp)
        : buf(buf), amax(amax), col_off(col_off), tCcD(tCcD), residue(residue), p(p), smem(smem), row0(row0),
          col0(col0), m_tile(m_tile), n_tile(n_tile), lane_mask(lane_mask), lane(lane), warp(warp) {}
    Buf buf;              // Block: (CPY, CPY_M, CPY_N, EPI_M): the subtile column being filled
    Amax amax;            // Block: (CPY, CPY_M, CPY_N, EPI_M, EPI_N), one register per tile column
    ColOff col_off;       // the same shape: the tile column of each element (decodes amax registers)
    CoordTensor tCcD;
    Residue residue;
    Arguments p;
    SharedStorage* smem;
    int row0, col0;       // the thread's origin in the output (rows; tile columns)
    int m_tile, n_tile;
    int lane_mask;        // lane bits that step along M within a column
    int lane, warp;

    CUTLASS_DEVICE void store(int m, int n, float v) {
      p.ptr[int64_t(Half ? n / 2 : n) * p.ld + m] = quant::convert<Element>(v);
    }

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementInput, FragmentSize> const& frg) {
      using namespace cute;
      if constexpr (Block == 0 && !Staged) {
        Tensor c = tCcD(_, _, _, epi_m, epi_n);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          int idx = epi_v * FragmentSize + i;
          auto crd = c(idx);
          if ((!Half || idx % 2 == 0) && elem_less(crd, residue)) {
            store(row0 + int(get<0>(crd)), col0 + int(get<1>(crd)), float(frg[i]));
          }
        }
      } else if constexpr (Block == 0) {
        // already scaled: the codes go straight to shared memory, transposed (values outside the
        // problem are staged but never written out); reduce() writes the subtile column out
        Tensor c = tCcD(_, _, _, epi_m, epi_n);
        int const m_base = m_tile * TileM;
        int const n_sub = n_tile * cute::size<1>(CtaTileShapeMNK{}) + epi_n * EpiN;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) {
          int idx = epi_v * FragmentSize + i;
          if (!Half || idx % 2 == 0) {
            auto crd = c(idx);
            int col = col0 + int(get<1>(crd)) - n_sub;
            smem->codes[Half ? col / 2 : col][row0 + int(get<0>(crd)) - m_base] =
                quant::convert<Element>(float(frg[i])).storage;
          }
        }
      } else {
        Tensor b = buf(_, _, _, epi_m);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < FragmentSize; ++i) b(epi_v * FragmentSize + i) = float(frg[i]);
      }
      return frg;
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const& synchronize, int epi_m, int epi_n, bool, VTensor) {
      using namespace cute;
      if constexpr (Staged) {
        if (epi_m != EpiM - 1) return;       // the subtile's columns are complete after its last rows
        int const m_base = m_tile * TileM;
        int const n_sub = n_tile * cute::size<1>(CtaTileShapeMNK{}) + epi_n * EpiN;   // the subtile's first column
        int const N = int(get<1>(residue)) + col0;
        if constexpr (Block != 0) {
          Tensor ua = filter(amax(_, _, _, _, epi_n));      // one register per column of this subtile
          Tensor uo = filter(col_off(_, _, _, _, epi_n));
          fill(ua, 0.0f);
          // a tile inside the problem skips the per-value bounds checks (quant::accumulate_amax)
          bool const inside = (m_tile + 1) * TileM <= int(get<0>(residue)) + row0 &&
                              (n_tile + 1) * cute::size<1>(CtaTileShapeMNK{}) <= N;
          CUTLASS_PRAGMA_UNROLL
          for (int em = 0; em < EpiM; ++em) {
            Tensor b = buf(_, _, _, em);
            Tensor a = amax(_, _, _, em, epi_n);
            Tensor c = tCcD(_, _, _, em, epi_n);
            quant::accumulate_amax<Half>(b, a, c, residue, inside);
          }
          // across the lanes of a column, then across the warps (each holds other rows) in shared memory
          synchronize();                        // the previous subtile's readers are done
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(ua); ++j) {
            float v = quant::shuffle_max(ua(j), lane_mask);
            if ((lane & lane_mask) == 0) smem->amax[warp][uo(j) % EpiN] = v;
          }
          synchronize();
          // one thread per column: the max over the warps (and over its group's columns: whole warps
          // shuffle), the scale (to global) and the multiplier
          int const thread = warp * 32 + lane;
          if (thread < (EpiN + 31) / 32 * 32) {
            float a = 0.0f;
            if (thread < EpiN) {
              CUTLASS_PRAGMA_UNROLL
              for (int w = 0; w < Warps; ++w) a = quant::nan_max(a, smem->amax[w][thread]);
            }
            if constexpr (Group > 1) a = quant::shuffle_max(a, GroupCols - 1);
            if (thread < EpiN) {
              float s, inv;
              quant::scales<Element, Pow2>(a, s, inv);
              smem->inv[thread] = inv;
              int n = n_tile * cute::size<1>(CtaTileShapeMNK{}) + epi_n * EpiN + thread;
              if (n < N && n % GroupCols == 0) {
                p.scale[int64_t(m_tile) * p.scale_ld + (Half ? n / 2 : n) / Group] = s;
              }
            }
          }
          synchronize();
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < size(ua); ++j) ua(j) = smem->inv[uo(j) % EpiN];
          // the codes, transposed into shared memory (one byte each; values outside the problem are
          // staged but never written out) ...
          CUTLASS_PRAGMA_UNROLL
          for (int em = 0; em < EpiM; ++em) {
            Tensor b = buf(_, _, _, em);
            Tensor a = amax(_, _, _, em, epi_n);
            Tensor c = tCcD(_, _, _, em, epi_n);
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < size(b); ++i) {
              if (!Half || i % 2 == 0) {
                auto crd = c(i);
                int col = col0 + int(get<1>(crd)) - n_sub;
                smem->codes[Half ? col / 2 : col][row0 + int(get<0>(crd)) - m_base] =
                    quant::convert<Element>(b(i) * a(i)).storage;
              }
            }
          }
        }
        synchronize();
        // ... then out with 16-byte stores: each output row's TileM codes are contiguous in global memory
        int const M = int(get<0>(residue)) + row0;
        int const out_n = Half ? N / 2 : N;
        int const out_n0 = Half ? n_sub / 2 : n_sub;
        bool const vec = p.ld % 16 == 0 && reinterpret_cast<uintptr_t>(p.ptr) % 16 == 0;
        constexpr int Chunks = TileM / 16;
        auto* out = reinterpret_cast<uint8_t*>(p.ptr);
        CUTLASS_PRAGMA_UNROLL
        for (int t = warp * 32 + lane; t < OutCols * Chunks; t += Threads) {
          int row = t / Chunks, m = m_base + (t % Chunks) * 16;
          if (out_n0 + row >= out_n || m >= M) continue;
          uint8_t const* src = &smem->codes[row][(t % Chunks) * 16];
          uint8_t* dst = out + int64_t(out_n0 + row) * p.ld + m;
          if (vec && m + 16 <= M) {
            *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<uint4 const*>(src);
          } else {
            for (int e = 0; e < 16 && m + e < M; ++e) dst[e] = src[e];
          }
        }
        if constexpr (Block == 0) synchronize();   // read out before the next subtile stages its codes
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    if constexpr (Half) detail::check_pair_layout(args);
    using EpiTileShape = decltype(shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
    using FlatThr = quant::FlatThreads<cute::remove_cvref_t<decltype(args.tiled_copy)>, EpiTileShape>;
    constexpr int mask = quant::m_lane_bits<FlatThr>();
    static_assert(mask >= 0, "coda transposed store: a lane index bit moves both row and column");
    static_assert(detail::warps_keep_columns<FlatThr, decltype(size(FlatThr{}))::value>(),
                  "coda transposed store: warps split the tile along N");
    static_assert(decltype(size(FlatThr{}))::value == Threads, "coda transposed store: thread count mismatch");
    auto full = shape(args.tCcD);                                       // (CPY, CPY_M, CPY_N, EPI_M, EPI_N)
    constexpr int EpiM = decltype(size<3>(decltype(full){}))::value;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    int row0 = int(M) - int(get<0>(args.residue_tCcD));
    int col0 = int(N) - int(get<1>(args.residue_tCcD));
    if constexpr (Block == 0) {
      // no runs to reduce: no register buffers (a whole tile's worth per thread would sit in the
      // callbacks object, which the compiler then keeps in a stack frame)
      Tensor none = make_tensor<float>(make_shape(Int<1>{}));
      return ConsumerStoreCallbacks<decltype(none), decltype(none), decltype(none), decltype(args.tCcD),
                                    decltype(args.residue_tCcD), EpiM>(
          none, none, none, args.tCcD, args.residue_tCcD, params, smem, row0, col0, int(m), int(n), mask,
          args.thread_idx % 32, args.thread_idx / 32);
    } else {
      constexpr int TileN = cute::size<1>(CtaTileShapeMNK{});
      auto col_layout = make_layout(make_shape(Int<TileM>{}, Int<TileN>{}), make_stride(_0{}, _1{}));
      Tensor tCoCol = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
          make_tensor(counting_iterator<int>(0), col_layout), args.epi_tile, args.tiled_copy, args.thread_idx);
      Tensor tCrAmax = make_tensor_like<float>(tCoCol);
      Tensor tCrBuf = make_tensor<float>(make_shape(get<0>(full), get<1>(full), get<2>(full), get<3>(full)));
      return ConsumerStoreCallbacks<decltype(tCrBuf), decltype(tCrAmax), decltype(tCoCol), decltype(args.tCcD),
                                    decltype(args.residue_tCcD), EpiM>(
          tCrBuf, tCrAmax, tCoCol, args.tCcD, args.residue_tCcD, params, smem, row0, col0, int(m), int(n), mask,
          args.thread_idx % 32, args.thread_idx / 32);
    }
  }
};

}  // namespace coda

// coda-cutlass: a store node for half-width outputs of pairwise 2 -> 1 ops (SwiGLU and friends).
//
// The input value is meaningful on the even column of each pair (2i, 2i+1); it is written to
// column i of an M x N/2 row-major tensor, straight from registers (no shared memory, so no extra
// epilogue smem next to the mainloop's stages).
//
// A thread holds one output value per 8 tile columns of a row (the wgmma layout: the four lanes of
// a quad start 2 columns apart), so stored one by one a quad writes 8 bytes per row at a time and
// every 32-byte sector is written in four pieces. Where the fragment layout allows it (checked at
// compile time, below) and the output is 8-byte aligned, the quad first exchanges its values (a
// 4 x 4 transpose through shuffles, two rows per 32-bit shuffle) so that each lane holds 4
// adjacent outputs and writes them as one 8-byte store: a quad then fills whole sectors.
#pragma once

#include <cstdint>
#include <cstring>

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

namespace detail {

// Lanes 0-3 of the epilogue's register partition start 2, 4 and 6 columns right of lane 0, in
// its row (FlatThr: thread index -> the thread's origin in the subtile).
template <class FlatThr>
CUTE_HOST_DEVICE constexpr bool quad_lanes_step_two_columns() {
  constexpr int threads = decltype(cute::size(FlatThr{}))::value;
  if (threads < 4) return false;
  for (int t = 1; t < 4; ++t) {
    auto d = FlatThr{}(t) - FlatThr{}(0);
    if (row_of(d) != 0 || col_of(d) != 2 * t) return false;
  }
  return true;
}

// Where each of a thread's output values sits in its fragment, for the exchange: the fragment
// (Sub: index -> (row, col) relative to the thread's subtile origin) must hold, in each of Rows
// rows, pairs at columns 0, 8, ..., 8 (Chunks - 1), with Chunks a multiple of 4 and Rows even.
// idx[r][j] is the fragment index of row r's chunk j; ok says whether the layout is that one.
template <int Rows, int Chunks>
struct HalfRunTable {
  bool ok = false;
  int row[Rows > 0 ? Rows : 1] = {};
  int idx[Rows > 0 ? Rows : 1][Chunks > 0 ? Chunks : 1] = {};
};

template <class Sub>
CUTE_HOST_DEVICE constexpr int half_run_rows() {
  constexpr int n = decltype(cute::size(Sub{}))::value;
  int rows[n > 0 ? n : 1] = {};
  int count = 0;
  for (int i = 0; i < n; i += 2) {
    int r = row_of(Sub{}(i));
    bool seen = false;
    for (int k = 0; k < count; ++k) seen = seen || rows[k] == r;
    if (!seen) rows[count++] = r;
  }
  return count;
}

template <class Sub, int Rows, int Chunks>
CUTE_HOST_DEVICE constexpr HalfRunTable<Rows, Chunks> half_run_table() {
  HalfRunTable<Rows, Chunks> t;
  constexpr int n = decltype(cute::size(Sub{}))::value;
  if (Rows == 0 || Rows % 2 != 0 || Chunks % 4 != 0 || Rows * Chunks * 2 != n) return t;
  int count = 0;
  int found = 0;
  for (int i = 0; i < n; i += 2) {
    auto a = Sub{}(i);
    auto b = Sub{}(i + 1);
    int r = row_of(a), c = col_of(a);
    if (row_of(b) != r || col_of(b) != c + 1 || c % 8 != 0 || c / 8 >= Chunks || c < 0) return t;
    int k = 0;
    while (k < count && t.row[k] != r) ++k;
    if (k == count) {
      if (count == Rows) return t;
      t.row[count++] = r;
      for (int j = 0; j < Chunks; ++j) t.idx[k][j] = -1;
    }
    if (t.idx[k][c / 8] != -1) return t;
    t.idx[k][c / 8] = i;
    ++found;
  }
  t.ok = count == Rows && found == Rows * Chunks;
  return t;
}

// The value of a[k] for a lane-dependent k in 0..3, without indexing registers at run time.
CUTLASS_DEVICE uint32_t pick4(uint32_t const (&a)[4], int k) {
  uint32_t lo = (k & 1) ? a[1] : a[0];
  uint32_t hi = (k & 1) ? a[3] : a[2];
  return (k & 2) ? hi : lo;
}

// The exchange's plan for one kernel's layouts: Rows x Chunks values per thread and subtile, and
// where each sits (table.ok false: the layout is another one, so values are stored one by one).
template <class Element, class FlatThr, class Sub>
struct HalfRunLayout {
  static constexpr bool quad = sizeof(Element) == 2 && quad_lanes_step_two_columns<FlatThr>();
  static constexpr int Rows = quad ? half_run_rows<Sub>() : 0;
  static constexpr int Chunks = Rows ? int(decltype(cute::size(Sub{}))::value) / (2 * Rows) : 0;
  static constexpr HalfRunTable<Rows, Chunks> table =
      quad ? half_run_table<Sub, Rows, Chunks>() : HalfRunTable<Rows, Chunks>{};
};

template <class Element>
CUTLASS_DEVICE uint32_t bits16(Element v) {
  static_assert(sizeof(Element) == 2, "16-bit outputs");
  uint16_t b;
  memcpy(&b, &v, 2);
  return b;
}

}  // namespace detail

// Exchange = false stores every value on its own (the layout-independent path; for A/B probes).
template <class Element, bool Exchange = true>
struct HalfWidthStore : PointerNode<HalfWidthStoreArguments<Element>> {
  using Base = PointerNode<HalfWidthStoreArguments<Element>>;
  using Base::Base;
  using typename Base::Params;

  // Plan: detail::HalfRunLayout of the kernel's layouts.
  template <class CoordTensor, class Residue, class Plan>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Element* row0, int64_t ld, int col0, CoordTensor tCcD, Residue residue,
                                          bool aligned, int lane)
        : row0(row0), ld(ld), col0(col0), tCcD(tCcD), residue(residue), aligned(aligned), lane(lane) {}
    Element* row0;      // the output row of the thread's origin
    int64_t ld;
    int col0;           // the thread's origin column in the full-width tile (even)
    CoordTensor tCcD;   // coordinates relative to the thread's origin
    Residue residue;    // (M, N) - origin: elements at or past it are out of bounds
    bool aligned;       // rows start on 8 bytes: 4 adjacent outputs can leave as one store
    int lane;

    template <typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void store_each(cutlass::Array<ElementInput, FragmentSize> const& frg, int epi_v, int epi_m,
                                   int epi_n) {
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
    }

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementInput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementInput, FragmentSize> const& frg) {
      using namespace cute;
      constexpr auto table = Plan::table;
      if constexpr (Exchange && table.ok && FragmentSize == 2 * Plan::Rows * Plan::Chunks) {
        store_runs(frg, epi_m, epi_n);
      } else {
        store_each(frg, epi_v, epi_m, epi_n);
      }
      return frg;
    }

    // The quad's 4 x 4 exchange, then 8-byte stores (see the file comment). Lane q of the quad
    // ends with chunk 4g + q of every lane: the outputs 4 (4g + q) + p, p = 0..3, which are
    // adjacent. Every lane takes part in every shuffle; bounds are checked after.
    template <typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE void store_runs(cutlass::Array<ElementInput, FragmentSize> const& frg, int epi_m, int epi_n) {
      using namespace cute;
      constexpr int Rows = Plan::Rows, Chunks = Plan::Chunks;
      constexpr auto table = Plan::table;
      Tensor c = tCcD(_, _, _, epi_m, epi_n);
      cutlass::NumericConverter<Element, ElementInput, cutlass::FloatRoundStyle::round_to_nearest> convert;
      int const q = lane & 3;
      int const M = int(get<0>(residue));      // relative to the thread's origin
      int const N = int(get<1>(residue));
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < Rows; r += 2) {
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < Chunks / 4; ++g) {
          uint32_t a[4];   // chunk 4g + t of rows r (low half) and r + 1 (high half)
          CUTLASS_PRAGMA_UNROLL
          for (int t = 0; t < 4; ++t) {
            a[t] = detail::bits16(convert(frg[table.idx[r][4 * g + t]])) |
                   (detail::bits16(convert(frg[table.idx[r + 1][4 * g + t]])) << 16);
          }
          uint32_t b[4];   // b[p]: lane p's value of chunk 4g + q
          uint32_t const own = detail::pick4(a, q);
          CUTLASS_PRAGMA_UNROLL
          for (int p = 0; p < 4; ++p) b[p] = own;
          CUTLASS_PRAGMA_UNROLL
          for (int s = 1; s < 4; ++s) {
            uint32_t const got = __shfl_xor_sync(0xffffffffu, detail::pick4(a, q ^ s), s);
            CUTLASS_PRAGMA_UNROLL
            for (int p = 0; p < 4; ++p) b[p] = p == (q ^ s) ? got : b[p];
          }
          // chunk 4g + q of lane 0 of the quad, relative to this thread's origin: 2 * (4 (4g + q)) - 2q
          int const col = 8 * (4 * g + q) - 2 * q + int(get<1>(c(table.idx[r][0])));   // even; tile columns
          CUTLASS_PRAGMA_UNROLL
          for (int h = 0; h < 2; ++h) {
            int const row = int(get<0>(c(table.idx[r + h][0])));
            if (row >= M) continue;
            Element* dst = row0 + int64_t(row) * ld + (col0 + col) / 2;
            uint32_t const lo = h ? (b[0] >> 16) | (b[1] & 0xffff0000u) : (b[0] & 0xffffu) | (b[1] << 16);
            uint32_t const hi = h ? (b[2] >> 16) | (b[3] & 0xffff0000u) : (b[2] & 0xffffu) | (b[3] << 16);
            if (aligned && col + 6 < N) {
              *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
            } else {
              uint32_t const v[2] = {lo, hi};
              CUTLASS_PRAGMA_UNROLL
              for (int p = 0; p < 4; ++p) {
                if (col + 2 * p < N) {
                  uint16_t const bits = uint16_t(v[p / 2] >> (16 * (p % 2)));
                  Element e;
                  memcpy(&e, &bits, 2);
                  dst[p] = e;
                }
              }
            }
          }
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    detail::check_pair_layout(args);
    auto [M, N, K, L] = args.problem_shape_mnkl;
    int row_origin = int(M) - int(cute::get<0>(args.residue_tCcD));
    int col_origin = int(N) - int(cute::get<1>(args.residue_tCcD));
    Element* row0 = this->params.ptr + int64_t(row_origin) * this->params.ld;
    // the exchange's layout checks (compile time); a layout that fails them stores value by value
    using EpiTileShape = decltype(shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
    using FlatThr = detail::FlatThreads<cute::remove_cvref_t<decltype(args.tiled_copy)>, EpiTileShape>;
    using Sub = decltype(take<0, 3>(cute::remove_cvref_t<decltype(args.tCcD.layout())>{}));
    bool aligned = this->params.ld % 4 == 0 && reinterpret_cast<uintptr_t>(this->params.ptr) % 8 == 0;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD),
                                  detail::HalfRunLayout<Element, FlatThr, Sub>>(
        row0, this->params.ld, col_origin, args.tCcD, args.residue_tCcD, aligned, int(args.thread_idx % 32));
  }
};

}  // namespace coda

// coda-cutlass: pairwise operations on adjacent columns (2i, 2i+1) of the epilogue fragment.
//
// Pair ops never move data between threads: they rely on each thread's epilogue fragment holding
// columns 2i and 2i+1 of one row in fragment elements 2k and 2k+1. That is a property of the wgmma
// accumulator layout and of the collective's register->smem partition, so it is checked here at
// compile time from the static layouts the kernel actually uses (see fragment_pairs_adjacent).
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

#include "cute/tensor.hpp"
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp"

namespace coda {

namespace detail {

// Column of the coordinate `crd` (an (m, n) arithmetic tuple) as an int.
template <class Crd>
CUTE_HOST_DEVICE constexpr int col_of(Crd const& crd) { return int(cute::get<1>(crd)); }
template <class Crd>
CUTE_HOST_DEVICE constexpr int row_of(Crd const& crd) { return int(cute::get<0>(crd)); }

// True when every thread of the epilogue's register->smem tiled copy starts at an even column.
// The thread -> origin map is affine, so it suffices that one step along each mode of the copy's
// (flattened) thread layout moves by an even number of columns. Evaluated at compile time on the
// copy's thread-value layout applied to an identity (coordinate) layout of one epilogue subtile:
// the partition the collective uses to hand fragments to the visitor.
template <class FlatThr, size_t... I>
CUTE_HOST_DEVICE constexpr bool mode_steps_even(std::index_sequence<I...>) {
  using namespace cute;
  return (true && ... &&
          (decltype(size<I>(FlatThr{}))::value == 1 ||
           col_of(FlatThr{}(int(decltype(size(take<0, I>(shape(FlatThr{}))))::value))) % 2 == 0));
}

// The collective's register -> smem thread layout over one epilogue subtile, flattened: thread
// index -> that thread's origin (row, column), so each thread-index bit's step can be read off.
template <class TiledCopy, class EpiTileShape>
using FlatThreads = decltype(cute::flatten(
    cute::get<0>(TiledCopy::tidfrg_S(cute::make_identity_layout(EpiTileShape{})))));

template <class TiledCopy, class EpiTileShape>
CUTE_HOST_DEVICE constexpr bool thread_origins_even() {
  using namespace cute;
  using FlatThr = FlatThreads<TiledCopy, EpiTileShape>;
  return col_of(FlatThr{}(0)) % 2 == 0 &&
         mode_steps_even<FlatThr>(std::make_index_sequence<decltype(rank(FlatThr{}))::value>{});
}

// The visitor's fragment coordinates relative to the thread's origin (a static layout): elements
// 2k and 2k+1 are in one row, one column apart, and element 2k sits an even number of columns
// from the origin. With an even origin (above), every pair is (2i, 2i+1) of one row.
template <class CoordLayout>
CUTE_HOST_DEVICE constexpr bool coordinate_pairs_adjacent() {
  constexpr int n = decltype(cute::size(CoordLayout{}))::value;
  if (n % 2 != 0) return false;
  for (int i = 0; i < n; i += 2) {
    auto a = CoordLayout{}(i);
    auto b = CoordLayout{}(i + 1);
    if (row_of(a) != row_of(b) || col_of(b) != col_of(a) + 1 || col_of(a) % 2 != 0) return false;
  }
  return true;
}

template <class Args>
CUTLASS_DEVICE constexpr void check_pair_layout(Args const& args) {
  using TiledCopy = cute::remove_cvref_t<decltype(args.tiled_copy)>;
  using EpiTileShape = decltype(cute::shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
  using CoordLayout = cute::remove_cvref_t<decltype(args.tCcD.layout())>;
  static_assert(thread_origins_even<TiledCopy, EpiTileShape>(),
                "coda pairwise op: this kernel configuration's epilogue fragments do not hold column "
                "pairs (2i, 2i+1) in adjacent registers; pick another tile/epilogue configuration");
  static_assert(coordinate_pairs_adjacent<CoordLayout>(),
                "coda pairwise op: the epilogue coordinate tensor does not pair adjacent columns");
}

}  // namespace detail

// Fragment-level pair functors (no scalar form: they need the whole fragment).
//   pair_first(x)[j]  = x[j & ~1]  (the value at the pair's even column, on both columns)
//   pair_second(x)[j] = x[j | 1]   (the value at the pair's odd column, on both columns)
//   pair_merge(a, b)[j] = a[j] on even columns, b[j] on odd columns
template <class T> struct pair_first;
template <class T, int N>
struct pair_first<cutlass::Array<T, N>> {
  static_assert(N % 2 == 0, "pair ops need an even fragment size");
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = x[i & ~1];
    return out;
  }
};

template <class T> struct pair_second;
template <class T, int N>
struct pair_second<cutlass::Array<T, N>> {
  static_assert(N % 2 == 0, "pair ops need an even fragment size");
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = x[i | 1];
    return out;
  }
};

template <class T> struct pair_merge;
template <class T, int N>
struct pair_merge<cutlass::Array<T, N>> {
  static_assert(N % 2 == 0, "pair ops need an even fragment size");
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& a,
                                                      cutlass::Array<T, N> const& b) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = (i & 1) ? b[i] : a[i];
    return out;
  }
};

// Packed 2 x 16-bit values travel through the epilogue as the bits of one fp32 (a 32-bit TMA
// element): the low half is the even column, the high half the odd column (little endian).
template <class Half>
CUTLASS_HOST_DEVICE float half_bits_to_float(uint32_t bits) {
  return float(Half::bitcast(static_cast<uint16_t>(bits & 0xffffu)));
}

template <class Half>
CUTLASS_HOST_DEVICE uint32_t float_to_half_bits(float x) {
  return uint32_t(Half(x).raw());   // round to nearest even
}

CUTLASS_HOST_DEVICE uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
CUTLASS_HOST_DEVICE float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

// unpack_lo / unpack_hi: the even / odd 16-bit value of a packed pair, as fp32.
template <class Half>
struct Unpack {
  template <class T> struct lo;
  template <class T, int N>
  struct lo<cutlass::Array<T, N>> {
    CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
      cutlass::Array<T, N> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = half_bits_to_float<Half>(bits_of(x[i]));
      return out;
    }
  };
  template <class T> struct hi;
  template <class T, int N>
  struct hi<cutlass::Array<T, N>> {
    CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x) const {
      cutlass::Array<T, N> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = half_bits_to_float<Half>(bits_of(x[i]) >> 16);
      return out;
    }
  };
  // pack(a, b): a rounded to Half in the low bits, b in the high bits.
  template <class T> struct pack;
  template <class T, int N>
  struct pack<cutlass::Array<T, N>> {
    CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& a,
                                                        cutlass::Array<T, N> const& b) const {
      cutlass::Array<T, N> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) {
        out[i] = float_of(float_to_half_bits<Half>(a[i]) | (float_to_half_bits<Half>(b[i]) << 16));
      }
      return out;
    }
  };
};

// A Compute node for pair functors: Sm90Compute plus the compile-time fragment layout check.
template <template <class> class ComputeFn, class ElementOutput, class ElementCompute,
          cutlass::FloatRoundStyle RoundStyle>
struct PairCompute
    : cutlass::epilogue::fusion::Sm90Compute<ComputeFn, ElementOutput, ElementCompute, RoundStyle> {
  using Base = cutlass::epilogue::fusion::Sm90Compute<ComputeFn, ElementOutput, ElementCompute, RoundStyle>;
  using Base::Base;

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    detail::check_pair_layout(args);
    return Base::template get_consumer_store_callbacks<ReferenceSrc>(args);
  }
};

}  // namespace coda

// coda-cutlass: rotation of adjacent column pairs (RoPE) as one fragment-level op.
//
// rotate(x, theta): out_2i = x_2i cos t - x_2i+1 sin t, out_2i+1 = x_2i sin t + x_2i+1 cos t with
// t = theta_2i (the angle of the pair's even column). One sine/cosine per pair instead of per
// element, and no separate pair split/merge nodes. The fragment layout (pairs in adjacent registers)
// is checked at compile time, as for coda::PairCompute.
//
// coda::PairRotate also reuses sines and cosines across the tile: a thread holds the same rows and
// column offsets in epilogue subtile n and n + EPI_N/2, so when its angles there are bitwise equal
// to those it computed for subtile n (RoPE: a 256-wide tile holds two heads with the same
// frequencies) it takes the cached cos/sin instead of evaluating them again. The test is exact, so
// the result is the same bits either way; it only saves work.
#pragma once

#include "coda/math_extra.hpp"
#include "coda/pairwise.hpp"

namespace coda {

namespace detail {

// sin/cos of one pair's angle: the kernel's reduction + hardware approximation (host: libm).
CUTLASS_HOST_DEVICE void pair_sincos(float theta, float& s, float& c) {   // one reduction for both
#if defined(__CUDA_ARCH__)
  __sincosf(scalar::reduce_two_pi(theta), &s, &c);
#else
  c = cosf(theta);
  s = sinf(theta);
#endif
}

}  // namespace detail

// The node is a plain visitor (no arguments, smem or loads) with its own consumer callbacks.
template <class ElementOutput, class ElementCompute, cutlass::FloatRoundStyle RoundStyle>
struct PairRotate : cutlass::epilogue::fusion::Sm90VisitorImpl<> {
  using cutlass::epilogue::fusion::Sm90VisitorImpl<>::Sm90VisitorImpl;

  // Per thread: the angles and cos/sin of the first EPI_N/2 subtiles (for each EPI_M row block),
  // kept in registers (every index is a compile-time constant once the collective's subtile loops
  // are unrolled).
  template <int EpiM, int EpiN, int PairsPerSubtile>
  struct Callbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    static constexpr int Half = EpiN % 2 == 0 ? EpiN / 2 : 0;   // 0: no reuse (odd subtile count)
    static constexpr int Slots = Half > 0 ? EpiM * Half : 1;
    float theta_c[Slots][PairsPerSubtile];
    float cos_c[Slots][PairsPerSubtile];
    float sin_c[Slots][PairsPerSubtile];

    CUTLASS_DEVICE Callbacks() {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < Slots; ++j) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < PairsPerSubtile; ++i) theta_c[j][i] = __int_as_float(0x7fffffff);  // NaN: never equal
      }
    }

    template <typename ElementAccumulator, typename ElementX, typename ElementT, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementOutput, FragmentSize>
    visit(cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
          cutlass::Array<ElementX, FragmentSize> const& x_in, cutlass::Array<ElementT, FragmentSize> const& t_in) {
      static_assert(FragmentSize % 2 == 0, "pair ops need an even fragment size");
      constexpr int P = FragmentSize / 2;
      cutlass::NumericArrayConverter<float, ElementX, FragmentSize, RoundStyle> cvt_x;
      cutlass::NumericArrayConverter<float, ElementT, FragmentSize, RoundStyle> cvt_t;
      cutlass::NumericArrayConverter<ElementOutput, float, FragmentSize, RoundStyle> cvt_out;
      cutlass::Array<float, FragmentSize> x = cvt_x(x_in), t = cvt_t(t_in), out;

      const bool second = Half > 0 && epi_n >= Half;
      const int slot = Half > 0 ? epi_m * Half + epi_n % Half : 0;
      const int base = epi_v * P;
      bool any_angle = false, cached = second;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < P; ++i) {
        any_angle |= t[2 * i] != 0.0f;
        if (second) cached &= t[2 * i] == theta_c[slot][base + i];
      }
      float c[P], s[P];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < P; ++i) { c[i] = 1.0f; s[i] = 0.0f; }
      // A fragment whose angles are all exactly 0 (RoPE's V columns, freq 0) skips the trig: on
      // those tiles the test is warp-uniform and the branch is real. x * 1 - y * 0 is what the
      // rotation computes for a zero angle (sin 0 = 0, cos 0 = 1 exactly), so both paths give the
      // same bits, including for inf / NaN inputs.
      if (any_angle) {
        if (cached) {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < P; ++i) { c[i] = cos_c[slot][base + i]; s[i] = sin_c[slot][base + i]; }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < P; ++i) detail::pair_sincos(t[2 * i], s[i], c[i]);
        }
      }
      if (Half > 0 && !second) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < P; ++i) {
          theta_c[slot][base + i] = t[2 * i];
          cos_c[slot][base + i] = c[i];
          sin_c[slot][base + i] = s[i];
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < P; ++i) {
        out[2 * i] = x[2 * i] * c[i] - x[2 * i + 1] * s[i];
        out[2 * i + 1] = x[2 * i] * s[i] + x[2 * i + 1] * c[i];
      }
      return cvt_out(out);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto
  get_consumer_store_callbacks(cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    detail::check_pair_layout(args);
    using TileShape = cute::remove_cvref_t<decltype(args.tile_shape_mnk)>;
    using EpiTileShape = decltype(shape(cute::remove_cvref_t<decltype(args.epi_tile)>{}));
    constexpr int EpiM = size<0>(TileShape{}) / size<0>(EpiTileShape{});
    constexpr int EpiN = size<1>(TileShape{}) / size<1>(EpiTileShape{});
    constexpr int Elems = decltype(size(args.tCcD))::value / (EpiM * EpiN);   // per thread and subtile
    static_assert(Elems % 2 == 0, "pair ops need an even number of elements per subtile");
    return Callbacks<EpiM, EpiN, Elems / 2>{};
  }
};

}  // namespace coda

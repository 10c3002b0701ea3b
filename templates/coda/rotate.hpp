// coda-cutlass: rotation of adjacent column pairs (RoPE) as one fragment-level op.
//
// rotate(x, theta): out_2i = x_2i cos t - x_2i+1 sin t, out_2i+1 = x_2i sin t + x_2i+1 cos t with
// t = theta_2i (the angle of the pair's even column). One sine/cosine per pair instead of per
// element, and no separate pair split/merge nodes. Runs in a coda::PairCompute node, so the
// fragment layout (pairs in adjacent registers) is checked at compile time.
#pragma once

#include "coda/math_extra.hpp"
#include "coda/pairwise.hpp"

namespace coda {

template <class T> struct pair_rotate;
template <class T, int N>
struct pair_rotate<cutlass::Array<T, N>> {
  static_assert(N % 2 == 0, "pair ops need an even fragment size");
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& x,
                                                      cutlass::Array<T, N> const& theta) const {
    cutlass::Array<T, N> out;
    // A fragment whose angles are all exactly 0 (RoPE's V columns, freq 0) skips the trig: on
    // those tiles the test is warp-uniform and the branch is real. x * 1 - y * 0 is what the
    // rotation computes for a zero angle (sin 0 = 0, cos 0 = 1 exactly), so both paths give the
    // same bits, including for inf / NaN inputs.
    bool any_angle = false;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) any_angle |= theta[i] != T(0);
    if (!any_angle) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; i += 2) {
        out[i] = x[i] - x[i + 1] * T(0);
        out[i + 1] = x[i] * T(0) + x[i + 1];
      }
      return out;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 2) {
      float c, s;
#if defined(__CUDA_ARCH__)
      __sincosf(scalar::reduce_two_pi(theta[i]), &s, &c);   // one range reduction for both
#else
      c = cosf(theta[i]);
      s = sinf(theta[i]);
#endif
      out[i] = x[i] * c - x[i + 1] * s;
      out[i + 1] = x[i] * s + x[i + 1] * c;
    }
    return out;
  }
};

}  // namespace coda

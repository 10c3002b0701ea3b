// coda-cutlass: online log-sum-exp as a reduction element for CUTLASS's reduction nodes.
//
// The state of a set of values is (m, s) with m their max and s = sum exp(x - m). A single value
// x is (x, 1); the empty set is (-inf, 0). Combining two states rescales the smaller-max one, so
// each element costs one exp. Sm90ColReduction with ElementCompute = LseState then carries (m, s)
// through its register, warp-shuffle and smem stages unchanged (it moves 8-byte elements as
// uint64_t) and writes one state per (row, N-tile): the partials that the runtime finishes with
// lse = M + log(sum_t s_t * exp(m_t - M)), M = max_t m_t.
#pragma once

#include <cmath>

#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

namespace coda {

struct alignas(8) LseState {
  float m;
  float s;
  LseState() = default;
  CUTLASS_HOST_DEVICE constexpr LseState(float m_, float s_) : m(m_), s(s_) {}
  // One value x: the state (x, 1). (Also what CUTLASS's `ElementCompute(0)` default means; the
  // kernel always passes the real identity, (-inf, 0).)
  CUTLASS_HOST_DEVICE constexpr LseState(float x) : m(x), s(1.0f) {}
  CUTLASS_HOST_DEVICE constexpr LseState(int x) : m(float(x)), s(1.0f) {}
};

CUTLASS_HOST_DEVICE LseState lse_merge(LseState a, LseState b) {
  float hi = fmaxf(a.m, b.m);
  float lo = fminf(a.m, b.m);
  float scale = (lo == hi) ? 1.0f : expf(lo - hi);   // equal maxima (both -inf or +inf too): no rescale
  float s = (a.m >= b.m) ? fmaf(b.s, scale, a.s) : fmaf(a.s, scale, b.s);
  bool nan = (a.m != a.m) || (b.m != b.m);            // fmaxf/fminf drop NaNs: carry them explicitly
  return LseState(nan ? a.m + b.m : hi, nan ? a.m + b.m : s);
}

// Reduction functor for Sm90ColReduction (register, shuffle and smem stages).
template <class T> struct lse_combine;
template <>
struct lse_combine<LseState> {
  CUTLASS_HOST_DEVICE LseState operator()(LseState const& a, LseState const& b) const { return lse_merge(a, b); }
};
template <int N>
struct lse_combine<cutlass::Array<LseState, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<LseState, N>
  operator()(cutlass::Array<LseState, N> const& a, cutlass::Array<LseState, N> const& b) const {
    cutlass::Array<LseState, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = lse_merge(a[i], b[i]);
    return out;
  }
};

}  // namespace coda


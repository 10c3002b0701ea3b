// coda-cutlass: elementwise functors added after the first kernel ABI (kept out of functors.hpp so
// that kernels which do not use them keep their content keys): cos, sin, and the segment mask of
// segmented row reductions.
#pragma once

#include <cmath>

#include "coda/functors.hpp"

namespace coda {

namespace scalar {
struct cos { CUTLASS_HOST_DEVICE float operator()(float a) const { return cosf(a); } };
struct sin { CUTLASS_HOST_DEVICE float operator()(float a) const { return sinf(a); } };
}  // namespace scalar

template <class T> struct cos : Elementwise<scalar::cos, T> {};
template <class T> struct sin : Elementwise<scalar::sin, T> {};

// keep(col, x) = x where column `col` lies in segment S (mod K) of width W, else 0: the input of
// the S-th of K per-tile reductions that together give a row reduction per W-wide segment.
template <int W, int K, int S>
struct SegmentSelect {
  struct op {
    CUTLASS_HOST_DEVICE float operator()(float col, float x) const {
      return ((int(col) / W) % K == S) ? x : 0.0f;
    }
  };
  template <class T> struct fn : Elementwise<op, T> {};
};

}  // namespace coda

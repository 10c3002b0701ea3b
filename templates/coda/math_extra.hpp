// coda-cutlass: elementwise functors added after the first kernel ABI (kept out of functors.hpp so
// that kernels which do not use them keep their content keys): cos, sin.
#pragma once

#include <cmath>

#include "coda/functors.hpp"

namespace coda {

namespace scalar {

// cos / sin for epilogue angles (e.g. RoPE's pos * freq, up to ~1e5 rad): a two-constant
// Cody-Waite reduction to [-pi, pi] (the 2*pi multiple k * 6.28125 is exact for |k| < 2^16), then
// the hardware approximation, accurate to ~2^-21 there. The absolute error, ~1e-6 + |a| * 6e-8,
// is of the order of the rounding of an fp32 angle itself; libm's cosf/sinf would add a slow
// large-argument path (local memory) to every kernel that uses them.
CUTLASS_HOST_DEVICE float reduce_two_pi(float a) {
  float k = rintf(a * 0.15915494309189535f);
  float r = fmaf(-k, 6.28125f, a);
  return fmaf(-k, 0.0019353071795864769f, r);
}
struct cos {
  CUTLASS_HOST_DEVICE float operator()(float a) const {
#if defined(__CUDA_ARCH__)
    return __cosf(reduce_two_pi(a));
#else
    return cosf(a);
#endif
  }
};
struct sin {
  CUTLASS_HOST_DEVICE float operator()(float a) const {
#if defined(__CUDA_ARCH__)
    return __sinf(reduce_two_pi(a));
#else
    return sinf(a);
#endif
  }
};
}  // namespace scalar

template <class T> struct cos : Elementwise<scalar::cos, T> {};
template <class T> struct sin : Elementwise<scalar::sin, T> {};

}  // namespace coda

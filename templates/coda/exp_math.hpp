// coda-cutlass: e^x, sigmoid and SiLU with the hardware's exp2 and reciprocal (one MUFU op each).
//
// Epilogues apply these to every element of large tiles (SwiGLU forward and backward, softmax
// gradients), where libm's accurate expf (~10 instructions with range reduction) and an IEEE
// division (~10 more, plus a slow-path branch) cost measurable time in the shadow of the GEMM.
// Here: e^a = 2^(a log2 e) with ex2.approx (relative error ~2^-22, plus |a| * 2^-24 from rounding
// the scaled argument: 2e-6 at |a| = 30) and 1/b with rcp.approx (1 ulp); results below 2^-126
// flush to zero. That is 3 orders of magnitude below a bf16/fp16 output's rounding. On the host
// the same functors use IEEE math.
#pragma once

#include <cmath>

#include "coda/functors.hpp"

namespace coda {

namespace scalar {

CUTLASS_HOST_DEVICE float fast_exp(float a) {
#if defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(a * 1.4426950408889634f));
  return e;
#else
  return expf(a);
#endif
}

CUTLASS_HOST_DEVICE float fast_rcp(float a) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
#else
  return 1.0f / a;
#endif
}

struct exp_fast     { CUTLASS_HOST_DEVICE float operator()(float a) const { return fast_exp(a); } };
struct sigmoid_fast { CUTLASS_HOST_DEVICE float operator()(float a) const { return fast_rcp(1.0f + fast_exp(-a)); } };
struct silu_fast    { CUTLASS_HOST_DEVICE float operator()(float a) const { return a * fast_rcp(1.0f + fast_exp(-a)); } };

}  // namespace scalar

template <class T> struct exp_fast : Elementwise<scalar::exp_fast, T> {};
template <class T> struct sigmoid_fast : Elementwise<scalar::sigmoid_fast, T> {};
template <class T> struct silu_fast : Elementwise<scalar::silu_fast, T> {};

}  // namespace coda

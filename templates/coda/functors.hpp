// coda-cutlass: elementwise functors for epilogue visitor Compute nodes.
//
// fusion::Sm90Compute<Fn, ...> instantiates Fn<cutlass::Array<float, N>> and calls it on the node's
// input fragments (already converted to fp32). Each op here is written once for one element and
// lifted to fragments by coda::Elementwise. Math is IEEE fp32 (no fast-math approximations) so the
// torch reference interpreter reproduces it to within a few ulp.
#pragma once

#include <cmath>
#include "cutlass/array.h"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"

namespace coda {

// Applies the scalar op F to every element of the argument fragments.
template <class F, class T>
struct Elementwise {
  template <class... Args>
  CUTLASS_HOST_DEVICE T operator()(Args const&... args) const { return F{}(args...); }
};

template <class F, class T, int N>
struct Elementwise<F, cutlass::Array<T, N>> {
  template <class... Args>
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(Args const&... args) const {
    cutlass::Array<T, N> out;
    F f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      out[i] = f(args[i]...);
    }
    return out;
  }
};

namespace scalar {

struct identity   { CUTLASS_HOST_DEVICE float operator()(float a) const { return a; } };
struct add        { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a + b; } };
struct sub        { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a - b; } };
struct mul        { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a * b; } };
struct div        { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a / b; } };
struct neg        { CUTLASS_HOST_DEVICE float operator()(float a) const { return -a; } };
struct abs        { CUTLASS_HOST_DEVICE float operator()(float a) const { return fabsf(a); } };
// NaN-propagating, like torch.maximum / torch.minimum.
struct maximum {
  CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return (a != a || a > b) ? a : b; }
};
struct minimum {
  CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return (a != a || a < b) ? a : b; }
};
struct exp        { CUTLASS_HOST_DEVICE float operator()(float a) const { return expf(a); } };
struct log        { CUTLASS_HOST_DEVICE float operator()(float a) const { return logf(a); } };
struct sqrt       { CUTLASS_HOST_DEVICE float operator()(float a) const { return sqrtf(a); } };
struct rsqrt      { CUTLASS_HOST_DEVICE float operator()(float a) const { return 1.0f / sqrtf(a); } };
struct reciprocal { CUTLASS_HOST_DEVICE float operator()(float a) const { return 1.0f / a; } };
struct tanh       { CUTLASS_HOST_DEVICE float operator()(float a) const { return tanhf(a); } };
struct sigmoid    { CUTLASS_HOST_DEVICE float operator()(float a) const { return 1.0f / (1.0f + expf(-a)); } };
struct silu       { CUTLASS_HOST_DEVICE float operator()(float a) const { return a / (1.0f + expf(-a)); } };
struct gelu_erf {
  CUTLASS_HOST_DEVICE float operator()(float a) const { return 0.5f * a * (1.0f + erff(a * 0.70710678118654752f)); }
};
struct gelu_tanh {
  CUTLASS_HOST_DEVICE float operator()(float a) const {
    float inner = 0.79788456080286536f * (a + 0.044715f * a * a * a);
    return 0.5f * a * (1.0f + tanhf(inner));
  }
};
struct relu       { CUTLASS_HOST_DEVICE float operator()(float a) const { return a > 0.0f ? a : (a != a ? a : 0.0f); } };
struct square     { CUTLASS_HOST_DEVICE float operator()(float a) const { return a * a; } };
struct pow        { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return powf(a, b); } };
struct lt         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a <  b ? 1.0f : 0.0f; } };
struct le         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a <= b ? 1.0f : 0.0f; } };
struct gt         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a >  b ? 1.0f : 0.0f; } };
struct ge         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a >= b ? 1.0f : 0.0f; } };
struct eq         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a == b ? 1.0f : 0.0f; } };
struct ne         { CUTLASS_HOST_DEVICE float operator()(float a, float b) const { return a != b ? 1.0f : 0.0f; } };
struct select     { CUTLASS_HOST_DEVICE float operator()(float c, float a, float b) const { return c != 0.0f ? a : b; } };

}  // namespace scalar

// The one-template-parameter functors Sm90Compute expects.
#define CODA_ELEMENTWISE(NAME) \
  template <class T> struct NAME : Elementwise<scalar::NAME, T> {};

CODA_ELEMENTWISE(identity)
CODA_ELEMENTWISE(add)
CODA_ELEMENTWISE(sub)
CODA_ELEMENTWISE(mul)
CODA_ELEMENTWISE(div)
CODA_ELEMENTWISE(neg)
CODA_ELEMENTWISE(abs)
CODA_ELEMENTWISE(maximum)
CODA_ELEMENTWISE(minimum)
CODA_ELEMENTWISE(exp)
CODA_ELEMENTWISE(log)
CODA_ELEMENTWISE(sqrt)
CODA_ELEMENTWISE(rsqrt)
CODA_ELEMENTWISE(reciprocal)
CODA_ELEMENTWISE(tanh)
CODA_ELEMENTWISE(sigmoid)
CODA_ELEMENTWISE(silu)
CODA_ELEMENTWISE(gelu_erf)
CODA_ELEMENTWISE(gelu_tanh)
CODA_ELEMENTWISE(relu)
CODA_ELEMENTWISE(square)
CODA_ELEMENTWISE(pow)
CODA_ELEMENTWISE(lt)
CODA_ELEMENTWISE(le)
CODA_ELEMENTWISE(gt)
CODA_ELEMENTWISE(ge)
CODA_ELEMENTWISE(eq)
CODA_ELEMENTWISE(ne)
CODA_ELEMENTWISE(select)

#undef CODA_ELEMENTWISE

}  // namespace coda

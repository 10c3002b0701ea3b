// coda-cutlass: the arithmetic of FP8 quantisation shared by the quantising stores of GEMM epilogues
// (coda/quant_store.hpp) and map kernels: amax (NaN-propagating), the scale of a run, the saturating
// conversion. Bit for bit coda_cutlass/quantization.py; see coda/quant_store.hpp for the semantics.
#pragma once

#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/float8.h"
#include "cutlass/numeric_conversion.h"

namespace coda {
namespace quant {

template <class Element> struct Fp8Max;
template <> struct Fp8Max<cutlass::float_e4m3_t> { static constexpr float value = 448.0f; };
template <> struct Fp8Max<cutlass::float_e5m2_t> { static constexpr float value = 57344.0f; };

// max(a, b) where a NaN wins (torch's amax semantics).
CUTLASS_DEVICE float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// The dequantisation scale and the quantisation multiplier of a run with this amax.
template <class Element, bool Pow2>
CUTLASS_DEVICE void scales(float amax, float& scale, float& inv) {
  constexpr float fmax = Fp8Max<Element>::value;
  if (!(amax <= 3.402823466e38f)) {                       // inf or NaN
    scale = inv = __int_as_float(0x7fc00000);
    return;
  }
  if (amax == 0.0f) {
    scale = inv = 1.0f;
    return;
  }
  if constexpr (Pow2) {
    float v = amax / fmax;
    int e = 0;
    float m = frexpf(v, &e);
    float s = (m == 0.5f) ? v : ldexpf(1.0f, e);
    s = fmaxf(s, 1.17549435e-38f);                        // 2^-126: keeps 1 / s finite
    scale = s;
    inv = 1.0f / s;
  } else {
    scale = amax / fmax;
    inv = fmax / amax;
  }
}

// The max over the lanes that differ in the bits of ``mask`` (all 32 lanes take part).
CUTLASS_DEVICE float shuffle_max(float v, int mask) {
  CUTLASS_PRAGMA_UNROLL
  for (int b = 0; b < 5; ++b) {
    if (mask & (1 << b)) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, 1 << b));
  }
  return v;
}

template <class Element>
CUTLASS_DEVICE Element convert(float x) {
  return cutlass::NumericConverter<Element, float, cutlass::FloatRoundStyle::round_to_nearest>{}(x);
}

}  // namespace quant
}  // namespace coda

// coda-cutlass: the arithmetic of FP8 quantisation shared by the quantising stores of GEMM epilogues
// (coda/quant_store.hpp) and map kernels: amax (NaN-propagating), the scale of a run, the saturating
// conversion. Bit for bit coda_cutlass/quantization.py; see coda/quant_store.hpp for the semantics.
#pragma once

#include <cstdint>
#include <cstring>

#include "cutlass/cutlass.h"
#include "cutlass/float8.h"
#include "cutlass/numeric_conversion.h"

namespace coda {
namespace quant {

template <class Element> struct Fp8Max;
template <> struct Fp8Max<cutlass::float_e4m3_t> { static constexpr float value = 448.0f; static constexpr int exp = 8; };
template <> struct Fp8Max<cutlass::float_e5m2_t> { static constexpr float value = 57344.0f; static constexpr int exp = 15; };

// max(a, b) where a NaN wins (torch's amax semantics): one instruction (FMNMX.NAN, which also
// takes |b| as an operand), where the select form cost three per value and the quantised stores
// are bound by the epilogue's instruction count (docs/RESULTS.md, seventeenth session). A NaN
// result is the canonical NaN: an amax only ever becomes a scale, and a NaN amax a fixed NaN scale.
CUTLASS_DEVICE float nan_max(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

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
    // The smallest power of two s with s * fp8_max >= amax, at least 2^-126 (keeps 1 / s finite),
    // from the bits: fp8_max = 1.75 * 2^E, so for amax = m * 2^e (1 <= m < 2) s = 2^(e - E) when
    // m <= 1.75, else 2^(e - E + 1). The same as rounding amax / fp8_max up to a power of two after
    // an IEEE division (fp32 amax values are 2^-23 apart: none lands between), without a division.
    int const bits = __float_as_int(amax);
    int se = ((bits >> 23) & 0xff) - 127 - Fp8Max<Element>::exp + ((bits & 0x7fffff) > 0x600000 ? 1 : 0);
    se = se < -126 ? -126 : se;
    scale = __int_as_float((se + 127) << 23);
    inv = __int_as_float((127 - se) << 23);
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

// Two values converted by one instruction (the same rounding and saturation as convert, bit for
// bit): the first in the low byte.
template <class Element>
CUTLASS_DEVICE uint16_t convert2(float x0, float x1) {
  cutlass::Array<float, 2> in;
  in[0] = x0;
  in[1] = x1;
  auto out = cutlass::NumericArrayConverter<Element, float, 2, cutlass::FloatRoundStyle::round_to_nearest>{}(in);
  uint16_t bits;
  memcpy(&bits, &out, 2);
  return bits;
}

}  // namespace quant
}  // namespace coda

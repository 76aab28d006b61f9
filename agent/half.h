/* float16 and bfloat16 <-> float32, round to nearest even, overflow to
 * infinity, NaN stays a (quiet) NaN: the one definition that the cpu kernels,
 * the TCP data plane's reductions and the cuda kernels (host and device code)
 * all use, so that every backend rounds the same bits. */
#ifndef MESHD_AGENT_HALF_H
#define MESHD_AGENT_HALF_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define HALF_FN static __host__ __device__ __forceinline__
#else
#define HALF_FN static inline
#endif

HALF_FN float half_bits_float(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

HALF_FN uint32_t half_float_bits(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

HALF_FN float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (!man) {
      bits = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while (!(man & 0x400));
      bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  return half_bits_float(bits);
}

HALF_FN uint16_t float_to_half(float f) {
  uint32_t x = half_float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504 */
  if (ax < 0x38800000u) { /* below the smallest normal half: subnormal or 0 */
    if (ax < 0x33000000u) return (uint16_t)sign; /* under half the smallest subnormal */
    /* value = man * 2^(E-150), in units of the half subnormal 2^-24 */
    uint32_t man = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
    uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = ax - 0x38000000u; /* rebias exponent 127 -> 15, keep 23-bit mantissa */
  uint32_t q = r >> 13, rem = r & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q++;
  return (uint16_t)(sign | q);
}

HALF_FN float bf16_to_float(uint16_t h) { return half_bits_float((uint32_t)h << 16); }

HALF_FN uint16_t float_to_bf16(float f) {
  uint32_t x = half_float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
  x += 0x7fff + ((x >> 16) & 1);
  return (uint16_t)(x >> 16);
}

#endif

/* Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy
 * as 1, 2, 3", SC'11), the counter-based generator behind rand() and randn().
 * Every backend derives the same numbers from (seed, rank, element index), so a
 * tensor drawn on cpu equals the one drawn on cuda bit for bit.
 *
 * One call of the bijection maps a 128-bit counter and a 64-bit key to four
 * 32-bit words: 10 rounds of
 *   (hi0, lo0) = M0 * c[0],  (hi1, lo1) = M1 * c[2]      (64-bit products)
 *   c = { hi1 ^ c[1] ^ k[0],  lo1,  hi0 ^ c[3] ^ k[1],  lo0 }
 * with the key bumped (k[0] += W0, k[1] += W1) between rounds (9 bumps),
 * M0 = 0xD2511F53, M1 = 0xCD9E8D57, W0 = 0x9E3779B9, W1 = 0xBB67AE85 — exactly
 * Random123's philox4x32_R(10, ...).
 *
 * Element g of a draw for (seed s, mesh rank r):
 *   key     = { lo32(s), hi32(s) }
 *   counter = { lo32(g / 4), hi32(g / 4), r, 0 }
 *   word    = out[g % 4]
 * g counts from the draw's offset: 0 when rand()/randn() is given a seed;
 * without one, the backend uses seed PHILOX_DEFAULT_SEED and a running offset
 * (starting at 0 when the backend opens) that advances after each unseeded draw
 * by its element count rounded up to a multiple of 4, so the k-th unseeded draw
 * of an agent is the same on every backend.
 *
 * Uniform (rand): u = (word >> (32 - b)) * 2^-b, exact in the target dtype and
 * in [0, 1), with b = 24 for float32 and float64, 11 for float16 and 8 for
 * bfloat16 (their significand widths, so rounding never reaches 1.0).
 *
 * Normal (randn), Box-Muller on the two words of a pair: lane j = g % 4 pairs
 * with its neighbour, p = j & ~1; u1 = uniform(out[p]), u2 = uniform(out[p+1])
 * with b = 24 for every dtype, and in float64 arithmetic
 *   rad = sqrt(-2 * log(1 - u1)),  theta = 2 * pi * u2,
 *   z = j even ? rad * cos(theta) : rad * sin(theta)
 * rounded to the target dtype (halves through float32). 1 - u1 is in (0, 1],
 * so log never sees 0. Uniforms are bit-exact everywhere; normals depend on the
 * platform's double log/sqrt/sin/cos, which are faithfully rounded on glibc and
 * CUDA, so after rounding to float32 they agree but for rare ties. */
#ifndef MESHD_PHILOX_H
#define MESHD_PHILOX_H

#include <stddef.h>
#include <stdint.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
/* The seed of draws that name none. */
#define PHILOX_DEFAULT_SEED UINT64_C(0x6d65736864)

/* The raw bijection: out = philox4x32_10(ctr, key). */
void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
/* The four words of block `block` (elements 4*block .. 4*block+3) of (seed, rank). */
void philox_block(uint64_t seed, uint32_t rank, uint64_t block, uint32_t out[4]);
/* A word's uniform in [0, 1) from its top `bits` bits (1..24). */
static inline float philox_uniform(uint32_t word, int bits) {
  return (float)(word >> (32 - bits)) * (1.0f / (float)(1u << bits));
}

#endif

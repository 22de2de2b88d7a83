// bf16 <-> fp32 as every Loom kernel converts them. A bf16 is the top half of an fp32's bits, so
// widening is a shift; narrowing rounds to nearest even, as c10::BFloat16 does but for NaN, which
// nothing the kernels round (activations, weights, probabilities) ever is.
//
// Always inlined, and built of builtins only (memcpy, not std::bit_cast): code compiled without
// -ffast-math (elementwise.cpp, parts of decode_step.cpp) would otherwise call them out of line,
// its optimization options differing from the header's.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

[[gnu::always_inline]] inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

[[gnu::always_inline]] inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// 16 bf16 (16-bit lanes) as fp32 lanes.
[[gnu::always_inline]] inline __m512 bf16x16_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The 16 bf16 at p as fp32 lanes; with `live`, only the lanes it sets are read (the others zero).
[[gnu::always_inline]] inline __m512 load_bf16x16(const void* p) {
  return bf16x16_to_float(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}
[[gnu::always_inline]] inline __m512 load_bf16x16(const void* p, __mmask16 live) {
  return bf16x16_to_float(_mm256_maskz_loadu_epi16(live, p));
}

// Each fp32 lane rounded as float_to_bf16 rounds: the bf16 is the lane's top 16 bits (the low 16
// are left over from rounding).
[[gnu::always_inline]] inline __m512i bf16_rounded_lanes(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}
#endif

#if defined(__AVX2__)
// The 8 bf16 at p as fp32 lanes.
[[gnu::always_inline]] inline __m256 load_bf16x8(const void* p) {
  const __m128i bits = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

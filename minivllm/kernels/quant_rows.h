// How quant_gemm.cpp reads one "unit" of a quantized weight row (64 or 128 consecutive k):
// `decode` turns it into kVectors vectors of 32 bf16 (for a scratch copy), `madd`
// multiplies it into two float accumulators with the unit's activations (type X).
//
// Every decoded bf16 holds its stored number exactly, up to a per-row or per-group affine
// map the caller undoes, so each product is exact and only the float32 sums differ from
// formats.reference_linear, in order. `Tail`: the row's last unit, of which only
// `tail_bytes` bytes exist (K % unit != 0); the bytes past them are read as zeros or not
// at all, against zero activations.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>

#include "kernels.h"

namespace quant_rows {

using bf16 = at::BFloat16;

inline __m512bh load_bh(const void* p) { return (__m512bh)_mm512_loadu_si512(p); }

// int8 against float32 x: vpmovsxbd, vcvtdq2ps, vfmadd. On the Xeon (Sapphire Rapids
// class) this was tuned on, vdpbf16ps and vcvtne2ps2bf16 take two cycles each, and this
// route ran ~1.7x faster than converting to bf16 for vdpbf16ps. The tail is 32 k.
struct Int8Rows {
  using X = float;
  static constexpr int kVectors = 2;
  static constexpr int64_t kUnitK = 64, kBytes = 64;
  static inline __m512 floats(const uint8_t* p, int i) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
  }
  template <bool Tail>
  static inline void decode(const uint8_t* p, int, __m512bh* v) {
    v[0] = _mm512_cvtne2ps_pbh(floats(p, 1), floats(p, 0));
    v[1] = Tail ? (__m512bh)_mm512_setzero_si512() : _mm512_cvtne2ps_pbh(floats(p, 3), floats(p, 2));
  }
  template <bool Tail>
  static inline void madd(const uint8_t* p, int, const float* x, __m512& acc0, __m512& acc1) {
    acc0 = _mm512_fmadd_ps(floats(p, 0), _mm512_loadu_ps(x), acc0);
    acc1 = _mm512_fmadd_ps(floats(p, 1), _mm512_loadu_ps(x + 16), acc1);
    if constexpr (!Tail) {
      acc0 = _mm512_fmadd_ps(floats(p, 2), _mm512_loadu_ps(x + 32), acc0);
      acc1 = _mm512_fmadd_ps(floats(p, 3), _mm512_loadu_ps(x + 48), acc1);
    }
  }
};

// The rows that decode cheaply to bf16 multiply with vdpbf16ps.
template <class D>
struct DotBf16 {
  using X = bf16;
  template <bool Tail>
  static inline void madd(const uint8_t* p, int tail_bytes, const bf16* x, __m512& acc0, __m512& acc1) {
    __m512bh v[D::kVectors];
    D::template decode<Tail>(p, tail_bytes, v);
    for (int i = 0; i < D::kVectors; ++i) {
      __m512& acc = i % 2 ? acc1 : acc0;
      acc = dpbf16(acc, v[i], load_bh(x + 32 * i));
    }
  }
};

// int4, 128 k in 64 bytes (formats.pack_int4: byte j of 32-k chunk c holds k 32c + j in
// its low nibble, 32c + j + 16 in its high one). Nibbles n become bf16 bits 0x4300 | n,
// the number 128 + n, without shifting them into place: the low and high nibble planes
// of the 64 bytes are interleaved (vpunpck{l,h}bw) with the byte 0x43. In 128-bit lane c
// (= chunk c) the four vectors hold k 32c + [0, 8), [8, 16), [16, 24), [24, 32):
// prepare_x lays x out the same way. Per group, sum_k (128 + n_k) x_k is turned into
// sum_k (n_k - z) x_k by subtracting (128 + z) sum_k x_k.
struct Int4Rows : DotBf16<Int4Rows> {
  static constexpr int kVectors = 4;
  static constexpr int64_t kUnitK = 128, kBytes = 64;
  template <bool Tail>
  static inline void decode(const uint8_t* p, int tail_bytes, __m512bh* v) {
    const __m512i bytes = Tail ? _mm512_maskz_loadu_epi8((1ull << tail_bytes) - 1, p) : _mm512_loadu_si512(p);
    const __m512i nibble = _mm512_set1_epi8(0x0F), exponent = _mm512_set1_epi8(0x43);
    const __m512i low = _mm512_and_si512(bytes, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    v[0] = (__m512bh)_mm512_unpacklo_epi8(low, exponent);
    v[1] = (__m512bh)_mm512_unpackhi_epi8(low, exponent);
    v[2] = (__m512bh)_mm512_unpacklo_epi8(high, exponent);
    v[3] = (__m512bh)_mm512_unpackhi_epi8(high, exponent);
  }
};

// Exponent-0 e4m3 bytes (lanes `tiny`): m * 2^-9, times 2^8 = m / 2 for m = b & 7, signed.
__attribute__((noinline)) inline __m512i fp8_patch_tiny(__m512i bits, __m512i w, __mmask32 tiny) {
  alignas(64) static const uint16_t half_m[32] = {0x0000, 0x3F00, 0x3F80, 0x3FC0,
                                                   0x4000, 0x4020, 0x4040, 0x4060};
  // vpermw reads the index's low 5 bits: b & 31, which is m where the exponent is 0
  const __m512i magnitude = _mm512_permutexvar_epi16(w, _mm512_load_si512(half_m));
  constexpr int OR_AND = 0xF8;  // ternary logic A | (B & C): the sign of w
  const __m512i patched =
      _mm512_ternarylogic_epi32(magnitude, w, _mm512_set1_epi16(int16_t(0x8000)), OR_AND);
  return _mm512_mask_blend_epi16(tiny, bits, patched);
}

// fp8 e4m3: the sign-extended byte b gives bf16 bits ((b << 4) & 0x87F0) | 0x4000: sign,
// mantissa, and the exponent plus 128 (an OR, no carry), so the e4m3 number times 2^8.
// Exponent-0 bytes (zero and subnormals, m * 2^-9) do not follow that rule and are
// patched from a table, a branch that almost never runs. The tail is 32 k.
struct Fp8Rows : DotBf16<Fp8Rows> {
  static constexpr int kVectors = 2;
  static constexpr int64_t kUnitK = 64, kBytes = 64;
  static inline __m512bh decode32(const uint8_t* p) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    constexpr int AND_OR = 0xEA;  // ternary logic (A & B) | C
    __m512i bits = _mm512_ternarylogic_epi32(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(int16_t(0x87F0)),
                                             _mm512_set1_epi16(0x4000), AND_OR);
    const __mmask32 tiny = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));
    if (__builtin_expect(tiny != 0, 0)) bits = fp8_patch_tiny(bits, w, tiny);
    return (__m512bh)bits;
  }
  template <bool Tail>
  static inline void decode(const uint8_t* p, int, __m512bh* v) {
    v[0] = decode32(p);
    v[1] = Tail ? (__m512bh)_mm512_setzero_si512() : decode32(p + 32);
  }
};

// Rows already decoded into a scratch block: a unit is its NV vectors, one after another.
template <int NV>
struct ScratchRows : DotBf16<ScratchRows<NV>> {
  static constexpr int kVectors = NV;
  static constexpr int64_t kUnitK = 32 * NV, kBytes = 64 * NV;
  template <bool Tail>
  static inline void decode(const uint8_t* p, int, __m512bh* v) {
    for (int i = 0; i < NV; ++i) v[i] = load_bh(p + 64 * i);
  }
};

}  // namespace quant_rows

// AVX-512-BF16 kernels: `vdpbf16ps` multiplies 32 bf16 pairs and accumulates into 16 float32 lanes,
// so one 64-byte line of bf16 weights is one instruction per token, with no widening of the weights.
// Both operands must be bf16: the executor rounds x and the SiLU·up activation to bf16 for these
// kernels (round-to-nearest-even, exactly as torch's .to(bfloat16)), which is what the torch path and
// the GPU path compute with too. float32 weights have no kernel at this level: select_isa() then picks
// the AVX-512F one.
//
// Quantized rows computing in bf16 (bf16-rounded activations), whole blocks of 128 columns at a time, each block's
// partial sums multiplied by its scales (post-scaled):
//   FP8    two lines of codes per block, BF16_P64 activations: word shifts and one `vpternlogd` turn the codes
//          into exact bf16 values times 2^-56 (see "FP8 rows, post-scaled" below);
//   MXFP4, NVFP4  not in bf16: one line of codes per block looked up as integers and multiplied by the
//          activation as 15-bit integers (Q15_LANES) with `vpdpbusd` (see "FP4 rows, integer products" below).
// No weight is rounded: the result is that of the format's exact weights up to float32 summation order (FP4: and
// Q15_LANES' rounding of an activation's small elements). Like every `vdpbf16ps` kernel here, the FP8 kernel
// counts subnormal bf16 activations as zero in the whole blocks.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni,avx2,fma")

#include "kernel_impl.h"

// EDGEMOE_PREFETCH_ROWS / EDGEMOE_PREFETCH_LOCALITY: as kernel_impl.h defines them.

namespace edgemoe {
namespace {

// y[j * ldy + r] = <row r, a[j]>, RB rows x NT tokens of accumulators (4 x 4 = 16 zmm), K walked one
// 64-byte line (32 bf16) per step with the line EDGEMOE_PREFETCH_ROWS rows further down each row's stream
// prefetched into L2; a masked final step covers K % 32 (masked-off lanes load as zero and are never read from memory).
template <int RB, int NT>
inline void micro_dp(const uint16_t* const* rows, int64_t K, const uint16_t* const* a, float* y, int64_t ldy,
                     int64_t pf) {
  __m512 acc[RB][NT];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_ROWS > 0)
        __builtin_prefetch(reinterpret_cast<const char*>(rows[r] + k) + EDGEMOE_PREFETCH_ROWS * pf, 0,
                           EDGEMOE_PREFETCH_LOCALITY);
      wv[r] = _mm512_loadu_si512(rows[r] + k);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) {
      const __m512i av = _mm512_loadu_si512(a[j] + k);
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)av);
    }
  }
  if (k < K) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    __m512i wv[RB];
    for (int r = 0; r < RB; ++r) wv[r] = _mm512_maskz_loadu_epi16(m, rows[r] + k);
    for (int j = 0; j < NT; ++j) {
      const __m512i av = _mm512_maskz_loadu_epi16(m, a[j] + k);
      for (int r = 0; r < RB; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)av);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int RB>
inline void micro_dp_tile(int nt, const uint16_t* const* rows, int64_t K, const uint16_t* const* a, float* y,
                          int64_t ldy, int64_t pf) {
  switch (nt) {
    case 4: return micro_dp<RB, 4>(rows, K, a, y, ldy, pf);
    case 3: return micro_dp<RB, 3>(rows, K, a, y, ldy, pf);
    case 2: return micro_dp<RB, 2>(rows, K, a, y, ldy, pf);
    default: return micro_dp<RB, 1>(rows, K, a, y, ldy, pf);
  }
}

// GemvFn for bf16 weights with bf16 activations (same row streams as kernel_impl.h's gemv, and for one or two tokens
// its rows one after another, as there: kernel_impl.h, "GEMV driver").
void gemv_bf16_dp(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                  float* y, int64_t ldy) {
  constexpr int RB = 4, NT = 4;
  const uint16_t* const* a = reinterpret_cast<const uint16_t* const*>(act);
  const char* base = static_cast<const char*>(w.data);
  const uint16_t* rows[RB];
  if (n <= 2) {
    for (int64_t r = 0; r < nrows; ++r) {
      rows[0] = reinterpret_cast<const uint16_t*>(base + (row0 + r) * w.row_stride_bytes);
      micro_dp_tile<1>(n, rows, K, a, y + r, ldy, w.row_stride_bytes);
    }
    return;
  }
  RowStreams<RB, NT> s(nrows);
  for (int64_t r = 0; r < s.q; ++r) {
    for (int i = 0; i < RB; ++i)
      rows[i] = reinterpret_cast<const uint16_t*>(base + (row0 + s.row(i, r)) * w.row_stride_bytes);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_dp_tile<RB>(nt, rows, K, a + j0, s.yt, RB, w.row_stride_bytes);
      s.scatter(nt, r, y + j0 * ldy, ldy);
    }
  }
  for (int64_t r = s.tail(); r < nrows; ++r) {
    rows[0] = reinterpret_cast<const uint16_t*>(base + (row0 + r) * w.row_stride_bytes);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_dp_tile<1>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, w.row_stride_bytes);
    }
  }
}

// ---------------------------------------------------------------------------- quantized rows
// e4m3 bytes -> float32 (see kernel_impl.h, e4m3_to_f32) scaled by 2^-120: the caller's multiply restores it.
inline __m512 e4m3_raw(__m128i b16) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(b16), 20),
                                              _mm512_set1_epi32(static_cast<int>(0x87f00000u))));
}

// ---------------------------------------------------------------------------- FP8 rows, post-scaled
// FP8 block rows against BF16_P64 activations. An e4m3 byte in the high byte of a 16-bit word, shifted right
// arithmetically by 4, has its sign on bits 11..15 and its exponent and mantissa on bits 4..10; masked with
// 0x87f0 and with 64 added to the exponent field (bit 13, clear after the mask: one `vpternlogd`), the word is
// the bf16 of the code's value times 2^-56, exactly, for every code with a nonzero exponent field (bf16
// exponent field e + 64 = (e - 7) + 127 - 56). A 64-byte line of codes read as 32 words holds element 2i in
// the low byte of word i and element 2i + 1 in the high byte: the words give the odd elements, the words
// shifted left by 8 the even ones, and BF16_P64 (kernels.h) stores each half of a block of 128 with its even
// elements first, then its odd ones, so neither vector is shuffled. Codes with a zero exponent field (zero and
// the subnormals, which the shift would make bf16 subnormals that `vdpbf16ps` reads as zero) lie below 2^-6 of
// their block's scale: rare in a quantized weight (one line in 128-142 held one in a Qwen3-30B-A3B-shaped
// expert quantized from Gaussian weights, 0.011-0.012 % of its codes); a line holding any looks their exact
// values up (m * 2^-65 for mantissa m, bf16 normals) before use.
// With weights times 2^-56 every product with an activation above 2^-61 stays clear of float32's subnormal
// range, which `vdpbf16ps` flushes. Per block of 128 and token: four `vdpbf16ps` (one chain per half, each
// product exact), then the block scale times the partial sums (one FMA; with blocks narrower than 128 columns,
// which no release has, one FMA per half with the scales of its lanes' groups); the row's sum is multiplied
// back by 2^56 at the end, which is exact for sums above float32's subnormal range at that scale (a block
// contributing less than about 2^-70 counts as zero), so the result is that of the format's exact weights
// (unrounded: the torch and GPU paths round code * scale to bf16 first; the two agree within the bf16
// tolerance). The
// last K % 128 elements are taken in element order, 16 at a time, in float32 FMAs. NaN codes (0x7f, 0xff:
// no weight) read as 480. Fixed operation order per (row, token), whatever the row and token counts.
alignas(64) constexpr uint16_t kE4M3ZeroExpBf16[32] = {  // code with exponent field 0, mantissa m: m * 2^-65
    0x0000, 0x1f00, 0x1f80, 0x1fc0, 0x2000, 0x2020, 0x2040, 0x2060};

// Words holding an e4m3 code in the high byte, shifted right arithmetically by 4 (`raw`) -> bf16 of the
// code * 2^-56 for codes with a nonzero exponent field (the rest: fp8_fix).
inline __m512i fp8_words(__m512i raw) {
  return _mm512_ternarylogic_epi32(raw, _mm512_set1_epi16(static_cast<int16_t>(0x87f0)), _mm512_set1_epi16(0x2000),
                                   0xea);  // (raw & 0x87f0) | 0x2000
}

// fp8_words(raw) with the words of zero-exponent codes replaced by their exact values (sign kept).
__attribute__((noinline)) __m512i fp8_fix(__m512i raw, __m512i w) {
  const __mmask32 zero_exp = _mm512_testn_epi16_mask(raw, _mm512_set1_epi16(0x0780));
  const __m512i v = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), _mm512_load_si512(kE4M3ZeroExpBf16));
  return _mm512_mask_mov_epi16(w, zero_exp,  // v | (raw & 0x8000)
                               _mm512_ternarylogic_epi32(v, raw, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xf8));
}

// 64 codes at p (elements k .. k + 63 of a whole block) -> w[0]: the even elements, w[1]: the odd ones, as
// bf16 of the code * 2^-56 (the BF16_P64 order of a half-block).
inline void fp8_line(const uint8_t* p, __m512i* w) {
  const __m512i d = _mm512_loadu_si512(p);
  const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(d, 8), 4), odd = _mm512_srai_epi16(d, 4);
  w[0] = fp8_words(even);
  w[1] = fp8_words(odd);
  if (__builtin_expect(_mm512_testn_epi8_mask(d, _mm512_set1_epi8(0x78)) != 0, 0)) {
    w[0] = fp8_fix(even, w[0]);
    w[1] = fp8_fix(odd, w[1]);
  }
}

struct Fp8Row { const uint8_t* p; const float* s; int shift; };

inline Fp8Row fp8_row(const WeightView& w, int64_t r) {
  return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
          reinterpret_cast<const float*>(static_cast<const char*>(w.scales) + (r / w.scale_rows) * w.scale_row_stride_bytes),
          __builtin_ctz(static_cast<unsigned>(w.scale_cols))};
}

// y[j * ldy + r] = <row r, a[j]> for RB rows x NT tokens: whole blocks of 128 (two lines of codes per row,
// prefetched EDGEMOE_PREFETCH_ROWS rows further down each row's stream into L2), then the last K % 128
// elements in order.
// Wide: one scale per block of 128 (scale_cols >= 128).
template <bool Wide, int RB, int NT>
inline void micro_fp8(const Fp8Row* rows, int64_t K, const uint16_t* const* a, float* y, int64_t ldy, int64_t pf) {
  __m512 acc[RB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i lane4 = _mm512_set_epi32(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  const int64_t blocks_end = K - K % 128;
  for (int64_t k = 0; k < blocks_end; k += 128) {
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_ROWS > 0) {
        const char* c = reinterpret_cast<const char*>(rows[r].p + k) + EDGEMOE_PREFETCH_ROWS * pf;
        __builtin_prefetch(c, 0, EDGEMOE_PREFETCH_LOCALITY);
        __builtin_prefetch(c + 64, 0, EDGEMOE_PREFETCH_LOCALITY);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      __m512i w[4];
      fp8_line(rows[r].p + k, w);
      fp8_line(rows[r].p + k + 64, w + 2);
      __m512 s0, s1;
      if constexpr (Wide) {
        s0 = s1 = _mm512_set1_ps(rows[r].s[k >> rows[r].shift]);
      } else {  // lane i of half h holds elements k + 64h + 4i .. + 3, inside one group of >= 16 columns
        const __m128i sh = _mm_cvtsi32_si128(rows[r].shift);
        const __m512i k0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k)), lane4);
        s0 = _mm512_i32gather_ps(_mm512_srl_epi32(k0, sh), rows[r].s, 4);
        s1 = _mm512_i32gather_ps(_mm512_srl_epi32(_mm512_add_epi32(k0, _mm512_set1_epi32(64)), sh), rows[r].s, 4);
      }
#pragma GCC unroll 4
      for (int j = 0; j < NT; ++j) {
        const uint16_t* aj = a[j] + k;
        __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[0], (__m512bh)_mm512_loadu_si512(aj));
        __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w[2], (__m512bh)_mm512_loadu_si512(aj + 64));
        p0 = _mm512_dpbf16_ps(p0, (__m512bh)w[1], (__m512bh)_mm512_loadu_si512(aj + 32));
        p1 = _mm512_dpbf16_ps(p1, (__m512bh)w[3], (__m512bh)_mm512_loadu_si512(aj + 96));
        if constexpr (Wide)
          acc[r][j] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), s0, acc[r][j]);
        else
          acc[r][j] = _mm512_fmadd_ps(p1, s1, _mm512_fmadd_ps(p0, s0, acc[r][j]));
      }
    }
  }
  for (int64_t k = blocks_end; k < K; k += 16) {  // code * 2^-56 * x exact in float32, then times the scale
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    for (int r = 0; r < RB; ++r) {
      const __m512 w = _mm512_mul_ps(e4m3_raw(_mm_maskz_loadu_epi8(m, rows[r].p + k)), _mm512_set1_ps(0x1p64f));
      const __m512 s = _mm512_set1_ps(rows[r].s[k >> rows[r].shift]);
      for (int j = 0; j < NT; ++j) {
        const __m512 x = _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(m, a[j] + k));
        acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(w, x), s, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]) * 0x1p56f;
}
template <bool Wide>
struct Fp8Dp {  // micro_fp8 as a register kernel
  using Row = Fp8Row;
  using Act = uint16_t;
  static Row row(const WeightView& w, int64_t r) { return fp8_row(w, r); }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_fp8<Wide, RB, NT>(rows, K, a, y, ldy, pf);
  }
};
// GemvFn for FP8 block rows computing in bf16, BF16_P64 activations: tiles of up to 4 tokens, 4 rows for a
// tile of one token, 2 otherwise.
void gemv_fp8(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
              int64_t ldy) {
  const uint16_t* const* a = reinterpret_cast<const uint16_t* const*>(act);
  if (w.scale_cols >= 128)
    token_tiles<Fp8Dp<true>, 4, 2, 2, 2>(w, row0, nrows, K, a, n, y, ldy);
  else
    token_tiles<Fp8Dp<false>, 4, 2, 2, 2>(w, row0, nrows, K, a, n, y, ldy);
}

// ---------------------------------------------------------------------------- FP4 rows, integer products
// MXFP4 and NVFP4 rows against Q15_LANES activations (kernels.h). A 64-byte line of codes holds a block of 128
// elements, element 2i in the low nibble of byte i, 2i + 1 in the high one; masked nibbles looked up with
// `vpshufb` in a table of 2 * e2m1 + 12 (unsigned bytes 0 .. 24) give the even and the odd elements' weights,
// and `vpdpbusd` multiplies them by the activation's limbs four bytes at a time, so that int32 lane j sums
// elements 8j .. 8j + 7 of the block, all in one scale group (NVFP4: 16 elements, lanes 2g and 2g + 1; MXFP4:
// 32, lanes 4g .. 4g + 3). Per line and token: H = sum (w + 12) * hi, L = corr + sum (w + 12) * lo with corr =
// -12 * sum q, so 128 H + L = sum 2 * e2m1 * q exactly (|.| < 2^21: exact in float32 too); one FMA multiplies it
// by the lane's group scale times the activation lane's scale / 2 into the accumulator. Against `vdpbf16ps` on
// bf16 weights this is a third of the vector work per line (two lookups and four `vpdpbusd` instead of four
// `vpermw` and four `vdpbf16ps`), which lets one core consume codes near the rate it can read them
// (docs/benchmarks/cpu_executor.md). The weights are the format's exact ones (MXFP4: e2m1 * 2^(e - 127); NVFP4:
// e2m1 * float32(float(e4m3) * global_scale)); the activation is the bf16 one up to Q15_LANES' rounding of
// elements below 2^-6 of their lane's largest (at 2^-13 of it). Against the bf16 activation that moves an
// expert's output by about 1e-5 of its largest value, which flips a bf16 rounding of the step's intermediate
// values (gate, up, a, y) now and then: within the bf16 tolerance, not bit for bit (tests: a float64 reference
// that rounds the lanes as documented agrees up to float32 summation order; the torch and GPU paths, which
// also round NVFP4 weights to bf16, agree within the bf16 tolerance). The group scale times the lane scale is
// one float32 product: exact unless it leaves float32's normal range (weight scales and activations near
// 2^-100 or below, or products out of float32's range). A lane holding an infinity or NaN gives NaN. The last partial block (K % 128, a multiple of 16) reads its codes and
// scales masked; its lanes past K are zero in the activation. Fixed operation order per (row, token), whatever
// the row and token counts.
alignas(16) constexpr int8_t kE2M1TwiceU8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// A scale format S for micro_fp4 provides Row, row(w, r), step(row, k, n) (the float32 scales of the groups
// of elements [k, k + min(n, 256)) as one vector, lane = group - k / G, lanes past n zero) and G (elements per
// scale: 16 or 32).
// The `vpermps` index spreading a step's scales over the partial lanes of its block u (0 or 1) of 128: lane i
// holds elements 8i .. 8i + 7 of the block, so its group within the step is (128u + 8i) / G.
template <int G>
inline __m512i scale_lanes(int u) {
  const __m512i i = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(16 * u), i), G == 16 ? 1 : 2);
}

struct ScaleNV {
  // g120: global_scale * 2^120 when that is a finite float32 (global_scale < 2^8, every release), else 0
  struct Row { const uint8_t* p; const uint8_t* s; float g; float g120; };
  static constexpr int G = 16;
  static Row row(const WeightView& w, int64_t r) {
    const float g120 = w.global_scale * 0x1p120f;
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, w.global_scale,
            __builtin_isfinite(g120) ? g120 : 0.0f};
  }
  // float32(float(e4m3) * global_scale): the byte decoded exactly times 2^-120, then one rounding multiply by
  // global_scale * 2^120 (both factors exact powers-of-two shifts of the real ones, so the product rounds as
  // float(e4m3) * global_scale does); where that constant overflows, 2^120 restored first
  static __m512 step(const Row& row, int64_t k, int64_t n) {
    const __m128i b = n >= 256 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.s + (k >> 4)))
                               : _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (n >> 4)) - 1u), row.s + (k >> 4));
    if (__builtin_expect(row.g120 != 0.0f, 1)) return _mm512_mul_ps(e4m3_raw(b), _mm512_set1_ps(row.g120));
    return _mm512_mul_ps(_mm512_mul_ps(e4m3_raw(b), _mm512_set1_ps(0x1p120f)), _mm512_set1_ps(row.g));
  }
};
struct ScaleMX {
  struct Row { const uint8_t* p; const uint8_t* s; };
  static constexpr int G = 32;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes};
  }
  // 2^(e - 127) as float32 bits e << 23; e = 0 is the subnormal 2^-127, e = 255 NaN (e8m0_to_f32). A whole step's
  // 8 bytes are tested for those two codes in a general-purpose register (a zero byte of b or of ~b), so the
  // usual step costs two vector instructions; a step holding either takes the masked path.
  static __m512 step(const Row& row, int64_t k, int64_t n) {
    if (__builtin_expect(n >= 256, 1)) {
      uint64_t b;
      std::memcpy(&b, row.s + (k >> 5), 8);
      constexpr uint64_t lo = 0x0101010101010101ull, hi = 0x8080808080808080ull;
      if (__builtin_expect(((((b - lo) & ~b) | ((~b - lo) & b)) & hi) == 0, 1))
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(b))), 23));
    }
    const int groups = n >= 256 ? 8 : static_cast<int>(n >> 5);
    const __mmask16 gm = static_cast<__mmask16>((1u << groups) - 1u);
    const __m512i e = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(gm, row.s + (k >> 5)));
    const __mmask16 zero = _mm512_mask_testn_epi32_mask(gm, e, e);
    const __mmask16 nan = _mm512_mask_cmpeq_epi32_mask(gm, e, _mm512_set1_epi32(255));
    const __m512i v = _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7fc00000)));
  }
};

// y[j * ldy + r] = <row r, a[j]> for RB rows x NT tokens: steps of 256 elements (two 64-byte lines of codes per
// row, prefetched EDGEMOE_PREFETCH_ROWS rows further down each row's stream into L2), each row's scales decoded
// once per step, then its one or two blocks of 128 (the last one possibly partial).
template <class S, int RB, int NT>
inline void micro_fp4(const typename S::Row* rows, int64_t K, const uint8_t* const* a, float* y, int64_t ldy,
                      int64_t pf) {
  __m512 acc[RB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1TwiceU8)));
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t k = 0; k < K; k += 256) {
    __m512 sv[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_ROWS > 0) {
        const char* c = reinterpret_cast<const char*>(rows[r].p + (k >> 1)) + EDGEMOE_PREFETCH_ROWS * pf;
        __builtin_prefetch(c, 0, EDGEMOE_PREFETCH_LOCALITY);
        __builtin_prefetch(c + 64, 0, EDGEMOE_PREFETCH_LOCALITY);
        // the same rows' scales (a code row holds G / 2 bytes per scale byte): a masked or narrow load of them
        // is not followed by the hardware prefetcher, and a miss there stalls the step
        __builtin_prefetch(rows[r].s + k / S::G + EDGEMOE_PREFETCH_ROWS * pf / (S::G / 2), 0,
                           EDGEMOE_PREFETCH_LOCALITY);
      }
      sv[r] = S::step(rows[r], k, K - k);
    }
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      const int64_t kb = k + 128 * u;
      if (kb >= K) break;
      const __mmask64 m = K - kb >= 128 ? ~__mmask64{0} : (__mmask64{1} << ((K - kb) >> 1)) - 1;
      const __m512i li = scale_lanes<S::G>(u);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m512i line = _mm512_maskz_loadu_epi8(m, rows[r].p + (kb >> 1));
        const __m512i we = _mm512_shuffle_epi8(lut, _mm512_and_si512(line, low4));
        const __m512i wo = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(line, 4), low4));
        const __m512 ws = _mm512_permutexvar_ps(li, sv[r]);
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) {
          const uint8_t* blk = a[j] + (kb >> 7) * kQ15BlockBytes;
          __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), we, _mm512_loadu_si512(blk));
          __m512i l = _mm512_dpbusd_epi32(_mm512_loadu_si512(blk + 256), we, _mm512_loadu_si512(blk + 128));
          h = _mm512_dpbusd_epi32(h, wo, _mm512_loadu_si512(blk + 64));
          l = _mm512_dpbusd_epi32(l, wo, _mm512_loadu_si512(blk + 192));
          const __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
          acc[r][j] = _mm512_fmadd_ps(t, _mm512_mul_ps(ws, _mm512_loadu_ps(blk + 320)), acc[r][j]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]);
}
template <class S>
struct Fp4Int {  // micro_fp4 as a register kernel
  using Row = typename S::Row;
  using Act = uint8_t;
  static Row row(const WeightView& w, int64_t r) { return S::row(w, r); }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_fp4<S, RB, NT>(rows, K, a, y, ldy, pf);
  }
};
// ---------------------------------------------------------------------------- Q15_LANES activations, vectorized
// q15_lanes_store (kernels_scalar.cpp) on 32 elements (4 lanes) a vector: the same bytes. Per element: its exponent
// field e and the lane's largest emax (a max over each 128-bit lane), its significand (implicit bit where e > 0)
// shifted left by emax - max(e, 1) - 6 where that is negative, else right by it (at most 15: the significand has
// 8 bits) and rounded half to even, the sign applied; then hi = q >> 7 and lo = q & 127 narrowed to bytes, the even
// elements' from each 32-bit lane's low half and the odd ones' from its high half; the lane's sum of q (corr) and its
// halved power-of-two scale. Lanes holding an infinity or NaN, or only subnormals, are left to the scalar code
// (returns false, nothing written). `blk`: the block holding the group, j0 its first lane (a multiple of 4).
inline bool q15_group32(uint8_t* blk, int64_t j0, const uint16_t* x) {
  const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi16(1);
  const __m512i u = _mm512_loadu_si512(x);
  const __m512i e = _mm512_and_si512(_mm512_srli_epi16(u, 7), _mm512_set1_epi16(0xff));
  __m512i m = _mm512_max_epu16(e, _mm512_shuffle_epi32(e, _MM_PERM_BADC));
  m = _mm512_max_epu16(m, _mm512_shuffle_epi32(m, _MM_PERM_CDAB));
  m = _mm512_max_epu16(m, _mm512_rol_epi32(m, 16));  // emax in every element of its lane
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi16(0x7fff));
  const __mmask32 special = _mm512_cmpeq_epi16_mask(m, _mm512_set1_epi16(0xff)) |
                            _mm512_mask_cmpneq_epi16_mask(_mm512_cmpeq_epi16_mask(m, zero), mag, zero);
  if (special) return false;
  __m512i sig = _mm512_and_si512(u, _mm512_set1_epi16(0x7f));
  sig = _mm512_mask_add_epi16(sig, _mm512_cmpneq_epi16_mask(e, zero), sig, _mm512_set1_epi16(0x80));
  const __m512i d = _mm512_sub_epi16(_mm512_sub_epi16(m, _mm512_max_epu16(e, one)), _mm512_set1_epi16(6));
  const __m512i ls = _mm512_max_epi16(_mm512_sub_epi16(zero, d), zero);
  const __m512i rs = _mm512_min_epi16(_mm512_max_epi16(d, zero), _mm512_set1_epi16(15));
  __m512i v = _mm512_srlv_epi16(_mm512_sllv_epi16(sig, ls), rs);
  const __m512i bit = _mm512_sllv_epi16(one, rs);  // 2^rs; where rs > 0 nothing was shifted left
  const __m512i rem = _mm512_and_si512(sig, _mm512_sub_epi16(bit, one)), half = _mm512_srli_epi16(bit, 1);
  const __mmask32 up = (_mm512_cmpgt_epu16_mask(rem, half) |
                        (_mm512_cmpeq_epi16_mask(rem, half) & _mm512_test_epi16_mask(v, one))) &
                       _mm512_cmpgt_epi16_mask(rs, zero);
  v = _mm512_mask_add_epi16(v, up, v, one);
  const __m512i q = _mm512_mask_sub_epi16(v, _mm512_cmplt_epi16_mask(u, zero), zero, v);
  const __m512i hi = _mm512_srai_epi16(q, 7), lo = _mm512_and_si512(q, _mm512_set1_epi16(0x7f));
  uint8_t* at = blk + 4 * j0;
  auto store16 = [](uint8_t* p, __m128i v16) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v16); };
  store16(at, _mm512_cvtepi32_epi8(hi));
  store16(at + 64, _mm512_cvtepi32_epi8(_mm512_srli_epi32(hi, 16)));
  store16(at + 128, _mm512_cvtepi32_epi8(lo));
  store16(at + 192, _mm512_cvtepi32_epi8(_mm512_srli_epi32(lo, 16)));
  __m512i s = _mm512_madd_epi16(q, _mm512_set1_epi16(1));  // int32 pair sums, then each 128-bit lane's total
  s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_BADC));
  s = _mm512_add_epi32(s, _mm512_shuffle_epi32(s, _MM_PERM_CDAB));
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);  // a lane's int32 0
  store16(at + 256, _mm512_castsi512_si128(
                        _mm512_permutexvar_epi32(first, _mm512_mullo_epi32(s, _mm512_set1_epi32(-12)))));
  const __m512i m32 = _mm512_and_si512(m, _mm512_set1_epi32(0xffff));  // emax as int32, one per 32-bit lane
  __m512i hs = _mm512_slli_epi32(_mm512_sub_epi32(m32, _mm512_set1_epi32(14)), 23);  // 2^(emax - 141) as float bits
  hs = _mm512_mask_sllv_epi32(hs, _mm512_cmplt_epi32_mask(m32, _mm512_set1_epi32(16)), _mm512_set1_epi32(1),
                              _mm512_add_epi32(m32, _mm512_set1_epi32(8)));  // subnormal float32 below emax 16
  hs = _mm512_maskz_mov_epi32(_mm512_cmpneq_epi32_mask(m32, _mm512_setzero_si512()), hs);  // a lane of zeros: 0
  store16(at + 320, _mm512_castsi512_si128(_mm512_permutexvar_epi32(first, hs)));
  return true;
}

// Q15StoreFn of this level: whole groups of 32 elements (aligned in the block) in vectors, the rest (and the
// special lanes) by the scalar code.
void q15_store_avx512(uint8_t* row, int64_t k0, const uint16_t* x, int64_t n) {
  for (int64_t l = 0; l < n;) {
    const int64_t k = k0 + l;
    if (k % 32 == 0 && n - l >= 32 && q15_group32(row + (k / 128) * kQ15BlockBytes, (k % 128) / 8, x + l)) {
      l += 32;
      continue;
    }
    const int64_t m = std::min<int64_t>(n - l, 32 - k % 32);  // to the next group (k is a multiple of 8)
    q15_lanes_store(row, k, x + l, m);
    l += m;
  }
}

// GemvFn for MXFP4 (S = ScaleMX) and NVFP4 (ScaleNV) rows, Q15_LANES activations: tiles of up to 4 tokens, 4 rows
// for a tile of one token, 2 otherwise (the register file).
template <class S>
void gemv_fp4(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
              float* y, int64_t ldy) {
  token_tiles<Fp4Int<S>, 4, 2, 2, 2>(w, row0, nrows, K, reinterpret_cast<const uint8_t* const*>(act), n, y, ldy);
}

// The read test needs no bf16 instruction: the AVX-512F sum is reused through kernels_avx512().

}  // namespace
}  // namespace edgemoe

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx512bf16() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    const SumFn sum = kernels_avx512().by_format[int(WeightFormat::F32)].sum_f32;
    t.by_format[int(WeightFormat::BF16)] = {&gemv_bf16_dp, ActFormat::BF16, sum};
    t.by_format[int(WeightFormat::FP8_E4M3_BLOCK)] = {&gemv_fp8, ActFormat::BF16_P64, sum};
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_fp4<ScaleMX>, ActFormat::Q15_LANES, sum, kFeatAvx512Vnni,
                                             &q15_store_avx512};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_fp4<ScaleNV>, ActFormat::Q15_LANES, sum, kFeatAvx512Vnni,
                                             &q15_store_avx512};
    return t;
  }();
  return k;
}

}  // namespace edgemoe

#else

namespace edgemoe {
const IsaKernels& kernels_avx512bf16() {
  static const IsaKernels k{};
  return k;
}
}  // namespace edgemoe

#endif

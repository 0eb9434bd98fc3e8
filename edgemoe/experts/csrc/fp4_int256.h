// The FP4 integer kernels on 256-bit registers, for the avx2vnni and avx2int levels (kernels_avx2vnni.cpp,
// kernels_avx2int.cpp): the same integer products as the avx512bf16 level's FP4 kernels (kernels_avx512bf16.cpp,
// "FP4 rows, integer products"), on half a line at a time: the Q15_LANES activation (kernels.h) keeps lanes 0..7 of a
// block in the first 32 bytes of each of its 64-byte sections and lanes 8..15 in the second, so a 32-byte half
// of a line of codes meets its activation without a shuffle. Per half-line and token: two `vpshufb` lookups
// (shared by the tokens), four unsigned-by-signed byte dot products into int32 lanes (`Dot::dp`: AVX-VNNI's
// `vpdpbusd`, or AVX2's `vpmaddubsw` + `vpmaddwd` + `vpaddd`, exact here: a pair of products is at most
// 2 * 24 * 128 in magnitude, inside int16), a shift and an add joining the limbs, one conversion and one FMA with
// the lane's group scale times its activation scale. Results equal the avx512bf16 level's up to float32
// summation order, and the two levels' results are equal.
//
// Included by each level's source file inside its own target region, after kernel_impl.h and after its `Dot`
// (in edgemoe's anonymous namespace): each file instantiates its own copy for its instruction set.
#pragma once

namespace edgemoe {
namespace {

alignas(16) constexpr int8_t kE2M1TwiceU8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// Group scales of one block of 128 elements of a row as float32 lanes: MXFP4 lanes 0..3 (groups of 32,
// 2^(e - 127)), NVFP4 lanes 0..7 (groups of 16, float32(float(e4m3) * global_scale)). `s` points at the block's
// scale bytes (a zero-padded copy for the partial last block).
struct Fp4IntRow {
  const uint8_t* p;  // codes
  const uint8_t* s;  // scale bytes
  float g;           // NVFP4 global scale
  float g120;        // global_scale * 2^120 where finite (every release), else 0
};

template <bool NV>
inline __m256 block_scales(const Fp4IntRow& row, const uint8_t* s) {
  if constexpr (NV) {  // e4m3 bits placed at float32 bits 20..26: the value times 2^-120 (kernel_impl.h, e4m3_to_f32)
    const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
    const __m256 raw = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(static_cast<int>(0x87f00000u))));
    if (__builtin_expect(row.g120 != 0.0f, 1)) return _mm256_mul_ps(raw, _mm256_set1_ps(row.g120));
    return _mm256_mul_ps(_mm256_mul_ps(raw, _mm256_set1_ps(0x1p120f)), _mm256_set1_ps(row.g));
  } else {
    uint32_t b4;
    std::memcpy(&b4, s, 4);
    constexpr uint32_t lo = 0x01010101u, hi = 0x80808080u;
    if (__builtin_expect(((((b4 - lo) & ~b4) | ((~b4 - lo) & b4)) & hi) == 0, 1))  // no byte 0 or 255
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(b4))), 23));
    const ScaleTables& t = scale_tables();  // 2^-127 (a float32 subnormal) and NaN
    return _mm256_setr_ps(t.e8m0[s[0]], t.e8m0[s[1]], t.e8m0[s[2]], t.e8m0[s[3]], 0.0f, 0.0f, 0.0f, 0.0f);
  }
}

// The 8 lanes of half h of a block: lane j of the half holds elements 64h + 8j .. + 7, in group (64h + 8j) / G.
template <bool NV>
inline __m256 half_scales(__m256 s, int h) {
  const __m256i idx = NV ? (h ? _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7) : _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))
                         : (h ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3) : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  return _mm256_permutevar8x32_ps(s, idx);
}

// y[j * ldy + r] = <row r, a[j]> for RB rows x NT tokens over whole blocks of 128 (the last one partial: its codes
// copied into a zero-padded line first, so nothing past the row is read).
template <class Dot, bool NV, int RB, int NT>
inline void micro_fp4_int256(const Fp4IntRow* rows, int64_t K, const uint8_t* const* a, float* y, int64_t ldy,
                             int64_t pf) {
  __m256 acc[RB][NT];  // the loops over rows, halves and tokens unrolled: the accumulators stay in registers
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1TwiceU8)));
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  constexpr int G = NV ? 16 : 32;
  alignas(32) uint8_t tail[64], tail_s[8];
  for (int64_t k = 0; k < K; k += 128) {
    const int64_t b = k >> 7;
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_ROWS > 0)
        __builtin_prefetch(reinterpret_cast<const char*>(rows[r].p + (k >> 1)) + EDGEMOE_PREFETCH_ROWS * pf, 0,
                           EDGEMOE_PREFETCH_LOCALITY);
      const uint8_t* codes = rows[r].p + (k >> 1);
      const uint8_t* scales = rows[r].s + k / G;
      if (K - k < 128) {  // the partial last block: its codes and scales copied, the rest zero (weight 0, scale 0)
        std::memset(tail, 0, sizeof tail);
        std::memcpy(tail, codes, static_cast<size_t>((K - k) >> 1));
        std::memset(tail_s, 0, sizeof tail_s);
        std::memcpy(tail_s, scales, static_cast<size_t>((K - k) / G));
        codes = tail;
        scales = tail_s;
      }
      const __m256 sc = block_scales<NV>(rows[r], scales);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * h));
        const __m256i we = _mm256_shuffle_epi8(lut, _mm256_and_si256(line, low4));
        const __m256i wo = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(line, 4), low4));
        const __m256 ws = half_scales<NV>(sc, h);
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) {
          const uint8_t* blk = a[j] + b * kQ15BlockBytes + 32 * h;
          auto ld = [&](int off) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + off)); };
          __m256i hi = Dot::dp(_mm256_setzero_si256(), we, ld(0));
          __m256i lo = Dot::dp(ld(256), we, ld(128));
          hi = Dot::dp(hi, wo, ld(64));
          lo = Dot::dp(lo, wo, ld(192));
          const __m256 t = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 7), lo));
          const __m256 as = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + 320));
          acc[r][j] = _mm256_fmadd_ps(t, _mm256_mul_ps(ws, as), acc[r][j]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NT; ++j) {
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[r][j]), _mm256_extractf128_ps(acc[r][j], 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      y[j * ldy + r] = _mm_cvtss_f32(s);
    }
}

template <class Dot, bool NV>
struct Fp4Int256 {  // micro_fp4_int256 as a register kernel
  using Row = Fp4IntRow;
  using Act = uint8_t;
  static Row row(const WeightView& w, int64_t r) {
    const float g120 = w.global_scale * 0x1p120f;
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, w.global_scale,
            __builtin_isfinite(g120) ? g120 : 0.0f};
  }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_fp4_int256<Dot, NV, RB, NT>(rows, K, a, y, ldy, pf);
  }
};

// GemvFn for MXFP4 (NV false) and NVFP4 rows, Q15_LANES activations: tiles of up to 4 tokens, 4 rows for a tile of
// one token, 2 otherwise (16 ymm registers).
template <class Dot, bool NV>
void gemv_fp4_int256(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                     float* y, int64_t ldy) {
  token_tiles<Fp4Int256<Dot, NV>, 4, 2, 2, 2>(w, row0, nrows, K, reinterpret_cast<const uint8_t* const*>(act), n, y,
                                              ldy);
}

}  // namespace
}  // namespace edgemoe

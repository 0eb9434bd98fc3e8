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

// ---------------------------------------------------------------------------- Q15_LANES activations, vectorized
// q15_lanes_store (kernels_scalar.cpp) on one lane of 8 elements a vector (8 x int32): the same bytes, by the steps
// of the avx512bf16 level's store (kernels_avx512bf16.cpp, q15_group32) in 32-bit lanes, as AVX2 has variable
// shifts of 32-bit lanes only. The lane's largest exponent field emax by shuffles; each element's significand
// (implicit bit where its field e > 0) shifted left by emax - max(e, 1) - 6 where that is negative, else right by
// it (at most 15) and rounded half to even, the sign applied; hi = q >> 7 and lo = q & 127 as bytes, gathered by
// one `vpshufb` and one 16-bit unpack into the even and odd elements' 4-byte slots; the lane's sum of q (corr) and
// its halved power-of-two scale. A lane holding an infinity or NaN, or no normal number (zeros, subnormals), is
// left to the scalar code (returns false, nothing written). `blk`: the block holding the lane, j the lane (0..15).
inline bool q15_lane8(uint8_t* blk, int64_t j, const uint16_t* x) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi32(1);
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(u, 7), _mm256_set1_epi32(0xff));
  __m256i m = _mm256_max_epi32(e, _mm256_shuffle_epi32(e, 0x4e));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0xb1));
  m = _mm256_max_epi32(m, _mm256_permute2x128_si256(m, m, 1));
  const int emax = _mm256_cvtsi256_si32(m);
  if (emax == 255 || emax == 0) return false;
  const __m256i sig = _mm256_add_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7f)),
                                       _mm256_and_si256(_mm256_cmpgt_epi32(e, zero), _mm256_set1_epi32(0x80)));
  const __m256i d = _mm256_sub_epi32(_mm256_set1_epi32(emax - 6), _mm256_max_epi32(e, one));
  const __m256i ls = _mm256_max_epi32(_mm256_sub_epi32(zero, d), zero);
  const __m256i rs = _mm256_min_epi32(_mm256_max_epi32(d, zero), _mm256_set1_epi32(15));
  __m256i v = _mm256_srlv_epi32(_mm256_sllv_epi32(sig, ls), rs);
  const __m256i bit = _mm256_sllv_epi32(one, rs);  // 2^rs; where rs > 0 nothing was shifted left
  const __m256i rem = _mm256_and_si256(sig, _mm256_sub_epi32(bit, one)), half = _mm256_srli_epi32(bit, 1);
  const __m256i odd = _mm256_cmpeq_epi32(_mm256_and_si256(v, one), one);
  const __m256i up = _mm256_and_si256(
      _mm256_or_si256(_mm256_cmpgt_epi32(rem, half), _mm256_and_si256(_mm256_cmpeq_epi32(rem, half), odd)),
      _mm256_cmpgt_epi32(rs, zero));
  v = _mm256_sub_epi32(v, up);                                         // up is -1 where rounded up
  const __m256i neg = _mm256_srai_epi32(_mm256_slli_epi32(u, 16), 31);  // the sign bit as a mask
  const __m256i q = _mm256_sub_epi32(_mm256_xor_si256(v, neg), neg);
  // bytes 0 and 1 of each int32: hi and lo; per 128-bit half, (hi of elements 0, 2), (hi 1, 3), (lo 0, 2), (lo 1, 3)
  const __m256i hl = _mm256_or_si256(_mm256_and_si256(_mm256_srai_epi32(q, 7), _mm256_set1_epi32(0xff)),
                                     _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(0x7f)), 8));
  const __m256i g = _mm256_shuffle_epi8(
      hl, _mm256_setr_epi8(0, 8, 4, 12, 1, 9, 5, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, 4, 12, 1, 9, 5, 13, -1, -1,
                           -1, -1, -1, -1, -1, -1));
  // hi of the even elements 0, 2, 4, 6, of the odd ones, lo of the even ones, of the odd ones: 4 bytes each
  const __m128i b = _mm_unpacklo_epi16(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1));
  uint8_t* at = blk + 4 * j;
  const int32_t words[4] = {_mm_cvtsi128_si32(b), _mm_extract_epi32(b, 1), _mm_extract_epi32(b, 2),
                            _mm_extract_epi32(b, 3)};
  for (int w = 0; w < 4; ++w) std::memcpy(at + 64 * w, &words[w], 4);
  __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
  sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1));
  const int32_t corr = -12 * _mm_cvtsi128_si32(sum);
  const uint32_t half_scale = emax > 15 ? static_cast<uint32_t>(emax - 14) << 23 : 1u << (emax + 8);  // 2^(emax - 141)
  std::memcpy(at + 256, &corr, 4);
  std::memcpy(at + 320, &half_scale, 4);
  return true;
}

// Q15StoreFn of the avx2vnni and avx2int levels: whole lanes of 8 in vectors, the rest (a partial last lane, the
// special lanes) by the scalar code.
void q15_store_avx2(uint8_t* row, int64_t k0, const uint16_t* x, int64_t n) {
  for (int64_t l = 0; l < n; l += 8) {
    const int64_t k = k0 + l;
    if (n - l >= 8 && q15_lane8(row + (k / 128) * kQ15BlockBytes, (k % 128) / 8, x + l)) continue;
    q15_lanes_store(row, k, x + l, std::min<int64_t>(n - l, 8));
  }
}

}  // namespace
}  // namespace edgemoe

// AVX-512-BF16 kernels: `vdpbf16ps` multiplies 32 bf16 pairs and accumulates into 16 float32 lanes,
// so one 64-byte line of bf16 weights is one instruction per token, with no widening of the weights.
// Both operands must be bf16: the executor rounds x and the SiLU·up activation to bf16 for these
// kernels (round-to-nearest-even, exactly as torch's .to(bfloat16)), which is what the torch path and
// the GPU path compute with too. float32 weights have no kernel at this level: select_isa() then picks
// the AVX-512F one.
//
// Quantized rows computing in bf16, fed to `vdpbf16ps` with bf16 activations in the BF16_Q128 order
// (kernels.h), whole blocks of 128 columns at a time:
//   FP8    two lines of codes per block: word shifts place each e4m3 byte's sign and magnitude bits where a
//          float32 wants them (no widening shuffle), one exact multiply by the block scale, and
//          `vcvtne2ps2bf16` (nearest even): the bf16 values bf16(float32(code * scale)) of the torch path;
//          the last K % 128 elements in order through the chunk decoder (DecFP8);
//   MXFP4, NVFP4  one line of codes per block, looked up unscaled in a fixed e2m1 -> bf16 table, the block's
//          partial sums multiplied by their groups' scales (post-scaled: see "FP4 rows, post-scaled" below).
// FP8 products are float32-rounded exactly as the reference, and `vcvtne2ps2bf16` rounds to nearest even as
// .to(bfloat16) does. Like `vdpbf16ps` itself, these instructions treat float32 subnormal inputs as zero:
// FP8 weights below 2^-126 in magnitude (which no release has) count as zero here.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

#include "kernel_impl.h"

// EDGEMOE_PREFETCH_BLOCKS / EDGEMOE_PREFETCH_LOCALITY: as kernel_impl.h defines them.

namespace edgemoe {
namespace {

// y[j * ldy + r] = <row r, a[j]>, RB rows x NT tokens of accumulators (4 x 4 = 16 zmm), K walked one
// 64-byte line (32 bf16) per step with the line EDGEMOE_PREFETCH_BLOCKS row blocks ahead prefetched into
// L2; a masked final step covers K % 32 (masked-off lanes load as zero and are never read from memory).
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
      if constexpr (EDGEMOE_PREFETCH_BLOCKS > 0)
        __builtin_prefetch(reinterpret_cast<const char*>(rows[r] + k) + EDGEMOE_PREFETCH_BLOCKS * pf, 0,
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

// GemvFn for bf16 weights with bf16 activations (same blocking as kernel_impl.h's gemv).
void gemv_bf16_dp(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                  float* y, int64_t ldy) {
  constexpr int RB = 4, NT = 4;
  const uint16_t* const* a = reinterpret_cast<const uint16_t* const*>(act);
  const char* base = static_cast<const char*>(w.data);
  const uint16_t* rows[RB];
  int64_t r = 0;
  for (; r + RB <= nrows; r += RB) {
    for (int i = 0; i < RB; ++i) rows[i] = reinterpret_cast<const uint16_t*>(base + (row0 + r + i) * w.row_stride_bytes);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_dp_tile<RB>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, RB * w.row_stride_bytes);
    }
  }
  for (; r < nrows; ++r) {
    rows[0] = reinterpret_cast<const uint16_t*>(base + (row0 + r) * w.row_stride_bytes);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_dp_tile<1>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, w.row_stride_bytes);
    }
  }
}

// ---------------------------------------------------------------------------- quantized rows
inline __mmask32 mask32(int n) { return static_cast<__mmask32>((1ull << n) - 1ull); }  // 0 < n < 32

// e4m3 bytes -> float32 (see kernel_impl.h, e4m3_to_f32) scaled by 2^-120: the caller's multiply restores it.
inline __m512 e4m3_raw(__m128i b16) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(b16), 20),
                                              _mm512_set1_epi32(static_cast<int>(0x87f00000u))));
}

// The FP8 row decoder (the last K % 128 elements of a row, in order) provides: Row, row(w, r), kLine (elements
// of 64 bytes of codes), Line and line(row, k, n, L) (per-line state: none for FP8), chunk(row, k, L, u) (32
// bf16 weights, elements [k, k + 32)), tail(row, k, n, L, u) (the first n < 32 of them, the rest zero or
// finite) and addr(row, k) (prefetch).
struct DecFP8 {
  struct Row { const uint8_t* p; const float* s; int shift; };
  static constexpr int kLine = 64;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            reinterpret_cast<const float*>(static_cast<const char*>(w.scales) +
                                           (r / w.scale_rows) * w.scale_row_stride_bytes),
            __builtin_ctz(static_cast<unsigned>(w.scale_cols))};
  }
  static __m512i convert(__m512 lo, __m512 hi, float sc) {
    // code * 2^-120 * (sc * 2^120) is the product code * sc, rounded once, while sc * 2^120 is exact;
    // a scale >= 2^8 (far above any release's) takes the two multiplies instead.
    if (__builtin_expect(sc < 0x1p8f && sc > -0x1p8f, 1)) {
      const __m512 m = _mm512_set1_ps(sc * 0x1p120f);
      lo = _mm512_mul_ps(lo, m);
      hi = _mm512_mul_ps(hi, m);
    } else {
      const __m512 e = _mm512_set1_ps(0x1p120f), m = _mm512_set1_ps(sc);
      lo = _mm512_mul_ps(_mm512_mul_ps(lo, e), m);
      hi = _mm512_mul_ps(_mm512_mul_ps(hi, e), m);
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0..15 from lo
  }
  struct Line {};
  static void line(const Row&, int64_t, int64_t, Line&) {}
  static __m512i chunk(const Row& row, int64_t k, const Line&, int) {
    const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.p + k));
    const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.p + k + 16));
    return convert(e4m3_raw(b0), e4m3_raw(b1), row.s[k >> row.shift]);
  }
  static __m512i tail(const Row& row, int64_t k, int n, const Line&, int) {
    const __m256i b = _mm256_maskz_loadu_epi8(mask32(n), row.p + k);
    return convert(e4m3_raw(_mm256_castsi256_si128(b)), e4m3_raw(_mm256_extracti128_si256(b, 1)),
                   row.s[k >> row.shift]);
  }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + k); }
};

// ---------------------------------------------------------------------------- whole 128-element blocks
// A block of 128 elements at k (k % 128 == 0) is decoded without any shuffle into element order: the
// activation is in the BF16_Q128 layout (kernels.h), where chunk c of the block (32 bf16 at offset 32c)
// holds elements k + 4i + c, i < 32. A step decoder S (derived from the row decoder D above, whose
// chunk/tail serve the last K % 128 elements, in order) provides kChunks and step(row, k, w), which
// writes kChunks final bf16 weight vectors (w[c] pairs with activation chunk c % 4), accumulated straight
// into the (row, token) accumulator.

// FP8 block-128: two lines of codes (128 elements, one block column). As 16-bit words, word 2i of a line
// holds elements 4i (low byte) and 4i + 1, word 2i + 1 elements 4i + 2 and 4i + 3; an arithmetic word
// shift right by 4 puts the high byte's sign on bit 15 and its 7 magnitude bits on bits 4..10, i.e. the
// dword's high word at float32 bits 20..26 with the sign on bit 31 (e4m3_to_f32's placement): element
// 4i + 3 directly, 4i + 1 after a dword shift left by 16; the low bytes likewise after a word shift left
// by 8. Then the exact product with the block scale, rounded to bf16 nearest-even (DecFP8::convert):
// chunk c = elements 4i + c of the first line (words 0..15) and of the second (16..31).
struct StepFP8 : DecFP8 {
  static constexpr int kChunks = 4, kLines = 2;
  static void raw4(const uint8_t* p, __m512* e) {
    const __m512i d = _mm512_loadu_si512(p);
    const __m512i m = _mm512_set1_epi32(static_cast<int>(0x87f00000u));
    const __m512i hi = _mm512_srai_epi16(d, 4), lo = _mm512_srai_epi16(_mm512_slli_epi16(d, 8), 4);
    e[0] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(lo, 16), m));
    e[1] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(hi, 16), m));
    e[2] = _mm512_castsi512_ps(_mm512_and_si512(lo, m));
    e[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, m));
  }
  static void step(const Row& row, int64_t k, __m512i* w) {  // one scale: scale_cols >= 128
    __m512 e0[4], e1[4];
    raw4(row.p + k, e0);
    raw4(row.p + k + 64, e1);
    const float sc = row.s[k >> row.shift];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) w[c] = convert(e0[c], e1[c], sc);
  }
};

// FP8 with blocks narrower than 128 columns (16, 32 or 64; no release has them): a scale per lane,
// (code * 2^120) * scale as in DecFP8::convert's general case.
struct StepFP8Narrow : StepFP8 {
  __attribute__((noinline)) static void step(const Row& row, int64_t k, __m512i* w) {
    __m512 e0[4], e1[4];
    raw4(row.p + k, e0);
    raw4(row.p + k + 64, e1);
    const __m512 e = _mm512_set1_ps(0x1p120f);
    for (int c = 0; c < 4; ++c) {
      alignas(64) float s0[16], s1[16];
      for (int i = 0; i < 16; ++i) {
        s0[i] = row.s[(k + 4 * i + c) >> row.shift];
        s1[i] = row.s[(k + 64 + 4 * i + c) >> row.shift];
      }
      w[c] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_mul_ps(e1[c], e), _mm512_load_ps(s1)),
                                          _mm512_mul_ps(_mm512_mul_ps(e0[c], e), _mm512_load_ps(s0)));
    }
  }
};

// y[j * ldy + r] = <row r, a[j]> for RB rows x NT tokens, activations in the BF16_Q128 layout: whole blocks
// of 128 through S::step (each row's block decoded once for all NT tokens; its lines EDGEMOE_PREFETCH_BLOCKS
// row blocks ahead prefetched into L2), then the last K % 128 elements in order through the row decoder:
// chunks of 32 and one masked chunk. Fixed operation order per (r, j), whatever RB and NT.
template <class S, int RB, int NT>
inline void micro_q(const typename S::Row* rows, int64_t K, const uint16_t* const* a, float* y, int64_t ldy,
                    int64_t pf) {
  __m512 acc[RB][NT];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t full = K - K % 128;
  int64_t k = 0;
  for (; k < full; k += 128) {
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_BLOCKS > 0)
#pragma GCC unroll 2
        for (int l = 0; l < S::kLines; ++l)
          __builtin_prefetch(S::addr(rows[r], k) + 64 * l + EDGEMOE_PREFETCH_BLOCKS * pf, 0,
                             EDGEMOE_PREFETCH_LOCALITY);
    }
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      __m512i w[S::kChunks];
      S::step(rows[r], k, w);
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) {
        const uint16_t* aj = a[j] + k;
#pragma GCC unroll 8
        for (int c = 0; c < S::kChunks; ++c)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)w[c], (__m512bh)_mm512_loadu_si512(aj + 32 * (c & 3)));
      }
    }
  }
  if (k < K) {  // the last K % 128 elements, in order
    typename S::Line ls[RB];
    for (int r = 0; r < RB; ++r) S::line(rows[r], k, K - k, ls[r]);
    const int64_t k_line = k;
    for (; k + 32 <= K; k += 32) {
      __m512i wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = S::chunk(rows[r], k, ls[r], static_cast<int>((k - k_line) >> 5));
      for (int j = 0; j < NT; ++j) {
        const __m512i av = _mm512_loadu_si512(a[j] + k);
        for (int r = 0; r < RB; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)av);
      }
    }
    if (k < K) {  // masked: activation lanes past K load as zero (and the weights there are finite)
      const int n = static_cast<int>(K - k);
      __m512i wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = S::tail(rows[r], k, n, ls[r], static_cast<int>((k - k_line) >> 5));
      for (int j = 0; j < NT; ++j) {
        const __m512i av = _mm512_maskz_loadu_epi16(mask32(n), a[j] + k);
        for (int r = 0; r < RB; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[r], (__m512bh)av);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]);
}

// A register kernel M for rows_tile / token_tiles provides Row, Act (the activation element type),
// row(w, r) and run<RB, NT>(rows, K, act, y, ldy, pf): RB rows x NT tokens (pf: bytes of a row block).
// Row blocks of RB rows for a tile of nt <= NT tokens (templates instantiated only up to NT), then the
// nrows % RB row tail one row at a time.
template <class M, int RB, int NT>
inline void rows_tile(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const typename M::Act* const* a,
                      float* y, int64_t ldy) {
  typename M::Row rows[RB];
  int64_t r = 0;
  for (; r + RB <= nrows; r += RB) {
    for (int i = 0; i < RB; ++i) rows[i] = M::row(w, row0 + r + i);
    M::template run<RB, NT>(rows, K, a, y + r, ldy, RB * w.row_stride_bytes);
  }
  for (; r < nrows; ++r) {
    rows[0] = M::row(w, row0 + r);
    M::template run<1, NT>(rows, K, a, y + r, ldy, w.row_stride_bytes);
  }
}

// Tokens in tiles of up to 4; a tile of nt tokens takes row blocks of RB<nt> rows.
template <class M, int RB1, int RB2, int RB3, int RB4>
inline void token_tiles(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const typename M::Act* const* a,
                        int n, float* y, int64_t ldy) {
  for (int j0 = 0; j0 < n; j0 += 4) {
    const int nt = n - j0 < 4 ? n - j0 : 4;
    float* yt = y + j0 * ldy;
    switch (nt) {
      case 1: rows_tile<M, RB1, 1>(w, row0, nrows, K, a + j0, yt, ldy); break;
      case 2: rows_tile<M, RB2, 2>(w, row0, nrows, K, a + j0, yt, ldy); break;
      case 3: rows_tile<M, RB3, 3>(w, row0, nrows, K, a + j0, yt, ldy); break;
      default: rows_tile<M, RB4, 4>(w, row0, nrows, K, a + j0, yt, ldy); break;
    }
  }
}

// micro_q over the step decoder S, as a register kernel.
template <class S>
struct QuantDp {
  using Row = typename S::Row;
  using Act = uint16_t;
  static Row row(const WeightView& w, int64_t r) { return S::row(w, r); }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_q<S, RB, NT>(rows, K, a, y, ldy, pf);
  }
};

// Dequantizes rows [row0, row0 + nr) (nr <= 4) into bf16
// rows of `buf` (K elements each, `ld` apart) in the activation's BF16_Q128 order: the chunks micro_q feeds
// to `vdpbf16ps`, in the same order, so micro_dp over the buffer computes the same bits.
template <class S>
inline void decode_rows(const WeightView& w, int64_t row0, int nr, int64_t K, uint16_t* buf, int64_t ld) {
  typename S::Line ls;
  const int64_t full = K - K % 128;
  for (int i = 0; i < nr; ++i) {
    const typename S::Row row = S::row(w, row0 + i);
    uint16_t* dst = buf + i * ld;
    int64_t k = 0;
    for (; k < full; k += 128) {
      for (int l = 0; l < S::kLines; ++l)
        __builtin_prefetch(S::addr(row, k) + 64 * l + EDGEMOE_PREFETCH_BLOCKS * 4 * w.row_stride_bytes, 0,
                           EDGEMOE_PREFETCH_LOCALITY);
      __m512i wv[S::kChunks];
      S::step(row, k, wv);
      for (int c = 0; c < S::kChunks; ++c) _mm512_storeu_si512(dst + k + 32 * c, wv[c]);
    }
    if (k < K) S::line(row, k, K - k, ls);
    const int64_t k_line = k;
    for (; k + 32 <= K; k += 32)
      _mm512_storeu_si512(dst + k, S::chunk(row, k, ls, static_cast<int>((k - k_line) >> 5)));
    if (k < K) {
      const int n = static_cast<int>(K - k);
      _mm512_mask_storeu_epi16(dst + k, mask32(n), S::tail(row, k, n, ls, static_cast<int>((k - k_line) >> 5)));
    }
  }
}

// Largest K whose decoded row block (4 rows of bf16) goes through a stack buffer (64 KiB: L1 / L2).
constexpr int64_t kDecodeBufK = 8192;

// GemvFn for FP8 rows computing in bf16 (WeightView::bf16_weights; the executor never selects this level
// for a float32 computation), BF16_Q128 activations. One token: 4 rows, each row's blocks decoded in
// registers. More than one token: each block of 4 rows is dequantized once into a stack buffer and the
// bf16 micro-kernel runs over it for every tile of 4 tokens (the same `vdpbf16ps` sequence per (row,
// token), so results do not depend on the token count); rows too long for the buffer take tiles of up
// to 4 tokens decoding in registers (4 rows x 1, 2 or 4 tokens, 2 rows x 3).
template <class S>
void gemv_q_dp(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
               int64_t ldy) {
  const uint16_t* const* a = reinterpret_cast<const uint16_t* const*>(act);
  constexpr int RB = 4, NT = 4;
  if (n > 1 && K <= kDecodeBufK) {
    alignas(64) uint16_t buf[RB * kDecodeBufK];
    const int64_t ld = (K + 31) / 32 * 32;
    const uint16_t* brow[RB];
    for (int i = 0; i < RB; ++i) brow[i] = buf + i * ld;
    for (int64_t r = 0; r < nrows; r += RB) {
      const int nr = nrows - r < RB ? static_cast<int>(nrows - r) : RB;
      decode_rows<S>(w, row0 + r, nr, K, buf, ld);
      for (int j0 = 0; j0 < n; j0 += NT) {
        const int nt = n - j0 < NT ? n - j0 : NT;
        if (nr == RB) {
          micro_dp_tile<RB>(nt, brow, K, a + j0, y + j0 * ldy + r, ldy, 0);
        } else {
          for (int i = 0; i < nr; ++i) micro_dp_tile<1>(nt, brow + i, K, a + j0, y + j0 * ldy + r + i, ldy, 0);
        }
      }
    }
    return;
  }
  token_tiles<QuantDp<S>, 4, 4, 2, 4>(w, row0, nrows, K, a, n, y, ldy);
}

// ---------------------------------------------------------------------------- FP4 rows, post-scaled
// MXFP4 and NVFP4 rows against BF16_Q128 activations. A 64-byte line of codes (a block of 128 elements) read as
// 32 words holds elements 4i .. 4i + 3 in word i, one nibble each; the word shifted right by 4c has element
// 4i + c in bits 0..3, and one `vpermw` into a fixed table of the e2m1 values as bf16 (exact; entries 16..31
// repeat 0..15, so index bit 4 is ignored) turns the line into 32 exact, unscaled weights in the
// activation's run c. Four `vdpbf16ps` (two chains, then one add) give 16 float32 partial sums in which lane i
// holds elements 8i .. 8i + 7 of the block (each product exact in float32). Every lane lies in one scale group
// (NVFP4: 16 elements, lanes 2g and 2g + 1; MXFP4: 32, lanes 4g .. 4g + 3), so one FMA per block and token
// multiplies the partials by their groups' scales (a `vpermps` of the step's scale vector, decoded once per
// 256 elements) into the accumulator. No per-group table is built and no weight is rounded: MXFP4 scales are
// powers of two, so its result is the bf16-weight dot product exactly up to float32 summation order; NVFP4
// computes sum(e2m1 * x) * float32(float(e4m3) * global_scale), i.e. with the format's exact weights, which
// the torch and GPU paths round to bf16 first (the two agree within the bf16 tolerance, not bit for bit).
// The last K % 128 elements (K % 16 == 0 for NVFP4, % 32 for MXFP4) are taken in element order, 16 at a time,
// in float32 FMAs. In the whole blocks, as in every `vdpbf16ps` kernel here, subnormal bf16 activations count
// as zero (the tail's float32 FMAs keep them); no scaled weight is formed, so no weight is flushed. Fixed
// operation order per (row, token), whatever the row and token counts.
alignas(64) constexpr uint16_t kE2M1Bf16[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
    0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

// 16 e2m1 codes from 8 bytes (low nibble first) as float32, in element order.
inline __m512 fp4_16_f32(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m512i d = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));  // dword 2i, 2i + 1: byte i
  const __m512i sh = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  return _mm512_permutexvar_ps(_mm512_srlv_epi32(d, sh), _mm512_loadu_ps(kE2M1));  // index bits 0..3
}

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
  struct Row { const uint8_t* p; const uint8_t* s; float g; };
  static constexpr int G = 16;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, w.global_scale};
  }
  // float32(float(e4m3) * global_scale): the byte decoded exactly (times 2^-120, restored), one rounding multiply
  static __m512 step(const Row& row, int64_t k, int64_t n) {
    const int groups = n >= 256 ? 16 : static_cast<int>(n >> 4);
    const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << groups) - 1u), row.s + (k >> 4));
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
  // 2^(e - 127) as float32 bits e << 23; e = 0 is the subnormal 2^-127, e = 255 NaN (e8m0_to_f32)
  static __m512 step(const Row& row, int64_t k, int64_t n) {
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
// row, prefetched EDGEMOE_PREFETCH_BLOCKS row blocks ahead into L2), each row's scales decoded once per step,
// then its one or two whole blocks of 128; then the last K % 128 elements in order.
template <class S, int RB, int NT>
inline void micro_fp4(const typename S::Row* rows, int64_t K, const uint16_t* const* a, float* y, int64_t ldy,
                      int64_t pf) {
  __m512 acc[RB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i lut = _mm512_load_si512(kE2M1Bf16);
  const int64_t blocks_end = K - K % 128;
  int64_t k = 0;
  for (; k < blocks_end; k += 256) {
    const int nb = blocks_end - k >= 256 ? 2 : 1;
    __m512 sv[RB];
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) {
      if constexpr (EDGEMOE_PREFETCH_BLOCKS > 0) {
        const char* c = reinterpret_cast<const char*>(rows[r].p + (k >> 1)) + EDGEMOE_PREFETCH_BLOCKS * pf;
        __builtin_prefetch(c, 0, EDGEMOE_PREFETCH_LOCALITY);
        __builtin_prefetch(c + 64, 0, EDGEMOE_PREFETCH_LOCALITY);
      }
      sv[r] = S::step(rows[r], k, blocks_end - k);
    }
#pragma GCC unroll 2
    for (int u = 0; u < 2; ++u) {
      if (u >= nb) break;
      const int64_t kb = k + 128 * u;
      const __m512i li = scale_lanes<S::G>(u);
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r) {
        const __m512i words = _mm512_loadu_si512(rows[r].p + (kb >> 1));
        const __m512i w0 = _mm512_permutexvar_epi16(words, lut);
        const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut);
        const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), lut);
        const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), lut);
        const __m512 s = _mm512_permutexvar_ps(li, sv[r]);
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) {
          const uint16_t* aj = a[j] + kb;
          __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(aj));
          __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w1, (__m512bh)_mm512_loadu_si512(aj + 32));
          p0 = _mm512_dpbf16_ps(p0, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(aj + 64));
          p1 = _mm512_dpbf16_ps(p1, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(aj + 96));
          acc[r][j] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), s, acc[r][j]);
        }
      }
    }
  }
  for (k = blocks_end; k < K; k += 16) {  // e2m1 * x exact in float32, then times the group's scale
    for (int r = 0; r < RB; ++r) {
      const __m512 w = fp4_16_f32(rows[r].p + (k >> 1));
      float sc;
      _mm_store_ss(&sc, _mm512_castps512_ps128(S::step(rows[r], k - k % S::G, S::G)));
      const __m512 s = _mm512_set1_ps(sc);
      for (int j = 0; j < NT; ++j) {
        const __m512 x = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[j] + k)));
        acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(w, x), s, acc[r][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = _mm512_reduce_add_ps(acc[r][j]);
}
template <class S>
struct Fp4Dp {  // micro_fp4 as a register kernel
  using Row = typename S::Row;
  using Act = uint16_t;
  static Row row(const WeightView& w, int64_t r) { return S::row(w, r); }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_fp4<S, RB, NT>(rows, K, a, y, ldy, pf);
  }
};
// GemvFn for MXFP4 (S = ScaleMX) and NVFP4 (ScaleNV) rows computing in bf16, BF16_Q128 activations: tiles of
// up to 4 tokens, 4 rows for a tile of one token, 2 otherwise (the register file).
template <class S>
void gemv_fp4(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
              float* y, int64_t ldy) {
  token_tiles<Fp4Dp<S>, 4, 2, 2, 2>(w, row0, nrows, K, reinterpret_cast<const uint16_t* const*>(act), n, y, ldy);
}

void gemv_fp8_dp(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
                 int64_t ldy) {
  if (w.scale_cols >= 128)
    gemv_q_dp<StepFP8>(w, row0, nrows, K, act, n, y, ldy);
  else
    gemv_q_dp<StepFP8Narrow>(w, row0, nrows, K, act, n, y, ldy);
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
    t.by_format[int(WeightFormat::FP8_E4M3_BLOCK)] = {&gemv_fp8_dp, ActFormat::BF16_Q128, sum};
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_fp4<ScaleMX>, ActFormat::BF16_Q128, sum};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_fp4<ScaleNV>, ActFormat::BF16_Q128, sum};
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

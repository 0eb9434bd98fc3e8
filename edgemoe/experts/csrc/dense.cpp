// Dense operations of a CPU decode step in bf16, each one call instead of the dozen torch operations
// it replaces (on a CPU-only machine a decode step is a few hundred small operations per token, and
// their dispatch, not their arithmetic, took a third of the step): RMSNorm over rows, and an attention
// layer's decode work after its q/k/v projections — per-head q/k RMSNorm, rotary embedding, the K/V
// write into the paged cache, and attention over the sequence's cached keys and values.
//
// Rounding follows the torch operations they replace (Hugging Face Qwen3's reference): the RMSNorm
// statistic in float32, the normalized value rounded to bf16 and then multiplied by the bf16 weight
// (or, float32_scale, multiplied in float32 and rounded once, as gpt-oss's norm); RoPE as
// q * cos + rotate_half(q) * sin with each product and the sum rounded to bf16 (bf16 products are
// exact in float32, so these steps round exactly as torch's bf16 elementwise kernels do). What differs
// is summation order: the norm statistic's sum (a different order can move a normalized value by one
// bf16 ulp) and attention, computed in float32 throughout (scores, softmax with a polynomial exp, the
// weighted sum of values with float32 probabilities), rounded to bf16 once at the output.
//
// Functions are compiled for AVX-512F, AVX2 and baseline x86-64 (GCC function multiversioning picks
// one at load time); lanes of 16 independent float32 accumulators vectorize without reassociation.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense.h"
#include "kernels.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define EDGEMOE_BF16_DOT 1
#endif

// 64-byte vector types cross inline helpers in the AVX2 and baseline clones (no ABI boundary: all inlined)
#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EDGEMOE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define EDGEMOE_CLONES
#endif
#define EDGEMOE_INLINE inline __attribute__((always_inline))

namespace edgemoe {
namespace {

constexpr int kLanes = 16;

EDGEMOE_INLINE float f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float32 -> bf16, round to nearest even (NaN stays NaN), as torch's .to(bfloat16)
EDGEMOE_INLINE uint16_t bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

EDGEMOE_INLINE float round_bf16(float f) { return f32(bf16(f)); }

EDGEMOE_INLINE float lane_sum(const float* a) {
  float s[8];
  for (int l = 0; l < 8; ++l) s[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) s[l] += s[l + 4];
  return (s[0] + s[2]) + (s[1] + s[3]);
}

// 1 / sqrt(mean(x^2) + eps) of n bf16 values, float32
EDGEMOE_INLINE float inv_rms(const uint16_t* x, int64_t n, float eps) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = f32(x[i + l]);
      acc[l] += v * v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = f32(x[i]);
    acc[l] += v * v;
  }
  const float mean = lane_sum(acc) / static_cast<float>(n);
  return 1.0f / std::sqrt(mean + eps);
}

// 16 float32 lanes (GCC vector extension: one zmm with AVX-512, two ymm with AVX2); loads of 16 bf16 or
// float32 values, and a lane sum in a fixed order
typedef float vf __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

EDGEMOE_INLINE vf load_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu u = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

EDGEMOE_INLINE vf load_f32(const float* p) {
  vf f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

EDGEMOE_INLINE float hsum(vf v) {
  float a[kLanes];
  std::memcpy(a, &v, sizeof a);
  return lane_sum(a);
}

// float32 lanes rounded to bf16 values (nearest even; NaN stays NaN), branch-free
EDGEMOE_INLINE vf round_bf16(vf x) {
  vu u;
  std::memcpy(&u, &x, sizeof u);
  const vu nan = (u & 0x7fffffffu) > 0x7f800000u;
  const vu r = nan ? ((u | 0x400000u) & 0xffff0000u) : ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  vf f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}

EDGEMOE_INLINE void store_f32(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// y = norm(x) in bf16 values held as float32 (nw: bf16 weight, or nullptr: none)
EDGEMOE_INLINE void norm_row(const uint16_t* x, int64_t n, const uint16_t* nw, float eps, bool f32_scale, float* y) {
  int64_t i = 0;
  if (nw == nullptr) {
    for (; i + kLanes <= n; i += kLanes) store_f32(y + i, load_bf16(x + i));
    for (; i < n; ++i) y[i] = f32(x[i]);
    return;
  }
  const float r = inv_rms(x, n, eps);
  if (f32_scale) {
    for (; i + kLanes <= n; i += kLanes) store_f32(y + i, round_bf16(load_bf16(nw + i) * (load_bf16(x + i) * r)));
    for (; i < n; ++i) y[i] = round_bf16(f32(nw[i]) * (f32(x[i]) * r));
  } else {
    for (; i + kLanes <= n; i += kLanes)
      store_f32(y + i, round_bf16(load_bf16(nw + i) * round_bf16(load_bf16(x + i) * r)));
    for (; i < n; ++i) y[i] = round_bf16(f32(nw[i]) * round_bf16(f32(x[i]) * r));
  }
}

// rotate_half RoPE on the first R dims of y (bf16 values as float32), tables cos/sin [R] bf16
EDGEMOE_INLINE void rope_row(float* y, int64_t R, const uint16_t* cos, const uint16_t* sin) {
  const int64_t h = R / 2;
  int64_t i = 0;
  for (; i + kLanes <= h; i += kLanes) {
    const vf x1 = load_f32(y + i), x2 = load_f32(y + i + h);
    const vf c1 = load_bf16(cos + i), s1 = load_bf16(sin + i), c2 = load_bf16(cos + i + h), s2 = load_bf16(sin + i + h);
    store_f32(y + i, round_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1)));
    store_f32(y + i + h, round_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2)));
  }
  for (; i < h; ++i) {
    const float x1 = y[i], x2 = y[i + h];
    y[i] = round_bf16(round_bf16(x1 * f32(cos[i])) + round_bf16(-x2 * f32(sin[i])));
    y[i + h] = round_bf16(round_bf16(x2 * f32(cos[i + h])) + round_bf16(x1 * f32(sin[i + h])));
  }
}

// lane sum by halving (a fixed order): 16 -> 8 -> 4 -> 2 -> 1
typedef int32_t vi __attribute__((vector_size(64)));
EDGEMOE_INLINE float hsum_tree(vf v) {
  v += __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// s[i * ld + j] = scale * <key j, q_i> for NH query heads q_i (float32 rows of D, ldq apart) against one
// bf16 key row k of D values: each key line loaded once for all NH heads; D % 16 in scalar FMAs
template <int NH>
EDGEMOE_INLINE void key_scores(const uint16_t* k, const float* q, int64_t ldq, int64_t D, float scale, float* s,
                               int64_t ld) {
  vf acc[NH] = {};
  int64_t e = 0;
  for (; e + kLanes <= D; e += kLanes) {
    const vf kv = load_bf16(k + e);
#pragma GCC unroll 8
    for (int i = 0; i < NH; ++i) acc[i] += kv * load_f32(q + i * ldq + e);
  }
#pragma GCC unroll 8
  for (int i = 0; i < NH; ++i) {
    float tail = 0.0f;
    for (int64_t r = e; r < D; ++r) tail += f32(k[r]) * q[i * ldq + r];
    s[i * ld] = (hsum_tree(acc[i]) + tail) * scale;
  }
}

// o[h][0 .. 16 NV) += sum_j p[h][j] * v_j for NH heads (p rows ldp apart, o rows 16 NV apart) over n bf16 value
// rows v_j = v + slot[j] * ldv: the accumulators in registers, each value line converted once for the NH heads
template <int NV, int NH>
EDGEMOE_INLINE void weighted_values_bf16(const float* p, int64_t ldp, const uint16_t* v, const int64_t* slot,
                                         int64_t ldv, int64_t n, float* o) {
  vf acc[NH][NV];
#pragma GCC unroll 2
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) acc[h][c] = load_f32(o + (h * NV + c) * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* vj = v + slot[j] * ldv;
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) {
      const vf v = load_bf16(vj + c * kLanes);
#pragma GCC unroll 2
      for (int h = 0; h < NH; ++h) acc[h][c] += p[h * ldp + j] * v;
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) store_f32(o + (h * NV + c) * kLanes, acc[h][c]);
}

// p[j] = exp(p[j] - m) for p[j] <= m, returns their sum: 2^(x log2 e) as 2^round * 2^frac, the fraction's
// power by its degree-7 Taylor polynomial (relative error below 1e-8 on [-0.5, 0.5]); arguments below
// -87 (2^-126) flush to zero. Lanes of kLanes independent sums.
EDGEMOE_INLINE float exp_shifted(float* p, int64_t n, float m) {
  constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;
  constexpr float c1 = kLn2, c2 = c1 * kLn2 / 2, c3 = c2 * kLn2 / 3, c4 = c3 * kLn2 / 4, c5 = c4 * kLn2 / 5,
                  c6 = c5 * kLn2 / 6, c7 = c6 * kLn2 / 7;
  float acc[kLanes] = {};
  int64_t j = 0;
  auto one = [&](float x) {
    float t = (x - m) * kLog2e;
    const bool tiny = t < -126.0f;
    t = tiny ? -126.0f : t;
    float r = (t + 12582912.0f) - 12582912.0f;  // round to nearest (|t| < 2^22)
    const float f = t - r;                         // a NaN score stays NaN through f
    r = r == r ? r : 0.0f;                         // (and the exponent is built from a number)
    const float poly = 1.0f + f * (c1 + f * (c2 + f * (c3 + f * (c4 + f * (c5 + f * (c6 + f * c7))))));
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(r) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return tiny ? 0.0f : poly * scale;
  };
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      p[j + l] = one(p[j + l]);
      acc[l] += p[j + l];
    }
  for (int l = 0; j < n; ++j, ++l) {
    p[j] = one(p[j]);
    acc[l] += p[j];
  }
  return lane_sum(acc);
}

#ifdef EDGEMOE_BF16_DOT
// s[i * ld + j] = scale * <key j, q_i> for the G query heads (qb: [G, D] bf16) against the n keys at kbase + slot[j] *
// row, D % 32 == 0: `vdpbf16ps` over each key's lines (exact bf16 products, float32 sums), 8 heads at a time
// sharing the key's loads, their 8 partial vectors folded into 8 sums by one shuffle tree (4 levels), not 8
// horizontal sums. K and V lines of key j + ahead are prefetched (as the float32 path does).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void scores_bf16_dot(
    const uint16_t* kbase, const uint16_t* vbase, const int64_t* slot, int64_t row, int64_t n, const uint16_t* qb,
    int64_t G, int64_t D, float scale, float* s, int64_t ld, int64_t ahead) {
  const int64_t lines = D / 32;
  const __m512i fold = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (int64_t j = 0; j < n; ++j) {
    if (j + ahead < n) {
      const uint16_t* kn = kbase + slot[j + ahead] * row;
      const uint16_t* vn = vbase + slot[j + ahead] * row;
      for (int64_t li = 0; li < lines; ++li) {
        __builtin_prefetch(kn + li * 32, 0, 3);
        __builtin_prefetch(vn + li * 32, 0, 2);
      }
    }
    const uint16_t* kj = kbase + slot[j] * row;
    int64_t i = 0;
    for (; i + 8 <= G; i += 8) {
      __m512 acc[8];
      for (int h = 0; h < 8; ++h) acc[h] = _mm512_setzero_ps();
      for (int64_t e = 0; e < D; e += 32) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kj + e);
#pragma GCC unroll 8
        for (int h = 0; h < 8; ++h)
          acc[h] = _mm512_dpbf16_ps(acc[h], kv, (__m512bh)_mm512_loadu_si512(qb + (i + h) * D + e));
      }
      // 8 x 16 lanes -> 8 sums: halves of each vector added pairwise (a, b -> [a 8 | b 8]), then quarters
      // ([a 4 | b 4 | c 4 | d 4]), then within 128-bit lanes twice; lane k then holds heads k and 4 + k
      __m512 v[4];
      for (int h = 0; h < 4; ++h)
        v[h] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * h], acc[2 * h + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * h], acc[2 * h + 1], 0xEE));
      const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
      const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xDD));
      const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));
      const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xDD));
      // u: 128-bit lane k = [head k, head 4 + k, ...]; permuted to heads 0..7 in lanes 0..7
      alignas(64) float out[16];
      _mm512_store_ps(out, _mm512_mul_ps(_mm512_permutexvar_ps(fold, u), _mm512_set1_ps(scale)));
      for (int h = 0; h < 8; ++h) s[(i + h) * ld + j] = out[h];
    }
    for (; i < G; ++i) {  // heads past a multiple of 8
      __m512 acc = _mm512_setzero_ps();
      for (int64_t e = 0; e < D; e += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(kj + e), (__m512bh)_mm512_loadu_si512(qb + i * D + e));
      s[i * ld + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}
#endif

// max of p[0 .. n), NaNs skipped (as a chain of p[j] > m ? p[j] : m), in 16 independent lanes (a scalar chain
// of compare-selects is latency-bound)
EDGEMOE_INLINE float max_of(const float* p, int64_t n) {
  vf m = vf{} - INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf x = load_f32(p + j);
    m = x > m ? x : m;
  }
  float r = -INFINITY;
  for (int l = 0; l < kLanes; ++l) r = m[l] > r ? m[l] : r;
  for (; j < n; ++j) r = p[j] > r ? p[j] : r;
  return r;
}

template <class T>
void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

}  // namespace

EDGEMOE_CLONES
void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ldx, const uint16_t* w, float eps,
                   bool f32_scale, uint16_t* y, int64_t ldy) {
  thread_local std::vector<float> row;
  grow(row, n);
  for (int64_t r = 0; r < rows; ++r) {
    norm_row(x + r * ldx, n, w, eps, f32_scale, row.data());
    uint16_t* out = y + r * ldy;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16(row[i]);
  }
}

void softmax_topk_bf16(const uint16_t* logits, int64_t tokens, int64_t E, int64_t ld, int64_t top_k, bool norm_topk,
                       int64_t* ids, uint16_t* weights) {
  thread_local std::vector<float> p;
  thread_local std::vector<int64_t> order;
  grow(p, E);
  grow(order, E);
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* l = logits + t * ld;
    float mx = f32(l[0]);
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, f32(l[e]));
    float sum = 0.0f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(f32(l[e]) - mx));
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < E; ++e) {
      p[e] *= inv;
      order[e] = e;
    }
    // descending probability, the lower id first among equals (a NaN row keeps the ids in order)
    std::partial_sort(order.begin(), order.begin() + top_k, order.begin() + E,
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (!(p[b] > p[a]) && a < b); });
    float ksum = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) ksum += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      ids[t * top_k + j] = order[j];
      weights[t * top_k + j] = bf16(norm_topk ? p[order[j]] / ksum : p[order[j]]);
    }
  }
}

void round_add_bf16(const float* acc, const uint16_t* residual, uint16_t* out, int64_t n) {
  if (residual == nullptr) {
    for (int64_t i = 0; i < n; ++i) out[i] = bf16(acc[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = bf16(f32(residual[i]) + round_bf16(acc[i]));
}

EDGEMOE_CLONES
void add_rms_norm_bf16(const uint16_t* x, const uint16_t* delta, int64_t rows, int64_t n, const uint16_t* w, float eps,
                       bool f32_scale, uint16_t* r, uint16_t* y) {
  for (int64_t i = 0; i < rows * n; ++i) r[i] = bf16(f32(x[i]) + f32(delta[i]));
  rms_norm_bf16(r, rows, n, n, w, eps, f32_scale, y, n);
}

int32_t decode_attention_check(const DecodeAttentionArgs& a) {
  const int64_t Hq = a.num_heads, Hk = a.num_kv_heads, D = a.head_dim;
  if (Hq < 1 || Hk < 1 || D < 1 || Hq % Hk != 0 || a.tokens < 0 || a.rotary_dim < 0 || a.rotary_dim > D ||
      a.rotary_dim % 2 != 0 || a.page_size < 1)
    return 1;
  for (int64_t t = 0; t < a.tokens; ++t)
    if (a.kv_lens[t] < 1) return 1;
  return 0;
}

int64_t attention_items(const DecodeAttentionArgs& a, std::vector<int64_t>& first) {
  first.resize(static_cast<size_t>(a.tokens) + 1);
  first[0] = 0;
  for (int64_t t = 0; t < a.tokens; ++t)
    first[t + 1] = first[t] + a.num_kv_heads * ((a.kv_lens[t] + kAttnChunk - 1) / kAttnChunk);
  return first[a.tokens];
}

EDGEMOE_CLONES
void decode_attention_prologue(const DecodeAttentionArgs& a, float* qf) {
  const int64_t Hq = a.num_heads, Hk = a.num_kv_heads, D = a.head_dim, row = Hk * D;
  thread_local std::vector<float> kf;
  grow(kf, D);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const uint16_t* cos = a.cos ? a.cos + t * a.cos_ld : nullptr;
    const uint16_t* sin = a.sin ? a.sin + t * a.cos_ld : nullptr;
    for (int64_t h = 0; h < Hq; ++h) {  // queries: norm, RoPE; kept as bf16 values in float32
      float* y = qf + (t * Hq + h) * D;
      norm_row(a.q + t * a.q_ld + h * D, D, a.q_norm, a.eps, a.float32_scale, y);
      if (cos) rope_row(y, a.rotary_dim, cos, sin);
    }
    uint16_t* kdst = a.k_cache + a.kv_slots[t] * row;
    uint16_t* vdst = a.v_cache + a.kv_slots[t] * row;
    for (int64_t h = 0; h < Hk; ++h) {  // the new key (norm, RoPE) and value into their cache slot
      norm_row(a.k + t * a.k_ld + h * D, D, a.k_norm, a.eps, a.float32_scale, kf.data());
      if (cos) rope_row(kf.data(), a.rotary_dim, cos, sin);
      for (int64_t i = 0; i < D; ++i) kdst[h * D + i] = bf16(kf[i]);
      std::memcpy(vdst + h * D, a.v + t * a.v_ld + h * D, static_cast<size_t>(D) * 2);
    }
  }
}

EDGEMOE_CLONES
void attention_part(const DecodeAttentionArgs& a, const float* qf, const int64_t* first, int64_t item, float* part) {
  const int64_t Hq = a.num_heads, Hk = a.num_kv_heads, D = a.head_dim, G = Hq / Hk, row = Hk * D;
  const int64_t t = std::upper_bound(first + 1, first + a.tokens + 1, item) - (first + 1);  // first[t] <= item
  const int64_t local = item - first[t], g = local % Hk, c = local / Hk;
  const int64_t j0 = c * kAttnChunk, n = std::min(a.kv_lens[t], j0 + kAttnChunk) - j0;
  const int64_t* pages = a.page_tables + t * a.page_table_ld;
  const int64_t ps = a.page_size;
  int64_t slot[kAttnChunk];
  for (int64_t j = 0; j < n; ++j) slot[j] = pages[(j0 + j) / ps] * ps + (j0 + j) % ps;
  const uint16_t* kbase = a.k_cache + g * D;
  const uint16_t* vbase = a.v_cache + g * D;
  const float* qg = qf + (t * Hq + g * G) * D;
  thread_local std::vector<float> scores;
  grow(scores, G * kAttnChunk);
  float* s = scores.data();
  constexpr int64_t kAhead = 8;  // keys: the rows are scattered over pages (DRAM latency, not bandwidth, bounds a
                                 // single core walking them), so key j + 8's K and V lines are requested now
  const int64_t line_elems = 32, lines = (D + line_elems - 1) / line_elems;
#ifdef EDGEMOE_BF16_DOT
  if (a.bf16_dot && D % 32 == 0) {
    thread_local std::vector<uint16_t> qb;  // the group's queries as bf16 (they hold bf16 values: exact)
    grow(qb, G * D);
    for (int64_t e = 0; e < G * D; ++e) qb[e] = bf16(qg[e]);
    scores_bf16_dot(kbase, vbase, slot, row, n, qb.data(), G, D, a.scale, s, kAttnChunk, kAhead);
  } else
#endif
  for (int64_t j = 0; j < n; ++j) {  // scores of the G query heads, 8 at a time, against key j
    if (j + kAhead < n) {
      const uint16_t* kn = kbase + slot[j + kAhead] * row;
      const uint16_t* vn = vbase + slot[j + kAhead] * row;
      for (int64_t li = 0; li < lines; ++li) {
        __builtin_prefetch(kn + li * line_elems, 0, 3);
        __builtin_prefetch(vn + li * line_elems, 0, 2);
      }
    }
    const uint16_t* kj = kbase + slot[j] * row;
    int64_t i = 0;
    for (; i + 8 <= G; i += 8) key_scores<8>(kj, qg + i * D, D, D, a.scale, s + i * kAttnChunk + j, kAttnChunk);
    for (; i < G; ++i) key_scores<1>(kj, qg + i * D, D, D, a.scale, s + i * kAttnChunk + j, kAttnChunk);
  }
  float* m = part;          // [G] the chunk's max score per head
  float* l = part + G;      // [G] sum of exp(score - max)
  float* o = part + 2 * G;  // [G, D] unnormalized weighted values
  for (int64_t i = 0; i < G; ++i) {
    float* p = s + i * kAttnChunk;
    m[i] = max_of(p, n);
    l[i] = exp_shifted(p, n, m[i]);
  }
  std::fill(o, o + G * D, 0.0f);
  int64_t i = 0;
  switch (D) {
    case 64:
      for (; i + 2 <= G; i += 2) weighted_values_bf16<4, 2>(s + i * kAttnChunk, kAttnChunk, vbase, slot, row, n, o + i * D);
      break;
    case 128:
      for (; i + 2 <= G; i += 2) weighted_values_bf16<8, 2>(s + i * kAttnChunk, kAttnChunk, vbase, slot, row, n, o + i * D);
      break;
    case 256:
      for (; i < G; ++i) weighted_values_bf16<16, 1>(s + i * kAttnChunk, kAttnChunk, vbase, slot, row, n, o + i * D);
      break;
    default:
      break;
  }
  for (; i < G; ++i) {  // other head sizes (and an odd head out): scalar
    const float* p = s + i * kAttnChunk;
    float* oi = o + i * D;
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vj = vbase + slot[j] * row;
      for (int64_t e = 0; e < D; ++e) oi[e] += p[j] * f32(vj[e]);
    }
  }
}

EDGEMOE_CLONES
void attention_merge(const DecodeAttentionArgs& a, const int64_t* first, const float* parts, int64_t tg) {
  const int64_t Hq = a.num_heads, Hk = a.num_kv_heads, D = a.head_dim, G = Hq / Hk;
  const int64_t t = tg / Hk, g = tg % Hk, chunks = (first[t + 1] - first[t]) / Hk;
  const int64_t stride = attention_part_floats(a);
  thread_local std::vector<float> acc;
  grow(acc, D);
  for (int64_t i = 0; i < G; ++i) {
    float mx = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) {
      const float mc = parts[(first[t] + c * Hk + g) * stride + i];
      mx = mc > mx ? mc : mx;
    }
    float l = 0.0f;
    std::fill(acc.begin(), acc.begin() + D, 0.0f);
    for (int64_t c = 0; c < chunks; ++c) {  // in chunk order: the result does not depend on the threads
      const float* pc = parts + (first[t] + c * Hk + g) * stride;
      // a chunk whose every score is -inf holds no weight (its exp-sum is NaN: -inf - -inf); skipped unless every
      // chunk is such (then, as torch's softmax over -inf only, the output is NaN)
      if (pc[i] == -INFINITY && mx != -INFINITY) continue;
      const float w = chunks == 1 ? 1.0f : std::exp(pc[i] - mx);
      l += w * pc[G + i];
      const float* oc = pc + 2 * G + i * D;
      for (int64_t e = 0; e < D; ++e) acc[e] += w * oc[e];
    }
    const float inv = 1.0f / l;
    uint16_t* out = a.out + (t * Hq + g * G + i) * D;
    for (int64_t e = 0; e < D; ++e) out[e] = bf16(acc[e] * inv);
  }
}

bool has_bf16_dot() {
#ifdef EDGEMOE_BF16_DOT
  constexpr uint32_t need = kFeatAvx512F | kFeatAvx512BW | kFeatAvx512VL | kFeatAvx512Bf16;
  return (detect_cpu_features() & need) == need;
#else
  return false;
#endif
}

int32_t decode_attention_bf16(const DecodeAttentionArgs& args) {
  if (decode_attention_check(args)) return 1;
  DecodeAttentionArgs a = args;
  a.bf16_dot = has_bf16_dot();
  thread_local std::vector<float> qf, parts;
  thread_local std::vector<int64_t> first;
  grow(qf, a.tokens * a.num_heads * a.head_dim);
  decode_attention_prologue(a, qf.data());
  const int64_t items = attention_items(a, first), stride = attention_part_floats(a);
  grow(parts, items * stride);
  for (int64_t it = 0; it < items; ++it) attention_part(a, qf.data(), first.data(), it, parts.data() + it * stride);
  for (int64_t tg = 0; tg < a.tokens * a.num_kv_heads; ++tg) attention_merge(a, first.data(), parts.data(), tg);
  return 0;
}

}  // namespace edgemoe

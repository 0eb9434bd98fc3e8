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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense.h"

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

// <k, q> of n float32 values: two chains of lanes (the FMA latency), summed in a fixed order
EDGEMOE_INLINE float dot(const float* k, const float* q, int64_t n) {
  vf a0 = {}, a1 = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    a0 += load_f32(k + i) * load_f32(q + i);
    a1 += load_f32(k + i + kLanes) * load_f32(q + i + kLanes);
  }
  if (i + kLanes <= n) {
    a0 += load_f32(k + i) * load_f32(q + i);
    i += kLanes;
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += k[i] * q[i];
  return hsum(a0 + a1) + tail;
}

// o[0 .. 16 NV) = sum_j p[j] * v[j, :] over float32 rows of 16 NV: the accumulators in registers
template <int NV>
EDGEMOE_INLINE void weighted_values(const float* p, const float* v, int64_t n, float* o) {
  vf acc[NV] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + j * NV * kLanes;
    const float pj = p[j];
#pragma GCC unroll 16
    for (int c = 0; c < NV; ++c) acc[c] += pj * load_f32(vj + c * kLanes);
  }
  std::memcpy(o, acc, sizeof acc);
}

EDGEMOE_INLINE void weighted_values_any(const float* p, const float* v, int64_t n, int64_t D, float* o) {
  switch (D) {
    case 64: return weighted_values<4>(p, v, n, o);
    case 128: return weighted_values<8>(p, v, n, o);
    case 256: return weighted_values<16>(p, v, n, o);
    default:
      std::fill(o, o + D, 0.0f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t e = 0; e < D; ++e) o[e] += p[j] * v[j * D + e];
  }
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

EDGEMOE_CLONES
int32_t decode_attention_bf16(const DecodeAttentionArgs& a) {
  const int64_t Hq = a.num_heads, Hk = a.num_kv_heads, D = a.head_dim;
  if (Hq < 1 || Hk < 1 || D < 1 || Hq % Hk != 0 || a.tokens < 0 || a.rotary_dim < 0 || a.rotary_dim > D ||
      a.rotary_dim % 2 != 0 || a.page_size < 1)
    return 1;
  const int64_t G = Hq / Hk, row = Hk * D;  // query heads per KV head; elements of one cached token
  // scratch reused across calls on this thread (grow only: a fresh large buffer costs page faults per call)
  thread_local std::vector<float> q, kf, acc, scores, kf32, vf32;  // kf32 / vf32: one KV head's cache, [n, D]
  thread_local std::vector<int64_t> slots;
  grow(q, Hq * D);
  grow(kf, D);
  grow(acc, D);
  for (int64_t t = 0; t < a.tokens; ++t) {
    const uint16_t* cos = a.cos ? a.cos + t * a.cos_ld : nullptr;
    const uint16_t* sin = a.sin ? a.sin + t * a.cos_ld : nullptr;
    for (int64_t h = 0; h < Hq; ++h) {  // queries: norm, RoPE; kept as bf16 values in float32
      float* y = q.data() + h * D;
      norm_row(a.q + t * a.q_ld + h * D, D, a.q_norm, a.eps, a.float32_scale, y);
      if (cos) rope_row(y, a.rotary_dim, cos, sin);
    }
    const int64_t slot = a.kv_slots[t];
    uint16_t* kdst = a.k_cache + slot * row;
    uint16_t* vdst = a.v_cache + slot * row;
    for (int64_t h = 0; h < Hk; ++h) {  // the new key (norm, RoPE) and value into their cache slot
      norm_row(a.k + t * a.k_ld + h * D, D, a.k_norm, a.eps, a.float32_scale, kf.data());
      if (cos) rope_row(kf.data(), a.rotary_dim, cos, sin);
      for (int64_t i = 0; i < D; ++i) kdst[h * D + i] = bf16(kf[i]);
      std::memcpy(vdst + h * D, a.v + t * a.v_ld + h * D, static_cast<size_t>(D) * 2);
    }
    const int64_t n = a.kv_lens[t];
    const int64_t* pages = a.page_tables + t * a.page_table_ld;
    grow(slots, n);
    for (int64_t j = 0; j < n; ++j) slots[j] = pages[j / a.page_size] * a.page_size + j % a.page_size;
    grow(scores, G * n);
    grow(kf32, n * D);
    grow(vf32, n * D);
    for (int64_t g = 0; g < Hk; ++g) {
      for (int64_t j = 0; j < n; ++j) {  // the KV head's cached keys and values as float32 rows, once
        const uint16_t* kj = a.k_cache + slots[j] * row + g * D;
        const uint16_t* vj = a.v_cache + slots[j] * row + g * D;
        for (int64_t e = 0; e < D; ++e) kf32[j * D + e] = f32(kj[e]);
        for (int64_t e = 0; e < D; ++e) vf32[j * D + e] = f32(vj[e]);
      }
      const float* qg = q.data() + g * G * D;
      for (int64_t j = 0; j < n; ++j)  // scores of the group's G query heads against key j
        for (int64_t i = 0; i < G; ++i) scores[i * n + j] = dot(kf32.data() + j * D, qg + i * D, D) * a.scale;
      uint16_t* out = a.out + t * Hq * D + g * G * D;
      for (int64_t i = 0; i < G; ++i) {  // softmax over the keys (float32), then the weighted values
        float* p = scores.data() + i * n;
        float m = -INFINITY;
        for (int64_t j = 0; j < n; ++j) m = p[j] > m ? p[j] : m;
        const float inv = 1.0f / exp_shifted(p, n, m);
        for (int64_t j = 0; j < n; ++j) p[j] *= inv;
        weighted_values_any(p, vf32.data(), n, D, acc.data());
        for (int64_t e = 0; e < D; ++e) out[i * D + e] = bf16(acc[e]);
      }
    }
  }
  return 0;
}

}  // namespace edgemoe

// Dense bf16 operations of a CPU decode step (dense.cpp). Tensors are raw pointers; the Python side
// (edgemoe/experts/native.py, DenseKernels) checks dtypes, shapes and contiguity.
#pragma once

#include <cstdint>
#include <vector>

namespace edgemoe {

// y[r, :] = RMSNorm(x[r, :]) for r < rows, n elements each; x rows ldx elements apart, y rows ldy apart;
// w [n] bf16; f32_scale: multiply by the weight in float32 before rounding (else round, then multiply).
void rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t n, int64_t ldx, const uint16_t* w, float eps,
                   bool f32_scale, uint16_t* y, int64_t ldy);

// The router of a softmax top-k MoE layer (reference: transformers' Qwen3MoeTopKRouter) over `tokens` rows of
// bf16 logits [tokens, E] (rows ld elements apart): p = softmax(logits) in float32 (exp(l - max) times the
// reciprocal of their sum, as torch's CPU softmax), the top_k largest in descending order (equal values: the
// lower expert first), with norm_topk each divided by the k's sum, rounded to bf16. ids [tokens, top_k] int64
// (experts of the layer), weights [tokens, top_k] bf16. Requires 1 <= top_k <= E.
void softmax_topk_bf16(const uint16_t* logits, int64_t tokens, int64_t E, int64_t ld, int64_t top_k, bool norm_topk,
                       int64_t* ids, uint16_t* weights);

// out[i] = bf16(acc[i]) for i < n, or with a residual bf16(residual[i] + bf16(acc[i])): a float32 sum rounded to the
// model's dtype, then the bf16 residual add (the rounding points of torch's `.to(bfloat16)` and bf16 `+`)
void round_add_bf16(const float* acc, const uint16_t* residual, uint16_t* out, int64_t n);

// The residual add and the norm after it: r = x + delta rounded to bf16, y = RMSNorm(r) as rms_norm_bf16, for
// `rows` rows of n contiguous elements (x, delta, r, y rows n apart)
void add_rms_norm_bf16(const uint16_t* x, const uint16_t* delta, int64_t rows, int64_t n, const uint16_t* w, float eps,
                       bool f32_scale, uint16_t* r, uint16_t* y);

// One attention layer's decode work for `tokens` sequences of one new token each, after the q/k/v
// projections: q/k per-head RMSNorm (q_norm / k_norm, or nullptr: none), rotate-half RoPE on the first
// rotary_dim dims of each head (cos / sin nullptr: none), the new key and value written into cache slot
// kv_slots[t], then attention of the Hq query heads (GQA: Hq / Hk per KV head) over the sequence's
// kv_lens[t] cached tokens (including the new one), position j at slot page_tables[t][j / page_size] *
// page_size + j % page_size. Caches [slots, Hk, D]; out [tokens, Hq, D]. Returns 0, or 1 for bad sizes.
struct DecodeAttentionArgs {
  const uint16_t* q;  // [tokens, Hq * D], rows q_ld elements apart
  const uint16_t* k;  // [tokens, Hk * D]
  const uint16_t* v;  // [tokens, Hk * D]
  int64_t q_ld, k_ld, v_ld;
  int64_t tokens, num_heads, num_kv_heads, head_dim;
  const uint16_t* q_norm;  // [D] or nullptr
  const uint16_t* k_norm;  // [D] or nullptr
  float eps;
  bool float32_scale;
  const uint16_t* cos;  // [tokens, >= rotary_dim], rows cos_ld apart, or nullptr
  const uint16_t* sin;
  int64_t cos_ld, rotary_dim;
  const int64_t* kv_slots;     // [tokens]
  uint16_t* k_cache;           // [slots, Hk, D]
  uint16_t* v_cache;
  const int64_t* page_tables;  // [tokens, page_table_ld]
  int64_t page_table_ld;
  const int64_t* kv_lens;  // [tokens]
  int64_t page_size;
  float scale;
  uint16_t* out;  // [tokens, Hq, D]
  // scores by AVX-512-BF16 dot products (set by the caller where the CPU has them and D % 32 == 0; the keys
  // and the normed, rotated queries are bf16 values, so the products are exact either way; the sums' order
  // differs from the float32 FMA path)
  bool bf16_dot = false;
};
// whether this CPU runs the bf16_dot path
bool has_bf16_dot();

int32_t decode_attention_bf16(const DecodeAttentionArgs& a);

// The same work in parts, for a thread pool (Executor::decode_attention; decode_attention_bf16 runs them in
// order on the calling thread, with the same result). Flash-decoding (Dao et al., "Flash-Decoding for
// long-context inference", 2023): each sequence's cached tokens are cut into chunks of kAttnChunk keys, a
// fixed size, so the result does not depend on the thread count. An item is (sequence t, KV head g, chunk c),
// numbered per sequence in (c, g) order from first[t] (attention_items); its part holds, for the G = Hq / Hk
// query heads of g, the chunk's max score [G], the sum of exp(score - max) [G] and the unnormalized weighted
// values [G, D] (attention_part_floats floats). attention_merge combines the parts of (t, g) = tg / Hk,
// tg % Hk in chunk order into out.
constexpr int64_t kAttnChunk = 128;
// 0, or 1 for sizes it refuses (as decode_attention_bf16) or an empty sequence
int32_t decode_attention_check(const DecodeAttentionArgs& a);
// q/k norm and RoPE, the new K/V into the cache; qf [tokens, Hq, D]: the queries (bf16 values in float32)
void decode_attention_prologue(const DecodeAttentionArgs& a, float* qf);
// fills first[0 .. tokens] and returns the number of items
int64_t attention_items(const DecodeAttentionArgs& a, std::vector<int64_t>& first);
inline int64_t attention_part_floats(const DecodeAttentionArgs& a) {
  const int64_t G = a.num_heads / a.num_kv_heads;
  return G * (2 + a.head_dim);
}
void attention_part(const DecodeAttentionArgs& a, const float* qf, const int64_t* first, int64_t item, float* part);
void attention_merge(const DecodeAttentionArgs& a, const int64_t* first, const float* parts, int64_t tg);

}  // namespace edgemoe

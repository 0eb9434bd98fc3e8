// Generic row-block GEMV, instantiated once per ISA by kernels_<isa>.cpp.
//
// Include contract (this file has no #include of its own, on purpose):
//   1. the including file first includes its intrinsics header, <cstdint>, <cstring>, "kernels.h";
//   2. then switches the target with `#pragma GCC push_options` / `#pragma GCC target("...")`;
//   3. then includes this file and defines its vector traits `V` (below; they may use the scalar
//      decoders and the e2m1 table defined here): the templates are instantiated with them after.
// Everything defined here lives in an anonymous namespace, so each translation unit gets its own
// copy compiled for its own target and no symbol compiled for AVX-512 can be merged by the linker
// into code that runs on a CPU without it (the classic ODR trap of per-file target flags). Standard
// library templates are never instantiated in here for the same reason.
//
// Vector traits `V` (one per ISA) provide:
//   reg, W (float lanes), kMasked (has masked loads), zero(), one(), fmadd(a, b, c) = a*b + c, hsum(reg),
//   load_f32(p), load_f32_tail(p, n), load_bf16(p), load_bf16_tail(p, n)   (tails zero lanes >= n);
//   set1(f), mul(a, b); for the quantized formats (W > 1) fp4(p) (W e2m1 values from W/2 packed bytes, low
//   nibble first) and e4m3(p) (W e4m3 values from W bytes), exact, and with kMasked fp4_tail(p, n),
//   e4m3_tail(p, n).
//
// Structure of one GEMV call (rows [row0, row0 + nrows) of one expert bank, n tokens):
//   the rows split into RB row streams of q = nrows / RB consecutive rows (RowStreams)
//   for each step r < q: the block of rows r of every stream, RB rows side by side from DRAM
//     for each tile of NT tokens              the RB x K block is re-read from L1 for tiles >= 2
//       micro-kernel: RB x NT float accumulators held in registers across the whole K loop;
//       K is walked one 64-byte cache line of weights per step, and the same line EDGEMOE_PREFETCH_ROWS rows
//       further down each row's stream is software-prefetched into L2, so each thread keeps RB sequential
//       streams in flight, each in its own pages, which the hardware prefetchers follow as well;
//   then the nrows % RB rows left, one at a time.
// RB x NT is chosen per ISA to fit the register file (AVX-512: 32 zmm -> 4 x 4; AVX2: 16 ymm -> 4 x 2).
// At T <= 8 the work is bound by the weight bytes read; arithmetic is far below the core's peak, so
// the kernel's job is to keep enough independent loads in flight and to read every weight byte once.
//
// A float weight format is a traits struct (FmtF32, FmtBF16 below):
//   struct Row { ... };                          per-row state: the row's data pointer
//   static Row row(const WeightView&, int64_t r);
//   static constexpr int kElemsPerLine;          elements per 64 bytes of weights
//   static reg load(const Row&, int64_t k);      W float32 lanes, elements [k, k + W)
//   static reg load_tail(const Row&, int64_t k, int n);   (only when V::kMasked)
//   static float at(const Row&, int64_t k);      one element (scalar tails)
//   static const char* addr(const Row&, int64_t k);       byte address of element k (prefetch)
// registered as `gemv<V, Fmt, RB, NT>` in the ISA's table under its WeightFormat. The quantized formats are
// post-scaled (RawFP8, RawFP4 and micro_ps below, registered as `gemv_fp8_ps` / `gemv_fp4_ps`): the codes'
// exact values times the activation, summed per group of elements sharing a scale, then one multiply by the
// group's scale. The WeightView a kernel gets (executor.h, expert_matrix) already points at the projection's
// codes and scales in the expert's row: FP8 scales by the float32 scale of row r / scale_rows, column
// k / scale_cols (128 x 128); MXFP4 by 2^(e8m0 - 127) per 32 columns; NVFP4 by
// float32(float(e4m3) * global_scale) per 16 columns. The tiling, threading and the executor are the same
// for every format. (AVX-512-BF16 has its own quantized kernels, post-scaled too, which feed bf16 codes to
// `vdpbf16ps`: kernels_avx512bf16.cpp.)

#ifndef EDGEMOE_PREFETCH_ROWS
#define EDGEMOE_PREFETCH_ROWS 2  // prefetch distance in rows of a row's stream (0: hardware prefetch only)
#endif
#ifndef EDGEMOE_SUM_PREFETCH
#define EDGEMOE_SUM_PREFETCH 1  // the read test prefetches as the GEMVs do
#endif
#ifndef EDGEMOE_PREFETCH_LOCALITY
// __builtin_prefetch locality of the row prefetch: 2 = prefetcht1, into L2. A prefetch into L1
// (3, prefetcht0) holds one of the core's few L1 miss buffers (~24) for a whole DRAM latency, which
// caps a core near 24 lines per latency: 11-14 GB/s of bf16 weights on the 2-core Zen 4 dev VM
// against 19-22 GB/s with L2 prefetches and the loads hitting L2 (docs/benchmarks/cpu_executor.md).
#define EDGEMOE_PREFETCH_LOCALITY 2
#endif

namespace edgemoe {
namespace {

inline float bf16_bits_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---------------------------------------------------------------------------- weight formats
template <class V>
struct FmtF32 {
  using reg = typename V::reg;
  struct Row { const float* p; };
  static constexpr int kElemsPerLine = 16;
  static Row row(const WeightView& w, int64_t r) {
    return {reinterpret_cast<const float*>(static_cast<const char*>(w.data) + r * w.row_stride_bytes)};
  }
  static reg load(const Row& row, int64_t k) { return V::load_f32(row.p + k); }
  static reg load_tail(const Row& row, int64_t k, int n) { return V::load_f32_tail(row.p + k, n); }
  static float at(const Row& row, int64_t k) { return row.p[k]; }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + k); }
};

template <class V>
struct FmtBF16 {
  using reg = typename V::reg;
  struct Row { const uint16_t* p; };
  static constexpr int kElemsPerLine = 32;
  static Row row(const WeightView& w, int64_t r) {
    return {reinterpret_cast<const uint16_t*>(static_cast<const char*>(w.data) + r * w.row_stride_bytes)};
  }
  static reg load(const Row& row, int64_t k) { return V::load_bf16(row.p + k); }
  static reg load_tail(const Row& row, int64_t k, int n) { return V::load_bf16_tail(row.p + k, n); }
  static float at(const Row& row, int64_t k) { return bf16_bits_to_f32(row.p[k]); }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + k); }
};

// ---------------------------------------------------------------------------- quantized formats
// Scalar decoders, exact (the values of edgemoe/quant/dequant.py).
constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// FP8 E4M3 (float8_e4m3fn): the 7 magnitude bits placed at float32 bits 20..26 are the value scaled by
// 2^-120 (normal codes: exponent field e -> e + 0 with bias 127 instead of 7; subnormal codes m * 2^-9
// land on float32 subnormals), so one exact multiply by 2^120 restores it. 0x7f / 0xff are NaN.
inline float e4m3_to_f32(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return bits_to_f32(0x7fc00000u);
  const float mag = bits_to_f32(static_cast<uint32_t>(b & 0x7f) << 20) * 0x1p120f;
  return (b & 0x80) ? -mag : mag;
}

// E8M0: 2^(b - 127); b = 0 is the float32 subnormal 2^-127, b = 255 NaN.
inline float e8m0_to_f32(uint8_t b) {
  if (b == 255) return bits_to_f32(0x7fc00000u);
  return b == 0 ? bits_to_f32(0x00400000u) : bits_to_f32(static_cast<uint32_t>(b) << 23);
}

inline float fp4_at(const uint8_t* p, int64_t k) { return kE2M1[(p[k >> 1] >> ((k & 1) * 4)) & 0xf]; }

// Scale byte -> float32 tables (e4m3_to_f32, e8m0_to_f32), filled on first use; a Row keeps the pointer.
struct ScaleTables {
  float e4m3[256], e8m0[256];
  ScaleTables() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = e4m3_to_f32(static_cast<uint8_t>(b));
      e8m0[b] = e8m0_to_f32(static_cast<uint8_t>(b));
    }
  }
};
inline const ScaleTables& scale_tables() {
  static const ScaleTables t;
  return t;
}

// Quantized rows, post-scaled: a decoder D gives W lanes of a row's codes as their exact values, unscaled
// (raw: the e4m3 or e2m1 value itself, a float32 number), and the float32 scale of a group of elements:
//   struct Row { ... };  static Row row(const WeightView&, int64_t r);
//   static constexpr int kElemsPerLine;                  elements per 64 bytes of codes
//   static reg raw(const Row&, int64_t k);               elements [k, k + W), exact
//   static reg raw_tail(const Row&, int64_t k, int n);   the first n of them, the rest zero (V::kMasked only)
//   static float raw_at(const Row&, int64_t k);          one element
//   static float scale(const Row&, int64_t k);           the scale of the group holding element k
//   static const char* addr(const Row&, int64_t k);      byte address of element k (prefetch)
// micro_ps multiplies the raw values by the activation into a partial sum per group of G elements, then
// the partial sum by the group's scale: sum_g scale_g * sum_{k in g} code_k * x_k, the format's exact
// weights (code * scale) up to where float32 rounds, with one multiply per group instead of one per weight
// and no weight rounded to bf16 (the torch and GPU paths round code * scale to bf16 first when computing in
// bf16: the two agree within the bf16 tolerance).

// FP8 e4m3 with float32 block scales scale[r / scale_rows][k / scale_cols] (scale_cols a power of two >= 16).
template <class V>
struct RawFP8 {
  using reg = typename V::reg;
  struct Row { const uint8_t* p; const float* s; int shift; };
  static constexpr int kElemsPerLine = 64;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            reinterpret_cast<const float*>(static_cast<const char*>(w.scales) +
                                           (r / w.scale_rows) * w.scale_row_stride_bytes),
            __builtin_ctz(static_cast<unsigned>(w.scale_cols))};
  }
  static reg raw(const Row& row, int64_t k) {
    if constexpr (V::W == 1)
      return raw_at(row, k);
    else
      return V::e4m3(row.p + k);
  }
  static reg raw_tail(const Row& row, int64_t k, int n) { return V::e4m3_tail(row.p + k, n); }
  static float raw_at(const Row& row, int64_t k) { return e4m3_to_f32(row.p[k]); }
  static float scale(const Row& row, int64_t k) { return row.s[k >> row.shift]; }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + k); }
};

// FP4 (e2m1 nibbles, element k in the low nibble of byte k / 2 when k is even): MXFP4 (NV false) scales
// 2^(e8m0[r][k / 32] - 127), NVFP4 (NV true) float32(float(e4m3[r][k / 16]) * global_scale), the bracket
// rounded to float32 first as the reference does.
template <class V, bool NV>
struct RawFP4 {
  using reg = typename V::reg;
  struct Row { const uint8_t* p; const uint8_t* s; float g; const float* tab; };
  static constexpr int kElemsPerLine = 128;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, w.global_scale,
            NV ? scale_tables().e4m3 : scale_tables().e8m0};
  }
  static reg raw(const Row& row, int64_t k) {
    if constexpr (V::W == 1)
      return raw_at(row, k);
    else
      return V::fp4(row.p + (k >> 1));
  }
  static reg raw_tail(const Row& row, int64_t k, int n) { return V::fp4_tail(row.p + (k >> 1), n); }
  static float raw_at(const Row& row, int64_t k) { return fp4_at(row.p, k); }
  static float scale(const Row& row, int64_t k) {
    if constexpr (NV)
      return row.tab[row.s[k >> 4]] * row.g;
    else
      return row.tab[row.s[k >> 5]];
  }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + (k >> 1)); }
};

// ---------------------------------------------------------------------------- row streams
// The rows of a GEMV call as RB streams of q = nrows / RB consecutive rows, stream i = rows [i q, (i + 1) q) (offsets
// from row0), walked side by side: step r reads row r of every stream. Rows are contiguous in memory, so each stream
// is one sequential read in pages of its own. Blocks of RB adjacent rows instead put RB streams into one page (four
// FP4 rows of K = 2048 are one 4 KB page), re-started at every block, which the hardware prefetchers follow badly:
// one Zen 5 core read FP4 / FP8 rows 5-10 % faster as streams, two cores 3-38 %; the GPU host's Xeon its 4-bit rows
// 5-25 %, FP8 unchanged (docs/benchmarks/cpu_executor.md). A micro-kernel writes one block's outputs into yt
// ([token][stream], ldy RB) and scatter() puts them in place; tail() is the first row left for one-at-a-time calls.
// Every (row, token) sees the same operations either way: results do not depend on the layout.
template <int RB, int NT>
struct RowStreams {
  int64_t q;
  float yt[RB * NT];
  explicit RowStreams(int64_t nrows) : q(nrows / RB) {}
  int64_t row(int i, int64_t r) const { return i * q + r; }
  int64_t tail() const { return RB * q; }
  void scatter(int nt, int64_t r, float* y, int64_t ldy) const {
    for (int j = 0; j < nt; ++j)
      for (int i = 0; i < RB; ++i) y[j * ldy + i * q + r] = yt[j * RB + i];
  }
};

// ---------------------------------------------------------------------------- micro-kernel
// y[j * ldy + r] = <row r, a[j]> for r < RB, j < NT. `pf` is the unit of the prefetch distance in bytes (one row: the
// line EDGEMOE_PREFETCH_ROWS rows further down the row's stream is prefetched); every (r, j) sees the same sequence
// of operations whatever RB and NT are, so results do not depend on the tiling (nor on the thread count).
template <class V, class F, int RB, int NT>
inline void micro(const typename F::Row* rows, int64_t K, const float* const* a, float* y, int64_t ldy,
                  int64_t pf) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  constexpr int L = F::kElemsPerLine > W ? F::kElemsPerLine : W;  // elements per step (>= one line)
  reg acc[RB][NT];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) acc[r][j] = V::zero();

  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (EDGEMOE_PREFETCH_ROWS > 0) {
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r)
        __builtin_prefetch(F::addr(rows[r], k) + EDGEMOE_PREFETCH_ROWS * pf, 0, EDGEMOE_PREFETCH_LOCALITY);
    }
#pragma GCC unroll 32
    for (int u = 0; u < L; u += W) {
      reg wv[RB];
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) wv[r] = F::load(rows[r], k + u);
#pragma GCC unroll 8
      for (int j = 0; j < NT; ++j) {
        const reg av = V::load_f32(a[j] + k + u);
#pragma GCC unroll 16
        for (int r = 0; r < RB; ++r) acc[r][j] = V::fmadd(wv[r], av, acc[r][j]);
      }
    }
  }
  for (; k + W <= K; k += W) {
    reg wv[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) wv[r] = F::load(rows[r], k);
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) {
      const reg av = V::load_f32(a[j] + k);
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r) acc[r][j] = V::fmadd(wv[r], av, acc[r][j]);
    }
  }
  float tail[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NT; ++j) tail[r][j] = 0.0f;
  if (k < K) {
    if constexpr (V::kMasked) {  // one masked step: lanes past K load as zero
      const int n = static_cast<int>(K - k);
      reg wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = F::load_tail(rows[r], k, n);
      for (int j = 0; j < NT; ++j) {
        const reg av = V::load_f32_tail(a[j] + k, n);
        for (int r = 0; r < RB; ++r) acc[r][j] = V::fmadd(wv[r], av, acc[r][j]);
      }
    } else {  // scalar tail, summed after the vector part; an explicit fused multiply-add: the compiler's
              // choice to contract `t += w * x` or not differed between tilings (a token alone against the same
              // token in a batch differed in the last bit)
      for (; k < K; ++k)
        for (int r = 0; r < RB; ++r) {
          const float wk = F::at(rows[r], k);
          for (int j = 0; j < NT; ++j) tail[r][j] = __builtin_fmaf(wk, a[j][k], tail[r][j]);
        }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = V::hsum(acc[r][j]) + tail[r][j];
}

// Runs micro<RB, nt> for a token tile of nt <= NT tokens (templates instantiated only up to NT).
template <class V, class F, int RB, int NT>
inline void micro_tile(int nt, const typename F::Row* rows, int64_t K, const float* const* a, float* y,
                       int64_t ldy, int64_t pf) {
  if constexpr (NT >= 4) {
    if (nt == 4) return micro<V, F, RB, 4>(rows, K, a, y, ldy, pf);
  }
  if constexpr (NT >= 3) {
    if (nt == 3) return micro<V, F, RB, 3>(rows, K, a, y, ldy, pf);
  }
  if constexpr (NT >= 2) {
    if (nt == 2) return micro<V, F, RB, 2>(rows, K, a, y, ldy, pf);
  }
  micro<V, F, RB, 1>(rows, K, a, y, ldy, pf);
}

// ---------------------------------------------------------------------------- GEMV driver (GemvFn)
// RowStreams blocks of RB rows for tiles of NT tokens. Up to ByRow tokens (ByRow <= NT): the rows one after another
// instead, one sequential stream. Measured before the row streams, against blocks of four adjacent rows (four streams
// a page apart: a bf16 row of 2048 is 4 KB): on a Zen 5 core one token's bf16 rows consumed 0.68-0.80 of the core's
// read rate four at a time and 0.86-1.0 one at a time (both AVX-512 levels), two tokens' 0.64-0.68 and 0.80-0.86;
// with three or four tokens one row at a time was no faster, at the avx512 level slower
// (docs/benchmarks/cpu_executor.md). One row keeps one accumulator chain per token, so it needs the core to run a
// line's vector work within the multiply-add latency: the AVX2 kernels (four 8-wide FMAs a line of bf16) do not, and
// take row streams at every token count (ByRow 0). Every (row, token) sees the same operations either way: results
// are unchanged.
template <class V, class F, int RB, int NT, int ByRow = 0>
void gemv(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
          int64_t ldy) {
  static_assert(ByRow <= NT, "one tile of tokens");
  const float* const* a = reinterpret_cast<const float* const*>(act);
  typename F::Row rows[RB];
  if (n <= ByRow) {
    for (int64_t r = 0; r < nrows; ++r) {
      rows[0] = F::row(w, row0 + r);
      micro_tile<V, F, 1, NT>(n, rows, K, a, y + r, ldy, w.row_stride_bytes);
    }
    return;
  }
  RowStreams<RB, NT> s(nrows);
  for (int64_t r = 0; r < s.q; ++r) {
    for (int i = 0; i < RB; ++i) rows[i] = F::row(w, row0 + s.row(i, r));
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_tile<V, F, RB, NT>(nt, rows, K, a + j0, s.yt, RB, w.row_stride_bytes);
      s.scatter(nt, r, y + j0 * ldy, ldy);
    }
  }
  for (int64_t r = s.tail(); r < nrows; ++r) {  // row tail, one row at a time
    rows[0] = F::row(w, row0 + r);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_tile<V, F, 1, NT>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, w.row_stride_bytes);
    }
  }
}

// ---------------------------------------------------------------------------- register-kernel drivers
// A register kernel M for rows_tile / token_tiles provides Row, Act (the activation element type),
// row(w, r) and run<RB, NT>(rows, K, act, y, ldy, pf): RB rows x NT tokens (pf: bytes of one row, the unit of
// the prefetch distance). RowStreams blocks of RB rows for a tile of nt <= NT tokens (templates instantiated
// only up to NT), then the nrows % RB rows left one at a time.
template <class M, int RB, int NT>
inline void rows_tile(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const typename M::Act* const* a,
                      float* y, int64_t ldy) {
  typename M::Row rows[RB];
  RowStreams<RB, NT> s(nrows);
  for (int64_t r = 0; r < s.q; ++r) {
    for (int i = 0; i < RB; ++i) rows[i] = M::row(w, row0 + s.row(i, r));
    M::template run<RB, NT>(rows, K, a, s.yt, RB, w.row_stride_bytes);
    s.scatter(NT, r, y, ldy);
  }
  for (int64_t r = s.tail(); r < nrows; ++r) {
    rows[0] = M::row(w, row0 + r);
    M::template run<1, NT>(rows, K, a, y + r, ldy, w.row_stride_bytes);
  }
}

// Tokens in tiles of up to 4; a tile of nt tokens takes RowStreams blocks of RB<nt> rows.
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

// ---------------------------------------------------------------------------- post-scaled quantized rows
// y[j * ldy + r] = sum over groups g of scale_g * sum_{k in g} raw_k * a[j][k], RB rows x NT tokens, float32
// activations. Steps of whole lines and whole groups of G elements (G a multiple of W, one scale each; each step's
// lines of codes EDGEMOE_PREFETCH_ROWS rows further down each row's stream prefetched into L2), then the last K % G
// elements, which lie in one group: whole vectors, then a masked vector (V::kMasked) or scalar products (their
// group's scaled sum added after the vector part). Every (r, j) sees the same operations whatever RB and NT are, so
// results do not depend on the tiling (nor on the thread count). One vector of a group: the raw values at k + u times
// the activations, into the partial sums p (started at u 0).
template <class V, class D, int RB, int NT>
__attribute__((always_inline)) inline void ps_vector(const typename D::Row* rows, int64_t k, int u,
                                                     const float* const* a, typename V::reg (&p)[RB][NT]) {
  using reg = typename V::reg;
  reg wv[RB];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) wv[r] = D::raw(rows[r], k + u);
#pragma GCC unroll 4
  for (int j = 0; j < NT; ++j) {
    const reg av = V::load_f32(a[j] + k + u);
#pragma GCC unroll 8
    for (int r = 0; r < RB; ++r) p[r][j] = u == 0 ? V::mul(wv[r], av) : V::fmadd(wv[r], av, p[r][j]);
  }
}
// One whole group of G elements at k for RB rows x NT tokens: the raw values times the activations summed into a
// partial per (row, token), then acc += partial * the group's scale. Scalar code (W 1) unrolls 4 vectors, not 16:
// a whole NVFP4 step unrolled (8 groups x 16 elements x RB x NT products in one block) costs GCC 12's RTL combiner
// 40 s and 1.5 GB to compile.
template <class V, class D, int G, int RB, int NT>
__attribute__((always_inline)) inline void ps_group(const typename D::Row* rows, int64_t k, const float* const* a,
                                                    typename V::reg (&acc)[RB][NT]) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  reg p[RB][NT];
  if constexpr (W == 1) {
#pragma GCC unroll 4
    for (int u = 0; u < G; u += W) ps_vector<V, D, RB, NT>(rows, k, u, a, p);
  } else {
#pragma GCC unroll 16
    for (int u = 0; u < G; u += W) ps_vector<V, D, RB, NT>(rows, k, u, a, p);
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r) {
    const reg s = V::set1(D::scale(rows[r], k));
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = V::fmadd(p[r][j], s, acc[r][j]);
  }
}

template <class V, class D, int G, int RB, int NT>
inline void micro_ps(const typename D::Row* rows, int64_t K, const float* const* a, float* y, int64_t ldy,
                     int64_t pf) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  static_assert(G % W == 0, "a group is whole vectors");
  constexpr int L = D::kElemsPerLine > G ? D::kElemsPerLine : G;  // elements per step
  constexpr int kLines = L / D::kElemsPerLine;
  reg acc[RB][NT];
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) acc[r][j] = V::zero();
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    if constexpr (EDGEMOE_PREFETCH_ROWS > 0) {
#pragma GCC unroll 8
      for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
        for (int l = 0; l < kLines; ++l)
          __builtin_prefetch(D::addr(rows[r], k) + 64 * l + EDGEMOE_PREFETCH_ROWS * pf, 0,
                             EDGEMOE_PREFETCH_LOCALITY);
    }
#pragma GCC unroll 8
    for (int g = 0; g < L; g += G) ps_group<V, D, G, RB, NT>(rows, k + g, a, acc);
  }
  for (; k + G <= K; k += G) ps_group<V, D, G, RB, NT>(rows, k, a, acc);  // whole groups of a step cut short
  float tail[RB][NT];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < NT; ++j) tail[r][j] = 0.0f;
  if (k < K) {  // the last K % G elements: one group
    const int64_t k0 = k;
    reg p[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NT; ++j) p[r][j] = V::zero();
    for (; k + W <= K; k += W) {
      reg wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = D::raw(rows[r], k);
      for (int j = 0; j < NT; ++j) {
        const reg av = V::load_f32(a[j] + k);
        for (int r = 0; r < RB; ++r) p[r][j] = V::fmadd(wv[r], av, p[r][j]);
      }
    }
    float ps[RB][NT];
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < NT; ++j) ps[r][j] = 0.0f;
    if (k < K) {
      if constexpr (V::kMasked) {
        const int n = static_cast<int>(K - k);
        for (int r = 0; r < RB; ++r) {
          const reg wv = D::raw_tail(rows[r], k, n);
          for (int j = 0; j < NT; ++j) p[r][j] = V::fmadd(wv, V::load_f32_tail(a[j] + k, n), p[r][j]);
        }
      } else {
        for (; k < K; ++k)
          for (int r = 0; r < RB; ++r) {
            const float wk = D::raw_at(rows[r], k);
            for (int j = 0; j < NT; ++j) ps[r][j] = __builtin_fmaf(wk, a[j][k], ps[r][j]);  // fused: as micro's tail
          }
      }
    }
    for (int r = 0; r < RB; ++r) {
      const float sc = D::scale(rows[r], k0);
      for (int j = 0; j < NT; ++j) {
        acc[r][j] = V::fmadd(p[r][j], V::set1(sc), acc[r][j]);
        tail[r][j] = ps[r][j] * sc;
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NT; ++j) y[j * ldy + r] = V::hsum(acc[r][j]) + tail[r][j];
}
template <class V, class D, int G>
struct PostScaled {  // micro_ps as a register kernel
  using Row = typename D::Row;
  using Act = float;
  static Row row(const WeightView& w, int64_t r) { return D::row(w, r); }
  template <int RB, int NT>
  static void run(const Row* rows, int64_t K, const Act* const* a, float* y, int64_t ldy, int64_t pf) {
    micro_ps<V, D, G, RB, NT>(rows, K, a, y, ldy, pf);
  }
};

// GemvFns of the quantized formats over float32 activations, post-scaled; RBn: rows per block for a tile of
// n tokens (the register file: an accumulator and a partial sum per (row, token)).
template <class V, int RB1, int RB2, int RB3, int RB4>
void gemv_fp8_ps(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
                 int64_t ldy) {
  const float* const* a = reinterpret_cast<const float* const*>(act);
  using D = RawFP8<V>;
  switch (w.scale_cols) {  // a group never straddles two scale blocks
    case 16: return token_tiles<PostScaled<V, D, 16>, RB1, RB2, RB3, RB4>(w, row0, nrows, K, a, n, y, ldy);
    case 32: return token_tiles<PostScaled<V, D, 32>, RB1, RB2, RB3, RB4>(w, row0, nrows, K, a, n, y, ldy);
    case 64: return token_tiles<PostScaled<V, D, 64>, RB1, RB2, RB3, RB4>(w, row0, nrows, K, a, n, y, ldy);
    default: return token_tiles<PostScaled<V, D, 128>, RB1, RB2, RB3, RB4>(w, row0, nrows, K, a, n, y, ldy);
  }
}
template <class V, bool NV, int RB1, int RB2, int RB3, int RB4>
void gemv_fp4_ps(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
                 int64_t ldy) {
  const float* const* a = reinterpret_cast<const float* const*>(act);
  token_tiles<PostScaled<V, RawFP4<V, NV>, NV ? 16 : 32>, RB1, RB2, RB3, RB4>(w, row0, nrows, K, a, n, y, ldy);
}

// ---------------------------------------------------------------------------- read test (SumFn)
// Eight independent vector accumulators: enough loads in flight that the add latency never limits
// the read rate; the sum is returned so the compiler cannot drop the loads. With 64-byte vectors each
// line is prefetched into L2 4 KiB ahead (as the GEMVs prefetch), so the ceiling is a tuned read.
template <class V>
double sum_f32(const float* p, int64_t n) {
  using reg = typename V::reg;
  constexpr int W = V::W;
  reg acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = V::zero();
  const reg one = V::one();
  int64_t k = 0;
  for (; k + 8 * W <= n; k += 8 * W) {
    if constexpr (W >= 16 && EDGEMOE_SUM_PREFETCH) {  // a line per vector: L2 prefetch 4 KiB ahead
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(p + k + i * W) + 4096, 0, EDGEMOE_PREFETCH_LOCALITY);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) acc[i] = V::fmadd(V::load_f32(p + k + i * W), one, acc[i]);
  }
  double s = 0.0;
  for (int i = 0; i < 8; ++i) s += V::hsum(acc[i]);
  for (; k < n; ++k) s += p[k];
  return s;
}

}  // namespace
}  // namespace edgemoe

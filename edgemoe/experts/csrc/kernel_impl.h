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
//   for the quantized formats (W > 1): set1(f), mul(a, b), round_bf16(reg) (each lane to the nearest
//   bf16 value, ties to even), fp4(p) (W e2m1 values from W/2 packed bytes, low nibble first) and
//   e4m3(p) (W e4m3 values from W bytes), exact, and with kMasked fp4_tail(p, n), e4m3_tail(p, n).
//
// Structure of one GEMV call (rows [row0, row0 + nrows) of one expert bank, n tokens):
//   for each block of RB rows                 RB weight rows streamed side by side from DRAM
//     for each tile of NT tokens              the RB x K block is re-read from L1 for tiles >= 2
//       micro-kernel: RB x NT float accumulators held in registers across the whole K loop;
//       K is walked one 64-byte cache line of weights per step, and the same line of the row block
//       EDGEMOE_PREFETCH_BLOCKS ahead is software-prefetched into L2, so each thread keeps 2 x RB line
//       streams in flight (hardware prefetchers stop at 4 KiB page ends, and a bf16 row of H = 2048 is
//       exactly one page).
// RB x NT is chosen per ISA to fit the register file (AVX-512: 32 zmm -> 4 x 4; AVX2: 16 ymm -> 4 x 2).
// At T <= 8 the work is bound by the weight bytes read; arithmetic is far below the core's peak, so
// the kernel's job is to keep enough independent loads in flight and to read every weight byte once.
//
// A weight format is a traits struct (FmtF32, FmtBF16, and the quantized FmtFP8, FmtMXFP4, FmtNVFP4 below):
//   struct Row { ... };                          per-row state: data pointer, and e.g. the row's
//                                                block-scale pointer (from WeightView::scales)
//   static Row row(const WeightView&, int64_t r);
//   static constexpr int kElemsPerLine;          elements per 64 bytes of packed weights
//   static reg load(const Row&, int64_t k);      W dequantized float32 lanes, elements [k, k + W)
//   static reg load_tail(const Row&, int64_t k, int n);   (only when V::kMasked)
//   static float at(const Row&, int64_t k);      one dequantized element (scalar tails)
//   static const char* addr(const Row&, int64_t k);       byte address of element k (prefetch)
// registered as `gemv<V, Fmt, RB, NT>` (float formats) or `gemv_q<V, Fmt, RB, NT>` (quantized formats:
// float32 or bf16-rounded weights, WeightView::bf16_weights) in the ISA's table under its WeightFormat.
// The WeightView a kernel gets (executor.h, expert_matrix) already points at the projection's codes and
// scales in the expert's row: FP8 multiplies the converted lanes by the float32 scale of row
// r / scale_rows, column k / scale_cols (128 x 128); MXFP4 decodes nibbles through the 16-entry e2m1
// table and scales by 2^(e8m0 - 127) per 32 columns; NVFP4 scales by float32(float(e4m3) * global_scale)
// per 16 columns. The driver, tiling, threading and the executor are the same for every format.
// (AVX-512-BF16 has its own quantized kernels, which produce bf16 weights for `vdpbf16ps`:
// kernels_avx512bf16.cpp.)

#ifndef EDGEMOE_PREFETCH_BLOCKS
#define EDGEMOE_PREFETCH_BLOCKS 2  // prefetch distance in row blocks (0: hardware prefetch only)
#endif
#ifndef EDGEMOE_SUM_PREFETCH
#define EDGEMOE_SUM_PREFETCH 1  // the read test prefetches as the GEMVs do
#endif
#ifndef EDGEMOE_PREFETCH_LOCALITY
// __builtin_prefetch locality of the row-block prefetch: 2 = prefetcht1, into L2. A prefetch into L1
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

inline float round_to_bf16(float f) {  // nearest bf16 value, ties to even (as c10::BFloat16); NaN kept
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return f;
  u += 0x7fffu + ((u >> 16) & 1u);
  return bits_to_f32(u & 0xffff0000u);
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

template <class V, bool R>
inline typename V::reg maybe_round(typename V::reg v) {
  if constexpr (R) return V::round_bf16(v);
  return v;
}

// FP8 e4m3 with float32 block scales: W = e4m3 * scale[r / scale_rows][k / scale_cols]. scale_cols is
// a power of two >= 16 (128 in every release; native.py refuses others), so a vector of W <= 16
// elements at a multiple of W never straddles two scale blocks. R: round W to bf16 (bf16 compute).
template <class V, bool R>
struct FmtFP8 {
  using reg = typename V::reg;
  struct Row { const uint8_t* p; const float* s; int shift; };
  static constexpr int kElemsPerLine = 64;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            reinterpret_cast<const float*>(static_cast<const char*>(w.scales) +
                                           (r / w.scale_rows) * w.scale_row_stride_bytes),
            __builtin_ctz(static_cast<unsigned>(w.scale_cols))};
  }
  static reg load(const Row& row, int64_t k) {
    if constexpr (V::W == 1) {
      return at(row, k);
    } else {
      return maybe_round<V, R>(V::mul(V::e4m3(row.p + k), V::set1(row.s[k >> row.shift])));
    }
  }
  static reg load_tail(const Row& row, int64_t k, int n) {
    return maybe_round<V, R>(V::mul(V::e4m3_tail(row.p + k, n), V::set1(row.s[k >> row.shift])));
  }
  static float at(const Row& row, int64_t k) {
    const float v = e4m3_to_f32(row.p[k]) * row.s[k >> row.shift];
    return R ? round_to_bf16(v) : v;
  }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + k); }
};

// MXFP4: W = e2m1 * 2^(e8m0[r][k / 32] - 127); exact in float32 and in bf16 (an e2m1 value times a
// power of two), so R changes nothing.
template <class V, bool R>
struct FmtMXFP4 {
  using reg = typename V::reg;
  struct Row { const uint8_t* p; const uint8_t* s; const float* tab; };
  static constexpr int kElemsPerLine = 128;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, scale_tables().e8m0};
  }
  static reg load(const Row& row, int64_t k) {
    if constexpr (V::W == 1) {
      return at(row, k);
    } else {
      return V::mul(V::fp4(row.p + (k >> 1)), V::set1(row.tab[row.s[k >> 5]]));
    }
  }
  static reg load_tail(const Row& row, int64_t k, int n) {
    return V::mul(V::fp4_tail(row.p + (k >> 1), n), V::set1(row.tab[row.s[k >> 5]]));
  }
  static float at(const Row& row, int64_t k) { return fp4_at(row.p, k) * row.tab[row.s[k >> 5]]; }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + (k >> 1)); }
};

// NVFP4: W = e2m1 * (float(e4m3[r][k / 16]) * global_scale), the bracket rounded to float32 first.
template <class V, bool R>
struct FmtNVFP4 {
  using reg = typename V::reg;
  struct Row { const uint8_t* p; const uint8_t* s; float g; const float* tab; };
  static constexpr int kElemsPerLine = 128;
  static Row row(const WeightView& w, int64_t r) {
    return {static_cast<const uint8_t*>(w.data) + r * w.row_stride_bytes,
            static_cast<const uint8_t*>(w.scales) + r * w.scale_row_stride_bytes, w.global_scale,
            scale_tables().e4m3};
  }
  static float eff(const Row& row, int64_t k) { return row.tab[row.s[k >> 4]] * row.g; }
  static reg load(const Row& row, int64_t k) {
    if constexpr (V::W == 1) {
      return at(row, k);
    } else {
      return maybe_round<V, R>(V::mul(V::fp4(row.p + (k >> 1)), V::set1(eff(row, k))));
    }
  }
  static reg load_tail(const Row& row, int64_t k, int n) {
    return maybe_round<V, R>(V::mul(V::fp4_tail(row.p + (k >> 1), n), V::set1(eff(row, k))));
  }
  static float at(const Row& row, int64_t k) {
    const float v = fp4_at(row.p, k) * eff(row, k);
    return R ? round_to_bf16(v) : v;
  }
  static const char* addr(const Row& row, int64_t k) { return reinterpret_cast<const char*>(row.p + (k >> 1)); }
};

// ---------------------------------------------------------------------------- micro-kernel
// y[j * ldy + r] = <row r, a[j]> for r < RB, j < NT. `pf` is the prefetch distance in bytes (the
// same position one row block ahead); every (r, j) sees the same sequence of operations whatever RB
// and NT are, so results do not depend on the tiling (nor on the thread count).
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
    if constexpr (EDGEMOE_PREFETCH_BLOCKS > 0) {
#pragma GCC unroll 16
      for (int r = 0; r < RB; ++r)
        __builtin_prefetch(F::addr(rows[r], k) + EDGEMOE_PREFETCH_BLOCKS * pf, 0, EDGEMOE_PREFETCH_LOCALITY);
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
    } else {  // scalar tail, summed after the vector part
      for (; k < K; ++k)
        for (int r = 0; r < RB; ++r) {
          const float wk = F::at(rows[r], k);
          for (int j = 0; j < NT; ++j) tail[r][j] += wk * a[j][k];
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
template <class V, class F, int RB, int NT>
void gemv(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
          int64_t ldy) {
  const float* const* a = reinterpret_cast<const float* const*>(act);
  typename F::Row rows[RB];
  int64_t r = 0;
  for (; r + RB <= nrows; r += RB) {
    for (int i = 0; i < RB; ++i) rows[i] = F::row(w, row0 + r + i);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_tile<V, F, RB, NT>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, RB * w.row_stride_bytes);
    }
  }
  for (; r < nrows; ++r) {  // row tail, one row at a time
    rows[0] = F::row(w, row0 + r);
    for (int j0 = 0; j0 < n; j0 += NT) {
      const int nt = n - j0 < NT ? n - j0 : NT;
      micro_tile<V, F, 1, NT>(nt, rows, K, a + j0, y + j0 * ldy + r, ldy, w.row_stride_bytes);
    }
  }
}

// GemvFn of a quantized format: the float32 or the bf16-rounded dequantization (WeightView::bf16_weights),
// decided once per call.
template <class V, template <class, bool> class F, int RB, int NT>
void gemv_q(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n, float* y,
            int64_t ldy) {
  if (w.bf16_weights)
    gemv<V, F<V, true>, RB, NT>(w, row0, nrows, K, act, n, y, ldy);
  else
    gemv<V, F<V, false>, RB, NT>(w, row0, nrows, K, act, n, y, ldy);
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

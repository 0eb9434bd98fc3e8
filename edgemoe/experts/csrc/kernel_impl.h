// Generic row-block GEMV, instantiated once per ISA by kernels_<isa>.cpp.
//
// Include contract (this file has no #include of its own, on purpose):
//   1. the including file first includes its intrinsics header, <cstdint>, <cstring>, "kernels.h";
//   2. then switches the target with `#pragma GCC push_options` / `#pragma GCC target("...")`;
//   3. then defines its vector traits `V` (below) and includes this file.
// Everything defined here lives in an anonymous namespace, so each translation unit gets its own
// copy compiled for its own target and no symbol compiled for AVX-512 can be merged by the linker
// into code that runs on a CPU without it (the classic ODR trap of per-file target flags). Standard
// library templates are never instantiated in here for the same reason.
//
// Vector traits `V` (one per ISA) provide:
//   reg, W (float lanes), kMasked (has masked loads), zero(), one(), fmadd(a, b, c) = a*b + c, hsum(reg),
//   load_f32(p), load_f32_tail(p, n), load_bf16(p), load_bf16_tail(p, n)   (tails zero lanes >= n).
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
// Adding a weight format (the dequant-in-kernel hook): write a format traits struct like FmtBF16 —
//   struct Row { ... };                          per-row state: data pointer, and e.g. the row's
//                                                block-scale pointer (from WeightView::scales)
//   static Row row(const WeightView&, int64_t r);
//   static constexpr int kElemsPerLine;          elements per 64 bytes of packed weights
//   static reg load(const Row&, int64_t k);      W dequantized float32 lanes, elements [k, k + W)
//   static reg load_tail(const Row&, int64_t k, int n);   (only when V::kMasked)
//   static float at(const Row&, int64_t k);      one dequantized element (scalar tails)
//   static const char* addr(const Row&, int64_t k);       byte address of element k (prefetch)
// — and register `gemv<V, FmtNew, RB, NT>` in the ISA's table under its WeightFormat. The WeightView a
// kernel gets (executor.h, expert_matrix) already points at the projection's codes and scales in the
// expert's row: FP8 multiplies the converted lanes by the float32 scale of row r / scale_rows, column
// k / scale_cols (128 x 128); MXFP4 decodes nibbles through a 16-entry table and scales by
// 2^(e8m0 - 127) per 32 columns; NVFP4 scales by float(e4m3) * global_scale per 16 columns. The
// driver, tiling, threading and the executor do not change.

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

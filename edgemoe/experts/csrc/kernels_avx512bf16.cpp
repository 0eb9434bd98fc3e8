// AVX-512-BF16 kernel for bf16 weights: `vdpbf16ps` multiplies 32 bf16 pairs and accumulates into
// 16 float32 lanes, so one 64-byte line of weights is one instruction per token, with no widening
// of the weights. Both operands must be bf16: the executor rounds x and the SiLU·up activation to
// bf16 for this kernel (round-to-nearest-even, exactly as torch's .to(bfloat16)), which is what the
// torch path and the GPU path compute with too. float32 weights have no kernel at this level:
// select_isa() then picks the AVX-512F one.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

#ifndef EDGEMOE_PREFETCH_BLOCKS
#define EDGEMOE_PREFETCH_BLOCKS 2  // prefetch distance in row blocks (0: hardware prefetch only)
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

// The read test needs no bf16 instruction: the AVX-512F sum is reused through kernels_avx512().

}  // namespace
}  // namespace edgemoe

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx512bf16() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    t.by_format[int(WeightFormat::BF16)] = {&gemv_bf16_dp, ActFormat::BF16,
                                            kernels_avx512().by_format[int(WeightFormat::F32)].sum_f32};
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

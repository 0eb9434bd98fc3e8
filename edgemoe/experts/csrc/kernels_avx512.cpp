// AVX-512 kernels (16 float lanes; AVX-512F for the math, BW + VL for masked 16-bit tail loads).
// Compiled for that target with a pragma; only called after select_isa() saw the features in cpuid
// and the OS's xgetbv said it saves the zmm/opmask state.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")

namespace edgemoe {
namespace {

struct Vec512 {
  using reg = __m512;
  static constexpr int W = 16;
  static constexpr bool kMasked = true;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg one() { return _mm512_set1_ps(1.0f); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static float hsum(reg a) { return _mm512_reduce_add_ps(a); }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }  // 0 < n < 16
  static reg load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static reg load_f32_tail(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  // bf16 -> f32: zero-extend each 16-bit pattern to 32 bits and shift it into the high half.
  static reg load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static reg load_bf16_tail(const uint16_t* p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask(n), p);  // masked-off lanes never touch memory
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

}  // namespace
}  // namespace edgemoe

#include "kernel_impl.h"

namespace edgemoe {
namespace {

// Non-template entry points defined inside the target region, so the templates are instantiated
// for this ISA; the table below is built outside it (it must run on any CPU).
// 32 zmm registers: 4 rows x 4 tokens = 16 accumulators + 4-8 weight vectors + 1 activation.
void gemv_f32_avx512(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                     float* y, int64_t ldy) {
  gemv<Vec512, FmtF32<Vec512>, 4, 4>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_bf16_avx512(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                      float* y, int64_t ldy) {
  gemv<Vec512, FmtBF16<Vec512>, 4, 4>(w, row0, nrows, K, act, n, y, ldy);
}
double sum_f32_avx512(const float* p, int64_t n) { return sum_f32<Vec512>(p, n); }

}  // namespace
}  // namespace edgemoe

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx512() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    t.by_format[int(WeightFormat::F32)] = {&gemv_f32_avx512, ActFormat::F32, &sum_f32_avx512};
    t.by_format[int(WeightFormat::BF16)] = {&gemv_bf16_avx512, ActFormat::F32, &sum_f32_avx512};
    return t;
  }();
  return k;
}

}  // namespace edgemoe


#else

namespace edgemoe {
const IsaKernels& kernels_avx512() {
  static const IsaKernels k{};
  return k;
}
}  // namespace edgemoe

#endif

// AVX2 + FMA kernels (8 float lanes). Compiled for that target with a pragma so the rest of the
// binary stays baseline x86-64; only called after select_isa() saw avx2 and fma in cpuid.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace edgemoe {
namespace {

struct Vec256 {
  using reg = __m256;
  static constexpr int W = 8;
  static constexpr bool kMasked = false;  // tails are summed in scalar code
  static reg zero() { return _mm256_setzero_ps(); }
  static reg one() { return _mm256_set1_ps(1.0f); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float hsum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static reg load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static reg load_f32_tail(const float* p, int) { return _mm256_loadu_ps(p); }  // unused (kMasked false)
  // bf16 -> f32: widen the 16-bit pattern to 32 bits and shift it into the high half.
  static reg load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static reg load_bf16_tail(const uint16_t* p, int) { return load_bf16(p); }  // unused
};

}  // namespace
}  // namespace edgemoe

#include "kernel_impl.h"

namespace edgemoe {
namespace {

// Non-template entry points defined inside the target region, so the templates are instantiated
// for this ISA; the table below is built outside it (it must run on any CPU).
// 16 ymm registers: 4 rows x 2 tokens = 8 accumulators + 4 weight vectors + 1 activation.
void gemv_f32_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                   float* y, int64_t ldy) {
  gemv<Vec256, FmtF32<Vec256>, 4, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_bf16_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                    float* y, int64_t ldy) {
  gemv<Vec256, FmtBF16<Vec256>, 4, 2>(w, row0, nrows, K, act, n, y, ldy);
}
double sum_f32_avx2(const float* p, int64_t n) { return sum_f32<Vec256>(p, n); }

}  // namespace
}  // namespace edgemoe

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx2() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    t.by_format[int(WeightFormat::F32)] = {&gemv_f32_avx2, ActFormat::F32, &sum_f32_avx2};
    t.by_format[int(WeightFormat::BF16)] = {&gemv_bf16_avx2, ActFormat::F32, &sum_f32_avx2};
    return t;
  }();
  return k;
}

}  // namespace edgemoe


#else  // not x86: no AVX2 kernels

namespace edgemoe {
const IsaKernels& kernels_avx2() {
  static const IsaKernels k{};
  return k;
}
}  // namespace edgemoe

#endif

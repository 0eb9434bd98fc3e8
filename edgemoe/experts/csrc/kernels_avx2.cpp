// AVX2 + FMA kernels (8 float lanes). Compiled for that target with a pragma so the rest of the
// binary stays baseline x86-64; only called after select_isa() saw avx2 and fma in cpuid.
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "kernel_impl.h"

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
  // ---- quantized formats
  static reg set1(float f) { return _mm256_set1_ps(f); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  // 4 bytes -> 8 codes in element order: the 32 bits broadcast, dword lane i shifted right by 4i; vpermps
  // uses 3 index bits, so the table gives the magnitude and bit 3 of the code is moved to the sign.
  static reg fp4(const uint8_t* p) {
    int32_t b4;
    std::memcpy(&b4, p, sizeof b4);
    const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(b4), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(kE2M1), idx);
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm256_or_ps(mag, _mm256_castsi256_ps(sign));
  }
  // e4m3 bytes sign-extended, shifted left by 20, masked: sign on bit 31, magnitude on bits 20..26
  // (see e4m3_to_f32); the multiply by 2^120 rescales exactly.
  static reg e4m3(const uint8_t* p) {
    const __m256i d = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
    const __m256i f = _mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0x87f00000u)));
    return _mm256_mul_ps(_mm256_castsi256_ps(f), _mm256_set1_ps(0x1p120f));
  }
};

}  // namespace
}  // namespace edgemoe

namespace edgemoe {
namespace {

// Non-template entry points defined inside the target region, so the templates are instantiated
// for this ISA; the table below is built outside it (it must run on any CPU).
// 16 ymm registers: 4 rows x 2 tokens = 8 accumulators + 4 weight vectors + 1 activation; the quantized
// (post-scaled) kernels also hold a partial sum per (row, token): 4 rows x 1 token, 2 x 2, 1 x 3-4.
void gemv_f32_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                   float* y, int64_t ldy) {
  gemv<Vec256, FmtF32<Vec256>, 4, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_bf16_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                    float* y, int64_t ldy) {
  gemv<Vec256, FmtBF16<Vec256>, 4, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_fp8_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                   float* y, int64_t ldy) {
  gemv_fp8_ps<Vec256, 4, 2, 1, 1>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_mxfp4_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                     float* y, int64_t ldy) {
  gemv_fp4_ps<Vec256, false, 4, 2, 1, 1>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_nvfp4_avx2(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                     float* y, int64_t ldy) {
  gemv_fp4_ps<Vec256, true, 4, 2, 1, 1>(w, row0, nrows, K, act, n, y, ldy);
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
    t.by_format[int(WeightFormat::FP8_E4M3_BLOCK)] = {&gemv_fp8_avx2, ActFormat::F32, &sum_f32_avx2};
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_mxfp4_avx2, ActFormat::F32, &sum_f32_avx2};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_nvfp4_avx2, ActFormat::F32, &sum_f32_avx2};
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

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

#include "kernel_impl.h"

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
  // ---- quantized formats
  static reg set1(float f) { return _mm512_set1_ps(f); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  // 8 bytes -> 16 codes in element order: dword lane i takes the 32-bit half holding code i and shifts
  // it right by 4 * (i % 8); the low nibble indexes the e2m1 table (vpermps uses 4 index bits: the
  // sign is the table's upper half).
  static reg fp4_decode(__m128i b8) {
    const __m512i half = _mm512_permutexvar_epi32(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                                                  _mm512_castsi128_si512(b8));
    const __m512i codes = _mm512_srlv_epi32(half, _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16, 12,
                                                                   8, 4, 0));
    return _mm512_permutexvar_ps(codes, _mm512_loadu_ps(kE2M1));  // uses index bits 0..3 only
  }
  static reg fp4(const uint8_t* p) { return fp4_decode(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static reg fp4_tail(const uint8_t* p, int n) {
    const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << ((n + 1) / 2)) - 1u), p);
    return _mm512_maskz_mov_ps(mask(n), fp4_decode(b));
  }
  // e4m3 byte, sign-extended to 32 bits, shifted left by 20: the sign lands on bit 31 and the 7
  // magnitude bits on bits 20..26; the mask keeps those (see e4m3_to_f32), the multiply rescales.
  static reg e4m3_decode(__m128i b16) {
    const __m512i d = _mm512_slli_epi32(_mm512_cvtepi8_epi32(b16), 20);
    const __m512i f = _mm512_and_si512(d, _mm512_set1_epi32(static_cast<int>(0x87f00000u)));
    return _mm512_mul_ps(_mm512_castsi512_ps(f), _mm512_set1_ps(0x1p120f));
  }
  static reg e4m3(const uint8_t* p) { return e4m3_decode(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static reg e4m3_tail(const uint8_t* p, int n) { return e4m3_decode(_mm_maskz_loadu_epi8(mask(n), p)); }
};

}  // namespace
}  // namespace edgemoe

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
  gemv<Vec512, FmtBF16<Vec512>, 4, 4, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_fp8_avx512(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                     float* y, int64_t ldy) {
  gemv_fp8_ps<Vec512, 4, 4, 2, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_mxfp4_avx512(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                       float* y, int64_t ldy) {
  gemv_fp4_ps<Vec512, false, 4, 4, 2, 2>(w, row0, nrows, K, act, n, y, ldy);
}
void gemv_nvfp4_avx512(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act, int n,
                       float* y, int64_t ldy) {
  gemv_fp4_ps<Vec512, true, 4, 4, 2, 2>(w, row0, nrows, K, act, n, y, ldy);
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
    t.by_format[int(WeightFormat::FP8_E4M3_BLOCK)] = {&gemv_fp8_avx512, ActFormat::F32, &sum_f32_avx512};
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_mxfp4_avx512, ActFormat::F32, &sum_f32_avx512};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_nvfp4_avx512, ActFormat::F32, &sum_f32_avx512};
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

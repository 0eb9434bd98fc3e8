// AVX2 integer kernels: the FP4 formats computing in bf16 on CPUs with AVX2 but neither AVX-VNNI nor AVX-512 (AMD
// Zen 2 and Zen 3, Intel's client cores before Alder Lake), the integer kernels of fp4_int256.h with AVX2's
// `vpmaddubsw` + `vpmaddwd` + `vpaddd` as their byte dot product, in place of the avx2 level's float32 FMAs on
// decoded weights (on a Zen 5 core's 256-bit path, forced: MXFP4 / NVFP4 about 16.5 GB/s at one thread against 8-9;
// docs/benchmarks/cpu_executor.md). Every other format has no kernel at this level (it falls through to avx2).
#include <algorithm>
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
struct DotAvx2 {  // vpdpbusd's sum of four u8 x s8 products per int32 lane, in AVX2: exact for these operands
  static __m256i dp(__m256i acc, __m256i u8, __m256i s8) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)));
  }
};
}  // namespace
}  // namespace edgemoe

#include "fp4_int256.h"

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx2int() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    const SumFn sum = kernels_avx2().by_format[int(WeightFormat::F32)].sum_f32;
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_fp4_int256<DotAvx2, false>, ActFormat::Q15_LANES, sum, 0,
                                             &q15_store_avx2};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_fp4_int256<DotAvx2, true>, ActFormat::Q15_LANES, sum, 0,
                                             &q15_store_avx2};
    return t;
  }();
  return k;
}

}  // namespace edgemoe

#else  // not x86

namespace edgemoe {
const IsaKernels& kernels_avx2int() {
  static const IsaKernels k{};
  return k;
}
}  // namespace edgemoe

#endif

// AVX-VNNI kernels (256-bit `vpdpbusd`, VEX-encoded): the FP4 formats computing in bf16 on CPUs that have AVX2
// and AVX-VNNI but no AVX-512 (Intel's client cores since Alder Lake: the gaming PCs and laptops edgemoe is
// for), the integer kernels of fp4_int256.h with `vpdpbusd` as their byte dot product. Every other format has no
// kernel at this level (select_isa falls through to the levels below).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")

#include "kernel_impl.h"

namespace edgemoe {
namespace {
struct DotVnni {  // vpdpbusd on 256-bit registers (VEX)
  static __m256i dp(__m256i acc, __m256i u8, __m256i s8) { return _mm256_dpbusd_avx_epi32(acc, u8, s8); }
};
}  // namespace
}  // namespace edgemoe

#include "fp4_int256.h"

#pragma GCC pop_options

namespace edgemoe {

const IsaKernels& kernels_avx2vnni() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    const SumFn sum = kernels_avx2().by_format[int(WeightFormat::F32)].sum_f32;
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_fp4_int256<DotVnni, false>, ActFormat::Q15_LANES, sum, 0,
                                             &q15_store_avx2};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_fp4_int256<DotVnni, true>, ActFormat::Q15_LANES, sum, 0,
                                             &q15_store_avx2};
    return t;
  }();
  return k;
}

}  // namespace edgemoe

#else  // not x86

namespace edgemoe {
const IsaKernels& kernels_avx2vnni() {
  static const IsaKernels k{};
  return k;
}
}  // namespace edgemoe

#endif

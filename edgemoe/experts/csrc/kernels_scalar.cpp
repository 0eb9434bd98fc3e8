// Scalar kernels: the baseline every x86-64 (and any other) CPU runs; also the reference point the
// vector kernels are tested against. Compiled without any target pragma.
#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "kernel_impl.h"

namespace edgemoe {
namespace {

struct VecScalar {
  using reg = float;
  static constexpr int W = 1;
  static constexpr bool kMasked = false;
  static reg zero() { return 0.0f; }
  static reg one() { return 1.0f; }
  static reg fmadd(reg a, reg b, reg c) { return a * b + c; }
  static float hsum(reg a) { return a; }
  static reg load_f32(const float* p) { return *p; }
  static reg load_f32_tail(const float* p, int) { return *p; }
  static reg load_bf16(const uint16_t* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  static reg load_bf16_tail(const uint16_t* p, int) { return load_bf16(p); }
  static reg set1(float f) { return f; }
  static reg mul(reg a, reg b) { return a * b; }
};

}  // namespace
}  // namespace edgemoe

namespace edgemoe {

const IsaKernels& kernels_scalar() {
  static const IsaKernels k = [] {
    IsaKernels t{};
    t.by_format[int(WeightFormat::F32)] = {&gemv<VecScalar, FmtF32<VecScalar>, 4, 2>, ActFormat::F32,
                                           &sum_f32<VecScalar>};
    t.by_format[int(WeightFormat::BF16)] = {&gemv<VecScalar, FmtBF16<VecScalar>, 4, 2>, ActFormat::F32,
                                            &sum_f32<VecScalar>};
    t.by_format[int(WeightFormat::FP8_E4M3_BLOCK)] = {&gemv_fp8_ps<VecScalar, 4, 2, 2, 1>, ActFormat::F32,
                                                      &sum_f32<VecScalar>};
    t.by_format[int(WeightFormat::MXFP4)] = {&gemv_fp4_ps<VecScalar, false, 4, 2, 2, 1>, ActFormat::F32,
                                             &sum_f32<VecScalar>};
    t.by_format[int(WeightFormat::NVFP4)] = {&gemv_fp4_ps<VecScalar, true, 4, 2, 2, 1>, ActFormat::F32,
                                             &sum_f32<VecScalar>};
    return t;
  }();
  return k;
}

}  // namespace edgemoe

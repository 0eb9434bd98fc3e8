// Scalar kernels: the baseline every x86-64 (and any other) CPU runs; also the reference point the
// vector kernels are tested against. Compiled without any target pragma.
#include <algorithm>
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

// ---------------------------------------------------------------------------- Q15_LANES activations
namespace edgemoe {

namespace {
// q of one bf16 element (bits u) in a lane whose largest exponent field is emax (1 .. 254): its significand
// (implicit bit included; a subnormal's counts as exponent field 1) shifted by e - emax + 6, rounded half to even.
inline int32_t q15_of(uint16_t u, int emax) {
  const int e = (u >> 7) & 0xff;
  const int32_t sig = e ? 128 + (u & 0x7f) : (u & 0x7f);
  const int d = emax - (e ? e : 1) - 6;  // right shift (>= -6: a left shift for the lane's largest binades)
  int32_t v;
  if (d <= 0) {
    v = sig << -d;
  } else if (d > 8) {
    v = 0;  // below half of one unit (sig < 2^8)
  } else {
    v = sig >> d;
    const int32_t rem = sig & ((1 << d) - 1), half = 1 << (d - 1);
    v += rem > half || (rem == half && (v & 1));
  }
  return u & 0x8000 ? -v : v;
}
}  // namespace

void q15_lanes_store(uint8_t* row, int64_t k0, const uint16_t* x, int64_t n) {
  for (int64_t l = 0; l < n; l += 8) {
    const int64_t k = k0 + l, j = (k % 128) / 8, m = n - l < 8 ? n - l : 8;
    uint8_t* blk = row + (k / 128) * kQ15BlockBytes;
    uint16_t u[8] = {};
    int emax = 0;
    bool any = false;
    for (int64_t e = 0; e < m; ++e) {
      u[e] = x[l + e];
      emax = std::max(emax, (u[e] >> 7) & 0xff);
      any = any || (u[e] & 0x7fff);
    }
    int32_t q[8] = {};
    uint32_t half_scale;  // float32 bits of the lane's scale / 2
    if (emax == 255) {  // an infinity or NaN: the lane's products are NaN
      half_scale = 0x7fc00000u;
    } else if (emax > 0) {  // largest |x| in [2^(emax - 127), 2^(emax - 126)): q = x * 2^(140 - emax)
      for (int e = 0; e < 8; ++e) q[e] = q15_of(u[e], emax);
      half_scale = emax > 15 ? static_cast<uint32_t>(emax - 14) << 23 : 1u << (emax + 8);  // 2^(emax - 141)
    } else if (any) {  // only subnormals: x = m * 2^-133, largest m in [2^(b - 1), 2^b): q = m * 2^(14 - b)
      int b = 0;
      for (int e = 0; e < 8; ++e) b = std::max(b, 32 - __builtin_clz(static_cast<uint32_t>(u[e] & 0x7f) | 1u));
      for (int e = 0; e < 8; ++e) q[e] = (u[e] & 0x8000 ? -1 : 1) * (static_cast<int32_t>(u[e] & 0x7f) << (14 - b));
      half_scale = 1u << (b + 1);  // 2^(b - 134 - 14) = 2^(b - 148), the subnormal float 2^(b + 1) * 2^-149
    } else {
      half_scale = 0;
    }
    int32_t sum = 0;
    for (int e = 0; e < 8; ++e) {
      const int32_t hi = q[e] >> 7;  // floor: q = 128 * hi + lo, lo in [0, 127]; |q| < 2^14, so hi fits int8
      const int64_t byte = 4 * j + e / 2 + 64 * (e & 1);
      blk[byte] = static_cast<uint8_t>(static_cast<int8_t>(hi));
      blk[128 + byte] = static_cast<uint8_t>(q[e] - 128 * hi);
      sum += q[e];
    }
    const int32_t corr = -12 * sum;
    std::memcpy(blk + 256 + 4 * j, &corr, 4);
    std::memcpy(blk + 320 + 4 * j, &half_scale, 4);
  }
}

void q15_lanes_clear_tail(uint8_t* row, int64_t K) {
  if (K % 128 == 0) return;
  uint8_t* blk = row + (K / 128) * kQ15BlockBytes;
  for (int64_t j = (K % 128 + 7) / 8; j < 16; ++j) {
    for (int h = 0; h < 4; ++h) std::memset(blk + 64 * h + 4 * j, 0, 4);
    std::memset(blk + 256 + 4 * j, 0, 4);
    std::memset(blk + 320 + 4 * j, 0, 4);
  }
}

}  // namespace edgemoe

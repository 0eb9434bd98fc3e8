// Runtime ISA detection and kernel selection. Baseline code (no target pragma): it runs before we
// know what the CPU supports.
#include <cstdint>

#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace edgemoe {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx2Int: return "avx2int";
    case Isa::Avx2Vnni: return "avx2vnni";
    case Isa::Avx512: return "avx512";
    case Isa::Avx512Bf16: return "avx512bf16";
  }
  return "unknown";
}

#if defined(__x86_64__) || defined(__i386__)
namespace {

uint64_t xgetbv0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

// cpuid bits (Intel SDM vol. 2A, CPUID): leaf 1 ecx: fma 12, osxsave 27, f16c 29; leaf 7.0 ebx:
// avx2 5, avx512f 16, avx512bw 30, avx512vl 31; leaf 7.0 ecx: avx512_vnni 11; leaf 7.0 edx: avx512fp16 23,
// amx-bf16 22;
// leaf 7.1 eax: avx_vnni 4, avx512_bf16 5. XCR0 (xgetbv 0): 0x6 = SSE+AVX state, 0xE0 = opmask+zmm state.
uint32_t detect_x86() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return 0;
  const uint64_t xcr0 = xgetbv0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_avx512 = os_avx && (xcr0 & 0xE0) == 0xE0;
  if (!os_avx) return 0;
  uint32_t f = 0;
  if (fma) f |= kFeatFma;
  if (f16c) f |= kFeatF16C;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned max_sub = a;
  if (b & (1u << 5)) f |= kFeatAvx2;
  if (os_avx512) {
    if (b & (1u << 16)) f |= kFeatAvx512F;
    if (b & (1u << 30)) f |= kFeatAvx512BW;
    if (b & (1u << 31)) f |= kFeatAvx512VL;
    if (c & (1u << 11)) f |= kFeatAvx512Vnni;
    if (d & (1u << 23)) f |= kFeatAvx512Fp16;
  }
  if (d & (1u << 22)) f |= kFeatAmxBf16;  // reported only (tile state also needs an OS opt-in)
  if (max_sub >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    if (a & (1u << 4)) f |= kFeatAvxVnni;
    if (os_avx512 && (a & (1u << 5))) f |= kFeatAvx512Bf16;
  }
  return f;
}

}  // namespace

uint32_t detect_cpu_features() {
  static const uint32_t f = detect_x86();
  return f;
}
#else
uint32_t detect_cpu_features() { return 0; }
#endif

const IsaKernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16: return kernels_avx512bf16();
    case Isa::Avx512: return kernels_avx512();
    case Isa::Avx2Vnni: return kernels_avx2vnni();
    case Isa::Avx2Int: return kernels_avx2int();
    case Isa::Avx2: return kernels_avx2();
    case Isa::Scalar: break;
  }
  return kernels_scalar();
}

namespace {
bool isa_supported(uint32_t f, Isa isa) {
  constexpr uint32_t avx512 = kFeatAvx512F | kFeatAvx512BW | kFeatAvx512VL;
  switch (isa) {
    case Isa::Scalar: return true;
    case Isa::Avx2:
    case Isa::Avx2Int: return (f & (kFeatAvx2 | kFeatFma)) == (kFeatAvx2 | kFeatFma);
    case Isa::Avx2Vnni: return (f & (kFeatAvx2 | kFeatFma | kFeatAvxVnni)) == (kFeatAvx2 | kFeatFma | kFeatAvxVnni);
    case Isa::Avx512: return (f & avx512) == avx512;
    case Isa::Avx512Bf16: return (f & (avx512 | kFeatAvx512Bf16)) == (avx512 | kFeatAvx512Bf16);
  }
  return false;
}
}  // namespace

int select_isa(uint32_t features, int cap, WeightFormat fmt, bool bf16_compute) {
  const int f = static_cast<int>(fmt);
  if (f < 0 || f >= kNumFormats) return -1;
  if (cap < 0 || cap >= kNumIsa) cap = kNumIsa - 1;
  for (int level = cap; level >= 0; --level) {
    const Isa isa = static_cast<Isa>(level);
    const KernelSet& ks = kernels_for(isa).by_format[f];
    if (isa_supported(features, isa) && ks.gemv != nullptr && (features & ks.needs) == ks.needs &&
        (bf16_compute || ks.act == ActFormat::F32))
      return level;
  }
  return -1;
}

}  // namespace edgemoe

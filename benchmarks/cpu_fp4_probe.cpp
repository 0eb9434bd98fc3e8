// Where one Intel core's time goes in a one-token FP4 GEMV (the native executor's AVX-512-BF16 MXFP4 / NVFP4
// kernels, kernels_avx512bf16.cpp): instruction throughput, and the rate at which a line of codes is consumed
// from DRAM and from L2 with less and less work per line. A standalone probe, not part of the package:
//
//     g++ -O2 -march=sapphirerapids benchmarks/cpu_fp4_probe.cpp -o /tmp/fp4_probe && /tmp/fp4_probe
//
// Needs AVX-512-BF16, VNNI and VBMI; the AMX rows need AMX-BF16 and a kernel that grants the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM), and are skipped otherwise. Prints:
//   1. reciprocal throughput (cycles) of each instruction the FP4 kernel issues, eight independent copies per
//      loop iteration, in clock cycles of a dependent `vpaddd` chain (1 cycle each);
//   2. GB/s of packed codes of a one-token NVFP4 GEMV over 768 rows x K 2048 (768 KB: one expert's gate rows),
//      from L2 (one matrix, reused) and from DRAM (a matrix drawn at random from 600 MB each call), for:
//        loads    the 64-byte lines read (and XORed) only, with the kernel's prefetch;
//        decode   plus the four `vpermw` e2m1 lookups and three shifts per line;
//        kernel   plus the four `vdpbf16ps` and the post-scale FMA: the executor's bf16 kernel until 2026-12-06, one
//                 row block of 4;
//        vnni2    the integer kernel the executor runs since: `vpshufb` lookups of 2 * e2m1 + 12 and four `vpdpbusd`
//                 against the activation as 15-bit lanes of 8 in two int8 limbs (kernels.h, Q15_LANES);
//        vnni1    the same with the high limb only (8-bit activations, as llama.cpp quantizes them): not used, for
//                 the cost of the second limb;
//        amx      16 rows per panel, each line decoded into a 4 KB tile buffer, then four TDPBF16PS per block of
//                 128 against block-diagonal activation tiles (one column per scale group), flushed into
//                 float32 accumulators with the scales every two blocks.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <algorithm>
#include <random>
#include <vector>

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ------------------------------------------------------------------ 1. instruction throughput
constexpr long kIter = 20000000;
#define X8(s) s s s s s s s s
#define PROBE(name, body)                                                                       \
  {                                                                                            \
    double best = 1e9;                                                                         \
    for (int t = 0; t < 3; ++t) {                                                              \
      const double t0 = now();                                                                 \
      for (long i = 0; i < kIter; ++i)                                                         \
        __asm__ volatile(body ::: "xmm1", "xmm2", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", \
                         "xmm15", "xmm16", "xmm17");                                          \
      best = std::min(best, now() - t0);                                                       \
    }                                                                                          \
    std::printf("  %-28s %.2f cycles\n", name, best * 1e9 / (kIter * 8.0) * ghz);              \
  }

void instruction_table() {
  double ghz;
  {
    double best = 1e9;
    for (int t = 0; t < 3; ++t) {
      const double t0 = now();
      for (long i = 0; i < kIter; ++i) __asm__ volatile(X8("vpaddd %%zmm1,%%zmm1,%%zmm1\n\t") ::: "xmm1");
      best = std::min(best, now() - t0);
    }
    ghz = kIter * 8.0 / (best * 1e9);
  }
  std::printf("1. reciprocal throughput, zmm (clock of a dependent vpaddd chain: %.2f GHz)\n", ghz);
  __asm__ volatile("vpxord %%zmm1,%%zmm1,%%zmm1\n\tvpxord %%zmm2,%%zmm2,%%zmm2" ::: "xmm1", "xmm2");
  PROBE("vdpbf16ps", "vdpbf16ps %%zmm1,%%zmm2,%%zmm10\n\tvdpbf16ps %%zmm1,%%zmm2,%%zmm11\n\t"
                     "vdpbf16ps %%zmm1,%%zmm2,%%zmm12\n\tvdpbf16ps %%zmm1,%%zmm2,%%zmm13\n\t"
                     "vdpbf16ps %%zmm1,%%zmm2,%%zmm14\n\tvdpbf16ps %%zmm1,%%zmm2,%%zmm15\n\t"
                     "vdpbf16ps %%zmm1,%%zmm2,%%zmm16\n\tvdpbf16ps %%zmm1,%%zmm2,%%zmm17\n\t");
  PROBE("vfmadd231ps", "vfmadd231ps %%zmm1,%%zmm2,%%zmm10\n\tvfmadd231ps %%zmm1,%%zmm2,%%zmm11\n\t"
                       "vfmadd231ps %%zmm1,%%zmm2,%%zmm12\n\tvfmadd231ps %%zmm1,%%zmm2,%%zmm13\n\t"
                       "vfmadd231ps %%zmm1,%%zmm2,%%zmm14\n\tvfmadd231ps %%zmm1,%%zmm2,%%zmm15\n\t"
                       "vfmadd231ps %%zmm1,%%zmm2,%%zmm16\n\tvfmadd231ps %%zmm1,%%zmm2,%%zmm17\n\t");
  PROBE("vpermw", X8("vpermw %%zmm1,%%zmm2,%%zmm10\n\t"));
  PROBE("vpermps", X8("vpermps %%zmm1,%%zmm2,%%zmm10\n\t"));
  PROBE("vpsrlw $4", X8("vpsrlw $4,%%zmm1,%%zmm10\n\t"));
  PROBE("vpandd", X8("vpandd %%zmm1,%%zmm2,%%zmm10\n\t"));
  PROBE("vpshufb", X8("vpshufb %%zmm1,%%zmm2,%%zmm10\n\t"));
  PROBE("vdpbf16ps + vpermw, 4 each", "vdpbf16ps %%zmm1,%%zmm2,%%zmm10\n\tvpermw %%zmm1,%%zmm2,%%zmm14\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm11\n\tvpermw %%zmm1,%%zmm2,%%zmm15\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm12\n\tvpermw %%zmm1,%%zmm2,%%zmm16\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm13\n\tvpermw %%zmm1,%%zmm2,%%zmm17\n\t");
  PROBE("vdpbf16ps + vpsrlw, 4 each", "vdpbf16ps %%zmm1,%%zmm2,%%zmm10\n\tvpsrlw $4,%%zmm1,%%zmm14\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm11\n\tvpsrlw $4,%%zmm1,%%zmm15\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm12\n\tvpsrlw $4,%%zmm1,%%zmm16\n\t"
                                      "vdpbf16ps %%zmm1,%%zmm2,%%zmm13\n\tvpsrlw $4,%%zmm1,%%zmm17\n\t");
}

// ------------------------------------------------------------------ 2. one-token NVFP4 rows
alignas(64) constexpr uint16_t kE2M1Bf16[32] = {
    0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80,
    0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0, 0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040,
    0x4080, 0x40c0, 0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};
constexpr int64_t kPrefetch = 4096;  // bytes ahead: one row block of 4 rows at K 2048 (the executor's default is 2)

struct Problem {
  const uint8_t* codes;   // [rows, K / 2]
  const uint8_t* scales;  // [rows, K / 16] e4m3
  int64_t rows, K;
  const uint16_t* act;    // [K] bf16, BF16_Q128 order
  const uint32_t* tiles;  // AMX: [K / 128][4][16][16] block-diagonal activation tiles
  float* y;               // [rows]
  const int8_t* qa;       // VNNI: [K / 128][4][64] int8: even hi-limb, odd hi-limb, even lo-limb, odd lo-limb
  const int32_t* corr;    // VNNI: [K / 128][16] -12 * (sum of the lane's q), start of the lo accumulator
  const float* qs;        // VNNI: [K / 128][16] each lane's activation scale (a power of two)
};

__m512 scales16(const uint8_t* s) {  // 16 e4m3 scales as float32 times a global scale of 2^-4, as the kernel does
  const __m512i v = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), 20);
  const __m512 raw = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0x87f00000u))));
  return _mm512_mul_ps(raw, _mm512_set1_ps(0x1p116f));  // the e4m3 bits decode to value * 2^-120
}

// MODE 0: loads only; 1: plus the e2m1 decode; 2: the whole kernel.
template <int MODE>
void rows4(const Problem& p) {
  const int64_t rs = p.K / 2, ss = p.K / 16;
  const __m512i lut = _mm512_load_si512(kE2M1Bf16);
  for (int64_t r0 = 0; r0 < p.rows; r0 += 4) {
    __m512 acc[4];
    __m512i bits[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps(), bits[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < p.K; k += 256) {
      __m512 sv[4];
      for (int r = 0; r < 4; ++r) {
        const uint8_t* q = p.codes + (r0 + r) * rs + k / 2;
        __builtin_prefetch(q + kPrefetch, 0, 2);
        __builtin_prefetch(q + kPrefetch + 64, 0, 2);
        sv[r] = scales16(p.scales + (r0 + r) * ss + k / 16);
      }
      for (int u = 0; u < 2; ++u) {
        const int64_t kb = k + 128 * u;
        const __m512i li = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_set1_epi32(16 * u), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), 1);
        for (int r = 0; r < 4; ++r) {
          const __m512i words = _mm512_loadu_si512(p.codes + (r0 + r) * rs + kb / 2);
          if (MODE == 0) {
            bits[r] = _mm512_xor_si512(bits[r], words);
            continue;
          }
          const __m512i w0 = _mm512_permutexvar_epi16(words, lut);
          const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), lut);
          const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 8), lut);
          const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 12), lut);
          if (MODE == 1) {
            bits[r] = _mm512_ternarylogic_epi32(bits[r], _mm512_xor_si512(w0, w1), _mm512_xor_si512(w2, w3), 0x96);
            continue;
          }
          const uint16_t* a = p.act + kb;
          __m512 p0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(a));
          __m512 p1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w1, (__m512bh)_mm512_loadu_si512(a + 32));
          p0 = _mm512_dpbf16_ps(p0, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(a + 64));
          p1 = _mm512_dpbf16_ps(p1, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(a + 96));
          acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p0, p1), _mm512_permutexvar_ps(li, sv[r]), acc[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      p.y[r0 + r] = _mm512_reduce_add_ps(acc[r]) + static_cast<float>(_mm512_reduce_add_epi32(bits[r]));
  }
}


// VNNI variants. The activation of a block of 128 as integers q (15 bits + sign) with one power-of-two scale per
// lane of 8 elements (lane j: elements 8j .. 8j + 7 of the block: bytes 4j .. 4j + 3 of the line of codes), split
// into limbs q = 128 * hi + lo (hi s8, lo in [0, 127]); weights looked up as e2m1 * 2 + 12 (u8, 0 .. 24).
// sum_lane w * q = (128 * H + L - 12 * sum q) / 2 with H, L the `vpdpbusd` sums of the limbs.
// MODE 3: both limbs; MODE 4: the hi limb only (int8 activations, q rounded to hi * 128).
alignas(64) constexpr int8_t kE2M1U8[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
template <int MODE>
void rows4_vnni(const Problem& p) {
  const int64_t rs = p.K / 2, ss = p.K / 16;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1U8)));
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  for (int64_t r0 = 0; r0 < p.rows; r0 += 4) {
    __m512 acc[4];
    for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p.K; k += 256) {
      __m512 sv[4];
      for (int r = 0; r < 4; ++r) {
        const uint8_t* q = p.codes + (r0 + r) * rs + k / 2;
        __builtin_prefetch(q + kPrefetch, 0, 2);
        __builtin_prefetch(q + kPrefetch + 64, 0, 2);
        sv[r] = scales16(p.scales + (r0 + r) * ss + k / 16);
      }
      for (int u = 0; u < 2; ++u) {
        const int64_t kb = k + 128 * u, b = kb / 128;
        const __m512i li = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_set1_epi32(16 * u), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), 1);
        const int8_t* qa = p.qa + b * 256;
        const __m512 as = _mm512_loadu_ps(p.qs + b * 16);
        for (int r = 0; r < 4; ++r) {
          const __m512i line = _mm512_loadu_si512(p.codes + (r0 + r) * rs + kb / 2);
          const __m512i we = _mm512_shuffle_epi8(lut, _mm512_and_si512(line, m4));
          const __m512i wo = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(line, 4), m4));
          __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), we, _mm512_loadu_si512(qa));
          h = _mm512_dpbusd_epi32(h, wo, _mm512_loadu_si512(qa + 64));
          __m512i t;
          if (MODE == 3) {
            __m512i l = _mm512_dpbusd_epi32(_mm512_loadu_si512(p.corr + b * 16), we, _mm512_loadu_si512(qa + 128));
            l = _mm512_dpbusd_epi32(l, wo, _mm512_loadu_si512(qa + 192));
            t = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
          } else {
            t = _mm512_add_epi32(_mm512_slli_epi32(h, 7), _mm512_loadu_si512(p.corr + b * 16));
          }
          const __m512 s = _mm512_mul_ps(_mm512_permutexvar_ps(li, sv[r]), as);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc[r]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) p.y[r0 + r] = _mm512_reduce_add_ps(acc[r]);
  }
}

// The VNNI activation of a bf16 row (element order); mode 3 or 4 (4: q rounded to the hi limb).
void vnni_activation(const uint16_t* act, int64_t K, int mode, std::vector<int8_t>& qa, std::vector<int32_t>& corr,
                     std::vector<float>& qs) {
  qa.assign(K / 128 * 256, 0), corr.assign(K / 128 * 16, 0), qs.assign(K / 128 * 16, 0.f);
  for (int64_t b = 0; b < K / 128; ++b)
    for (int j = 0; j < 16; ++j) {
      float x[8], mx = 0;
      for (int e = 0; e < 8; ++e) {
        uint32_t u = uint32_t(act[128 * b + 8 * j + e]) << 16;
        std::memcpy(&x[e], &u, 4);
        mx = std::max(mx, std::abs(x[e]));
      }
      int ex = 0;
      std::frexp(mx, &ex);  // mx < 2^ex
      const float sc = mx == 0 ? 1.f : std::ldexp(1.f, ex - 14);  // q = x / sc, |q| < 2^14
      int32_t sum = 0;
      for (int e = 0; e < 8; ++e) {
        int32_t q = static_cast<int32_t>(std::nearbyint(x[e] / sc));
        if (mode == 4) q = static_cast<int32_t>(std::nearbyint(q / 128.0)) * 128, q = std::min(q, 127 * 128);
        const int32_t hi = q >> 7, lo = q & 127;
        const int64_t byte = 4 * j + e / 2;  // element 8j + e: byte 4j + e / 2 of the line, even or odd nibble
        qa[b * 256 + (e % 2) * 64 + byte] = static_cast<int8_t>(hi);
        qa[b * 256 + 128 + (e % 2) * 64 + byte] = static_cast<int8_t>(lo);
        sum += q;
      }
      corr[b * 16 + j] = -12 * (mode == 4 ? sum / 128 : sum) * (mode == 4 ? 128 : 1);
      qs[b * 16 + j] = sc * 0.5f;  // the weights are looked up as 2 * e2m1
    }
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Activation tiles: tile (b, c) row kp holds the bf16 pair kp of run c of block b in column 8 (b % 2) + kp / 2 (its
// scale group within a window of two blocks), zeros elsewhere.
std::vector<uint32_t> activation_tiles(const uint16_t* act, int64_t K) {
  std::vector<uint32_t> t(static_cast<size_t>(K / 128) * 4 * 256);
  for (int64_t b = 0; b < K / 128; ++b)
    for (int c = 0; c < 4; ++c) {
      uint32_t pairs[16];
      std::memcpy(pairs, act + 128 * b + 32 * c, 64);
      for (int kp = 0; kp < 16; ++kp) t[((b * 4 + c) * 16 + kp) * 16 + 8 * (b % 2) + kp / 2] = pairs[kp];
    }
  return t;
}

void amx_rows16(const Problem& p) {
  alignas(64) static uint16_t a_tiles[4 * 16 * 32];
  alignas(64) static float c_tile[16 * 16];
  const int64_t rs = p.K / 2, ss = p.K / 16;
  const __m512i lut = _mm512_load_si512(kE2M1Bf16);
  for (int64_t r0 = 0; r0 < p.rows; r0 += 16) {
    __m512 acc[16];
    for (auto& v : acc) v = _mm512_setzero_ps();
    _tile_zero(0);
    for (int64_t b = 0; b < p.K / 128; ++b) {
      for (int r = 0; r < 16; ++r) {
        const uint8_t* q = p.codes + (r0 + r) * rs + 64 * b;
        __builtin_prefetch(q + 128, 0, 2);
        const __m512i words = _mm512_loadu_si512(q);
        for (int c = 0; c < 4; ++c)
          _mm512_store_si512(a_tiles + (c * 16 + r) * 32,
                             _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4 * c), lut));
      }
      for (int c = 0; c < 4; ++c) {
        _tile_loadd(1, a_tiles + c * 512, 64);
        _tile_loadd(2, p.tiles + (b * 4 + c) * 256, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      if (b % 2 == 1) {  // a window of 16 scale groups: partial sums times their scales
        _tile_stored(0, c_tile, 64);
        _tile_zero(0);
        for (int r = 0; r < 16; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_load_ps(c_tile + 16 * r), scales16(p.scales + (r0 + r) * ss + (b / 2) * 16), acc[r]);
      }
    }
    for (int r = 0; r < 16; ++r) p.y[r0 + r] = _mm512_reduce_add_ps(acc[r]);
  }
}

bool amx_available() {
  if (!__builtin_cpu_supports("amx-bf16") || syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) != 0)
    return false;
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  return true;
}

void row_table() {
  const int64_t K = 2048, rows = 768, bytes = rows * K / 2, n_mat = (600 << 20) / bytes;
  std::vector<uint8_t> codes(n_mat * bytes), scales(n_mat * rows * K / 16);
  std::mt19937 rng(1);
  for (auto& c : codes) c = static_cast<uint8_t>(rng());
  for (auto& s : scales) s = static_cast<uint8_t>(0x30 + rng() % 16);
  std::vector<uint16_t> act(K);
  for (auto& a : act) {
    const float f = static_cast<float>(rng() % 2000) / 1000.0f - 1.0f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    a = static_cast<uint16_t>(u >> 16);
  }
  const std::vector<uint32_t> tiles = activation_tiles(act.data(), K);
  std::vector<int8_t> qa3, qa4;
  std::vector<int32_t> c3, c4;
  std::vector<float> s3, s4;
  vnni_activation(act.data(), K, 3, qa3, c3, s3);
  vnni_activation(act.data(), K, 4, qa4, c4, s4);
  std::vector<float> y(rows), y_ref(rows);
  const bool amx = amx_available();
  using Fn = void (*)(const Problem&);
  const Fn fns[] = {rows4<0>, rows4<1>, rows4<2>, rows4_vnni<3>, rows4_vnni<4>, amx_rows16};
  const char* names[] = {"loads", "decode", "kernel", "vnni2", "vnni1", "amx"};
  Problem p{codes.data(), scales.data(), rows, K, act.data(), tiles.data(), y_ref.data(), qa3.data(), c3.data(), s3.data()};
  rows4<2>(p);
  std::vector<float> y_el(rows);
  {  // scalar reference with the activation in element order
    const float e2m1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t c = codes[r * K / 2 + k / 2];
        const int nib = k % 2 ? c >> 4 : c & 15;
        const uint8_t sb = scales[r * K / 16 + k / 16];
        const int e = (sb >> 3) & 15, m = sb & 7;
        const float sc = (e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6)) * 0.0625f;
        uint32_t u = uint32_t(act[k]) << 16; float x; std::memcpy(&x, &u, 4);
        s += double(e2m1[nib]) * sc * x;
      }
      y_el[r] = float(s);
    }
  }
  for (int mode = 3; mode <= 4; ++mode) {  // note: the probe's activation is in element order for VNNI, q128 for bf16
    Problem q = p;
    q.y = y.data();
    if (mode == 4) q.qa = qa4.data(), q.corr = c4.data(), q.qs = s4.data();
    if (mode == 3) rows4_vnni<3>(q); else rows4_vnni<4>(q);
    double err = 0, mag = 0;
    for (int64_t r = 0; r < rows; ++r) err = std::max(err, double(std::abs(y[r] - y_el[r]))), mag = std::max(mag, double(std::abs(y_el[r])));
    std::printf("vnni mode %d against kernel: max |diff| %.3g (max |y| %.3g)\n", mode, err, mag);
  }
  if (amx) {  // the AMX variant computes the same sums (another float32 summation order)
    p.y = y.data();
    amx_rows16(p);
    double err = 0, mag = 0;
    for (int64_t r = 0; r < rows; ++r) err = std::max(err, double(std::abs(y[r] - y_ref[r]))), mag = std::max(mag, double(std::abs(y_ref[r])));
    std::printf("amx against kernel: max |diff| %.2g (max |y| %.2g)\n", err, mag);
  }
  std::printf("2. one-token NVFP4 GEMV, 768 x 2048, GB/s of codes (best of 3 x 0.5 s)\n  %-8s %8s %8s\n", "", "L2", "DRAM");
  for (int f = 0; f < (amx ? 6 : 5); ++f) {
    double rate[2] = {0, 0};
    for (int dram = 0; dram < 2; ++dram)
      for (int rep = 0; rep < 3; ++rep) {
        std::mt19937 pick(rep);
        int64_t calls = 0;
        const double t0 = now();
        while (now() - t0 < 0.5) {
          const int64_t m = dram ? pick() % n_mat : 0;
          Problem q{codes.data() + m * bytes, scales.data() + m * rows * K / 16, rows, K, act.data(), tiles.data(), y.data(),
                    qa3.data(), c3.data(), s3.data()};
          fns[f](q);
          ++calls;
        }
        rate[dram] = std::max(rate[dram], calls * bytes / (now() - t0) / 1e9);
      }
    std::printf("  %-8s %8.2f %8.2f\n", names[f], rate[0], rate[1]);
  }
  if (!amx) std::printf("  (amx: no AMX-BF16 tile state on this CPU or kernel)\n");
}

}  // namespace

int main() {
  instruction_table();
  row_table();
  return 0;
}

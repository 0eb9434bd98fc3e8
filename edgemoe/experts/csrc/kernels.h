// edgemoe native CPU expert kernels: the kernel interface shared by every ISA and weight format.
//
// A routed expert is two GEMVs over weight rows streamed from host DRAM (DESIGN.md §2, §9):
//   phase 1  h = W13 · x      W13 [2I, H]: gate rows [0, I), up rows [I, 2I)
//            a = silu(h_gate) * h_up
//   phase 2  y = W2 · a       W2  [H, I]
//            out[token] += weight · y
// For a decode batch (T <= 8 tokens, typically 1-2 tokens per expert) this is bound by the bytes of
// weights read, not by arithmetic, so every kernel is a *row-block GEMV*: it reads a block of weight
// rows once and applies each row to all the expert's tokens while it is in registers / L1.
//
// Everything here is plain C++ (no torch, no pybind): the same code serves the Python binding and
// the C entry point `edgemoe_run_step` that the doorbell server calls (see executor.h).
#pragma once

#include <cstddef>
#include <cstdint>

namespace edgemoe {

// Storage format of expert weights (the row formats of edgemoe/quant/layout.py). Values are part of
// the Python ABI (native.py) and of the registered-step struct; never renumber. A format without a
// kernel (F16) makes select_isa return -1 and the Python side fall back to the torch executor.
enum class WeightFormat : int32_t {
  F32 = 0,            // IEEE float32
  BF16 = 1,           // bfloat16 (upper half of a float32)
  F16 = 2,            // no kernel yet: IEEE half (F16C / AVX-512 vcvtph2ps dequant)
  FP8_E4M3_BLOCK = 3, // fp8 e4m3 with one float32 scale per 128x128 block (DeepSeek, Qwen3 FP8)
  MXFP4 = 4,          // OCP MX fp4 (e2m1), one e8m0 scale per 32 elements (gpt-oss)
  NVFP4 = 5,          // fp4 (e2m1), one e4m3 scale per 16 elements, one float32 multiplier per tensor
};

// Whether a format's rows are quantized (dequantized inside the kernels).
constexpr bool is_quantized(WeightFormat f) {
  return f == WeightFormat::FP8_E4M3_BLOCK || f == WeightFormat::MXFP4 || f == WeightFormat::NVFP4;
}

// Format of the activation operand a kernel consumes (x for phase 1, a for phase 2).
// F32 kernels dequantize weights to float32 lanes and FMA; the AVX-512-BF16 kernels feed `vdpbf16ps`,
// which needs both operands in bf16. BF16_P64 stores every whole block of 128 elements of a row permuted (the
// last K % 128 elements stay in order), in the order in which the FP8 kernel decodes its codes, so the weights
// need no cross-lane shuffle into element order; the activation is permuted once per step instead:
//   BF16_P64   each half-block of 64 elements with its even elements first, then its odd ones (p64_pos): a
//              64-byte line of FP8 codes holds elements 2i and 2i + 1 in word i, one byte each.
// Q15_LANES is the integer operand of the FP4 kernels (`vpdpbusd`): the bf16 activation as 15-bit integers, one
// power-of-two scale per lane of 8 elements, in blocks of 128 elements (q15_lanes_store; kernels_avx512bf16.cpp).
enum class ActFormat : int32_t { F32 = 0, BF16 = 1, Q15_LANES = 2, BF16_P64 = 3 };

// Position of element k in the BF16_P64 layout: in the half-block of 64 holding k, run k % 2 (32 elements)
// at offset (k % 64) / 2; the last K % 128 elements stay in order.
constexpr int64_t p64_pos(int64_t k, int64_t K) {
  return k >= K - K % 128 ? k : (k & ~int64_t{63}) + (k & 1) * 32 + ((k & 63) >> 1);
}
// Position of element k of a K-element activation row stored in bf16 layout `a` (BF16, BF16_P64).
constexpr int64_t bf16_act_pos(ActFormat a, int64_t k, int64_t K) {
  return a == ActFormat::BF16_P64 ? p64_pos(k, K) : k;
}
constexpr bool is_bf16_act(ActFormat a) { return a == ActFormat::BF16 || a == ActFormat::BF16_P64; }

// Q15_LANES: an activation row of K elements is ceil(K / 128) blocks of kQ15BlockBytes; block b holds elements
// [128b, 128b + 128) as 16 lanes of 8 (lane j: elements 128b + 8j .. + 7, the elements whose FP4 codes are bytes
// 4j .. 4j + 3 of the block's 64-byte line of codes). Each element x (a bf16 value) is q * scale[j] / 2 with q a
// 15-bit integer, stored as two int8 limbs, q = 128 * hi + lo (hi in [-128, 127], lo in [0, 127]):
//   bytes   0 ..  63   hi of the even elements of each lane: element 8j + 2i at byte 4j + i
//          64 .. 127   hi of the odd elements (8j + 2i + 1 at byte 4j + i)
//         128 .. 255   lo, the same two halves
//         256 .. 319   int32 corr[16] = -12 * (sum of the lane's q), the start of a lane's lo sum
//         320 .. 383   float scale[16] / 2: the lane's power-of-two scale halved (the kernels look the e2m1
//                      codes up doubled), 0 for a lane of zeros and for the lanes past K, NaN for a lane
//                      holding an infinity or NaN (its products are NaN)
// The lane's largest |x| maps to [2^13, 2^14): elements within 2^6 of it are exact, smaller ones are rounded to a
// multiple of 2^-13 of it (round half to even). Lanes past K in the last block are zero.
constexpr int64_t kQ15BlockBytes = 384;
constexpr int64_t q15_row_bytes(int64_t K) { return (K + 127) / 128 * kQ15BlockBytes; }

// Bytes of one activation row of K elements in format `a`.
constexpr int64_t act_row_bytes(ActFormat a, int64_t K) {
  return a == ActFormat::Q15_LANES ? q15_row_bytes(K) : is_bf16_act(a) ? 2 * K : 4 * K;
}

// Writes elements [k0, k0 + n) of a Q15_LANES row (`row`: its first block) from their bf16 values `x` (bits);
// k0 a multiple of 8, n too unless [k0, k0 + n) ends the row (a short last lane: its missing elements are zero).
// Pure C++, the same result on every ISA.
void q15_lanes_store(uint8_t* row, int64_t k0, const uint16_t* x, int64_t n);
// Zeroes the lanes past K of a Q15_LANES row's last block (the kernels read whole blocks).
void q15_lanes_clear_tail(uint8_t* row, int64_t K);

// Instruction-set levels, ordered: a level implies every lower one is usable on the same CPU.
// Avx2Int and Avx2Vnni have kernels for the FP4 formats computing in bf16 only (integer products on 256-bit
// registers, fp4_int256.h: AVX2's byte multiply-adds, or AVX-VNNI's `vpdpbusd` of Intel's client cores since Alder
// Lake, which have no AVX-512); every other format falls through them to Avx2.
enum class Isa : int32_t { Scalar = 0, Avx2 = 1, Avx2Int = 2, Avx2Vnni = 3, Avx512 = 4, Avx512Bf16 = 5 };
constexpr int kNumIsa = 6;
const char* isa_name(Isa isa);

// CPU feature bits (a bitmask), detected with cpuid + xgetbv (OS support for the register state).
enum CpuFeature : uint32_t {
  kFeatAvx2 = 1u << 0,
  kFeatFma = 1u << 1,
  kFeatAvx512F = 1u << 2,
  kFeatAvx512BW = 1u << 3,
  kFeatAvx512VL = 1u << 4,
  kFeatAvx512Bf16 = 1u << 5,
  kFeatAmxBf16 = 1u << 6,   // reported only: AMX tiles measured slower than the vector kernels for a one-token
                            // FP4 GEMV (docs/benchmarks/cpu_executor.md)
  kFeatF16C = 1u << 7,
  kFeatAvx512Fp16 = 1u << 8, // reported only
  kFeatAvx512Vnni = 1u << 9, // `vpdpbusd` (the FP4 kernels of the avx512bf16 level; every AVX-512-BF16 CPU has it)
  kFeatAvxVnni = 1u << 10,   // VEX `vpdpbusd` on 256-bit registers (the avx2vnni level)
};

// The features of the CPU this process runs on (cached after the first call).
uint32_t detect_cpu_features();

// The highest ISA level whose requirements `features` meets, capped at `cap`, that has a kernel for
// `fmt` whose own extra features (KernelSet::needs) `features` has too; computing in float32
// (`bf16_compute` false) only a kernel taking float32 activations. Pure function of its arguments (tests call it with fake feature sets):
//   avx512bf16: avx512f+bw+vl + avx512_bf16 (bf16 weights, and quantized weights computed in bf16:
//               `vdpbf16ps`, FP4 weights with `vpdpbusd`, which also needs avx512_vnni; f32 weights, and
//               quantized weights computed in float32, use avx512)
//   avx512:     avx512f+bw+vl   (bw/vl: masked 16-bit loads for bf16 tails)
//   avx2vnni:   avx2 + fma + avx_vnni (FP4 rows computing in bf16: `vpdpbusd` on Q15_LANES activations)
//   avx2:       avx2 + fma
//   scalar:     always
// Returns -1 when `fmt` has no kernel at all (a reserved format).
int select_isa(uint32_t features, int cap, WeightFormat fmt, bool bf16_compute = true);

// One [rows, K] weight matrix of one expert (gate, up or down) as a kernel sees it; built by
// expert_matrix() (executor.h) from the expert's row of the byte bank. Row r of the matrix starts at
// data + r * row_stride_bytes; its element k is dequantized as
//   dense (F32 / BF16 / F16):  the element itself (scales == nullptr)
//   FP8_E4M3_BLOCK:  e4m3 code * scale[r / scale_rows][k / scale_cols]        (float32 scales, 128 x 128)
//   MXFP4:           e2m1(nibble) * 2^(e8m0[r][k / scale_cols] - 127)         (scale_rows 1, scale_cols 32)
//   NVFP4:           e2m1(nibble) * (float(e4m3[r][k / scale_cols]) * global_scale)  (scale_rows 1, cols 16)
// where scale row s starts at scales + s * scale_row_stride_bytes, and FP4 element k of a row is the
// low nibble of byte k / 2 when k is even, the high nibble when odd; edgemoe/quant/dequant.py
// (ExpertLayout.dequant_rows) is the reference. Kernels read the codes in registers and multiply their exact
// values (unscaled) by the activation, summing per group of elements that share a scale, then multiply each
// group's partial sum by its float32 scale (for NVFP4 float(e4m3) * global_scale, rounded to float32 first,
// as the reference does): the format's exact weights up to where float32 rounds, whatever the compute dtype.
// The torch path instead dequantizes each weight to float32 and, computing in bf16, rounds it to bf16: MXFP4
// gives the same numbers either way (an e2m1 value times a power of two is a bf16 number), FP8 and NVFP4
// agree within the bf16 tolerance (kernel_impl.h, "post-scaled quantized rows"; kernels_avx512bf16.cpp).
struct WeightView {
  const void* data;
  int64_t row_stride_bytes;
  const void* scales;              // block scales of matrix row 0 (nullptr: dense)
  int64_t scale_row_stride_bytes;  // bytes between consecutive scale rows
  int32_t scale_rows;              // matrix rows sharing one scale row (FP8: block rows; FP4: 1)
  int32_t scale_cols;              // matrix columns per scale (FP8: block columns; MXFP4: 32; NVFP4: 16)
  float global_scale;              // NVFP4: the matrix's per-tensor multiplier; 1 otherwise
};

// Row-block GEMV, the one kernel signature every (ISA, format) pair implements:
//   y[j * ldy + r] = sum_{k < K} W[row0 + r][k] * act[j][k]     for r < nrows, j < n
// `act[j]` points at token j's activation row (format given by the kernel's ActFormat). Any n >= 1
// and K >= 1; tails need no padding. Accumulation is float32. Deterministic: the result of one
// (r, j) never depends on nrows, n, or which thread runs it.
using GemvFn = void (*)(const WeightView& w, int64_t row0, int64_t nrows, int64_t K, const void* const* act,
                        int n, float* y, int64_t ldy);

// Parallel-read test kernel: sum of n floats (the bandwidth benchmark's "true read").
using SumFn = double (*)(const float* p, int64_t n);

// Writes elements [k0, k0 + n) of a Q15_LANES row, as q15_lanes_store does (the same bytes), on one ISA level.
using Q15StoreFn = void (*)(uint8_t* row, int64_t k0, const uint16_t* x, int64_t n);

struct KernelSet {
  GemvFn gemv;         // nullptr: no kernel for this (ISA, format)
  ActFormat act;       // activation format `gemv` consumes
  SumFn sum_f32;
  uint32_t needs = 0;  // CPU features `gemv` needs beyond its level's (CpuFeature bits)
  Q15StoreFn q15_store = nullptr;  // act Q15_LANES: this level's own store of the activation (nullptr: the scalar
                                   // q15_lanes_store)
};

// The Q15_LANES store a kernel set uses: its level's own, else the scalar one.
inline Q15StoreFn q15_store_of(const KernelSet& ks) { return ks.q15_store ? ks.q15_store : &q15_lanes_store; }

// Kernel table of one ISA level, one entry per WeightFormat value (index = int(fmt)).
constexpr int kNumFormats = 6;
struct IsaKernels {
  KernelSet by_format[kNumFormats];
};

// Defined in kernels_<isa>.cpp, each compiled for its own target via `#pragma GCC target`.
const IsaKernels& kernels_scalar();
const IsaKernels& kernels_avx2();
const IsaKernels& kernels_avx2int();
const IsaKernels& kernels_avx2vnni();
const IsaKernels& kernels_avx512();
const IsaKernels& kernels_avx512bf16();
const IsaKernels& kernels_for(Isa isa);

}  // namespace edgemoe

// The native CPU expert executor: a persistent pinned thread pool that computes one decode step's
// CPU set of routed experts (DESIGN.md §2) straight from the host expert pool.
//
// One step runs in two phases over *all* experts of the step, so every core streams weights even
// when the step has a single expert:
//   phase 1  chunks = (expert, range of intermediate rows i); a chunk reads gate rows [i0, i1) and up
//            rows [I + i0, I + i1) of w13 once, for all the expert's tokens, and writes
//            a[route, i] = act(gate + bias, up + bias) for that range (ExpertBanks: act, biases);
//   barrier
//   phase 2  chunks = ranges of output rows o (across every expert of the step); a chunk reads
//            w2 rows [o0, o1) of each expert in step order and adds weight * (y + bias) into out[token, o].
// Chunks are handed out through an atomic counter (threads that finish early take more; robust to
// a noisy neighbour). Each output element and each activation is computed by exactly one chunk with
// a fixed operation order, so results do not depend on the thread count or on scheduling.
//
// Not torch, not Python: the same object serves the pybind module and the C entry point
// `edgemoe_run_step` below, which StepServer (a doorbell a device kernel rings) or a CUDA-graph host
// node (cudaLaunchHostFunc) can call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "dense.h"
#include "kernels.h"

namespace edgemoe {

// Status codes returned by Executor::run and stored in edgemoe_step::status.
enum Status : int32_t {
  kOk = 0,
  kBadToken = 1,     // a token index outside [0, T)
  kBadExpert = 2,    // a flat expert id outside [0, num_ids)
  kBadOffsets = 3,   // offsets not starting at 0 / not non-decreasing
  kBadArgs = 4,      // null pointer, negative size, unknown format
  kTooLarge = 5,     // registered step: dims exceed the registered capacity
  kNoKernel = 6,     // no kernel for this weight format on this CPU
  kInternal = 7,     // allocation failure or another C++ exception (C entry point only)
};

// The host expert pool as the executor reads it: ONE byte bank of `num_ids` rows. Row i (flat id
// moe_layer * E + expert) starts at base + i * row_bytes (row_bytes a multiple of 4096) and holds every
// tensor of that expert as sections at fixed byte offsets from the row's start (ExpertLayout in
// edgemoe/quant/layout.py: every offset a multiple of 64, the same for all rows); -1 marks a section
// the format does not have. Per format (I = inter, H = hidden; FP8 block bn x bk = block_rows x
// block_cols, 128 x 128 in every release):
//
//   field           F32 / BF16 / F16   FP8_E4M3_BLOCK                    MXFP4                  NVFP4
//   w13_off         [2I, H] elements   e4m3 [2I, H]                      e2m1 uint8 [2I, H/2]   e2m1 uint8 [2I, H/2]
//   w2_off          [H, I] elements    e4m3 [H, I]                       e2m1 uint8 [H, I/2]    e2m1 uint8 [H, I/2]
//   w13_scale_off   -1                 f32 [2*ceil(I/bn), ceil(H/bk)]:   e8m0 uint8 [2I, H/32]  e4m3 [2I, H/16]
//                                      gate's grid, then up's
//   w2_scale_off    -1                 f32 [ceil(H/bn), ceil(I/bk)]      e8m0 uint8 [H, I/32]   e4m3 [H, I/16]
//   w13_scale2_off  -1                 -1                                -1                     f32 [2]: gate's, up's
//                                                                                               per-tensor multiplier
//   w2_scale2_off   -1                 -1                                -1                     f32 [1]: down's
//   b13_off         f32 [2I] gate's then up's expert bias where the model has them (gpt-oss), else -1
//   b2_off          f32 [H] down's bias, else -1
//   block_rows/cols 0                  bn, bk                            0                      0
//   compute         the pool's compute dtype: 0 float32, 1 bfloat16 (BF16 rows always 1, F32 rows 0).
//                   Quantized rows are post-scaled (the codes' exact values; kernels.h, WeightView),
//                   in either dtype; computing in bf16 the step rounds where the bf16 path does (x,
//                   gate, up, the activation, y, ...); in float32 nothing is rounded.
//   act             the experts' gated activation of gate g and up u (edgemoe.config.ExpertActivation):
//                   kSilu: silu(g) * u; kSwigluOai (gpt-oss): (clamp(u, -limit, limit) + 1) * g' *
//                   sigmoid(alpha * g') with g' = min(g, limit). alpha, limit: float32, read for kSwigluOai only.
//
// With biases (b13_off, b2_off >= 0, both or neither) each projection adds its bias after the product:
// g = W_gate x + b13[i], u = W_up x + b13[I + i], y = W2 a + b2[o]. A bf16 step rounds where the torch
// path's bf16 ops do (edgemoe.experts.compute.swiglu_expert): each projection, the bias (cast to bf16),
// their sum, and each op of the activation.
//
// w13 is gate rows [0, I) then up rows [I, 2I) in every format (gpt-oss's interleaving is undone at
// pack time). expert_matrix() turns a row into the WeightView of one projection, which is all a
// kernel reads; the float kernels use w13_off / w2_off only.
struct ExpertBanks {
  const uint8_t* base;
  int64_t row_bytes;
  int64_t num_ids, hidden, inter;
  WeightFormat fmt;
  int64_t w13_off, w2_off;
  int64_t w13_scale_off, w2_scale_off;
  int64_t w13_scale2_off, w2_scale2_off;
  int64_t b13_off, b2_off;
  int32_t block_rows, block_cols;
  int32_t compute;
  int32_t act;  // an ActKind
  float alpha, limit;
};

// The experts' gated activation (ExpertBanks::act); values are part of the Python ABI (native.py).
enum ActKind : int32_t { kSilu = 0, kSwigluOai = 1 };

// Whether a step over `b` computes in bf16 (x, activations and outputs rounded where the torch path's
// bf16 ops round).
inline bool computes_bf16(const ExpertBanks& b) {
  return b.fmt == WeightFormat::BF16 || (is_quantized(b.fmt) && b.compute == 1);
}

// The projections of one expert: gate [I, H], up [I, H] (rows of w13) and down [H, I] (w2).
enum class Proj : int32_t { Gate = 0, Up = 1, Down = 2 };

// The WeightView of projection `p` of expert `fid` (see ExpertBanks for the sections it points into).
WeightView expert_matrix(const ExpertBanks& b, int64_t fid, Proj p);

// One step's CPU work: routes grouped by expert. Expert e = fids[e] is applied to tokens
// tok[offsets[e] .. offsets[e+1]) with router weights wt[same range]. x: [T, H] in x_fmt (0 float32,
// 1 bfloat16); out: [T, H] float32, accumulated into (out += sum over routes of weight * expert(x)).
struct StepArgs {
  const void* x;
  int32_t x_fmt;
  int64_t T;
  float* out;
  int64_t n_experts;
  const int64_t* fids;
  const int64_t* offsets;
  const int64_t* tok;
  const float* wt;
  int32_t zero_out;  // 1: out[:T] is set to zero (after validation) before accumulating
};

// Persistent std::thread pool. The calling thread is worker 0 (it computes too and is never pinned
// here: a Python thread's affinity is not ours to change; a StepServer, the pool's own caller, pins
// itself to cpus[0]); workers 1..n-1 are pinned to cpus[i] when cpus has an entry for them
// (sched_setaffinity; refusal is ignored). Between jobs workers spin for `spin_us` (catching the
// next MoE layer's call without a wake-up), yielding the core to any other runnable thread, and
// sleep on a condition variable once the spin is spent or the worker finds itself preempted (an
// oversubscribed machine: see SpinWait in executor.cpp).
class ThreadPool {
 public:
  ThreadPool(int threads, const std::vector<int>& cpus, int spin_us);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }
  // Runs fn(ctx, tid) for tid in [0, size()) — tid 0 on the caller — and returns when all are done.
  void run(void (*fn)(void*, int), void* ctx);
  // All size() threads of the current job meet here (only call from inside a job).
  void barrier();
  // CPU each thread was pinned to (-1: not pinned). Entry 0 is always -1 (the caller).
  const std::vector<int>& pinned() const { return pinned_; }
  // The CPU meant for worker 0 (cpus[0]; -1: none): where a StepServer pins itself.
  int caller_cpu() const { return caller_cpu_; }
  // Waits between jobs whose spin was cut short because the worker had lost its core.
  int64_t preempted_waits() const { return preempted_.load(std::memory_order_relaxed); }
  // False in a child process after fork(): the workers did not survive it. Callers then do all the
  // work on the calling thread (jobs take chunks dynamically, so one thread finishes any job).
  bool usable() const;

 private:
  void worker(int tid, int cpu);
  uint64_t wait_for_job(uint64_t seen);

  int n_;
  int spin_us_;
  int caller_cpu_;
  long owner_pid_;
  std::vector<std::thread> threads_;
  std::vector<int> pinned_;
  void (*fn_)(void*, int) = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<uint64_t> gen_{0};
  alignas(64) std::atomic<int> done_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<uint32_t> bar_count_{0};
  alignas(64) std::atomic<uint32_t> bar_gen_{0};
  alignas(64) std::atomic<int> started_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> preempted_{0};
  std::mutex m_;
  std::condition_variable cv_;
};

class Executor {
 public:
  // threads >= 1; cpus: CPU ids to pin workers to (index = thread id; see ThreadPool); isa_cap: the
  // highest ISA level to use (-1 = best available); spin_us: worker spin before sleeping;
  // min_parallel_bytes: steps reading fewer weight bytes than this run on the caller alone (a
  // wake-up costs more than it saves); min_chunk_bytes: a phase of a step is cut into fewer chunks per thread
  // (at least one each) where its chunks would hold fewer weight bytes than this (0: by rows only; see run()).
  Executor(int threads, const std::vector<int>& cpus, int isa_cap, int spin_us, int64_t min_parallel_bytes,
           int64_t min_chunk_bytes);

  // Computes one step (see StepArgs). Thread-safe: concurrent callers are serialized. Returns a
  // Status; on error nothing has been written to out.
  int32_t run(const ExpertBanks& banks, const StepArgs& step);

  // A dense linear layer without bias for a few rows of input (decode): y[m, r] = sum_k W[r, k] x[m, k]
  // for r < N, m < M. W: [N, K] in `fmt`, rows w_stride bytes apart; x: [M, K] (x_fmt 0 float32,
  // 1 bfloat16), rows ldx elements apart; y: [M, N] (y_fmt 0 float32, 1 bfloat16: rounded to nearest
  // even), rows ldy elements apart. bf16 weights compute with x rounded to bf16 (as run()). Output rows
  // are split across the pool in chunks taken dynamically; every y element is computed by one chunk
  // with a fixed operation order, so results do not depend on the thread count. Thread-safe
  // (serialized with run()). Returns a Status.
  int32_t linear(const void* w, WeightFormat fmt, int64_t N, int64_t K, int64_t w_stride, const void* x,
                 int32_t x_fmt, int64_t M, int64_t ldx, void* y, int32_t y_fmt, int64_t ldy);

  // One attention layer of a decode step as one call, for q/k/v projections fused into one matrix without biases:
  // qkv = x @ qkv_w^T (linear(); x [T, H] bf16, qkv_w [(Hq + 2 Hk) D, H] bf16, qkv rounded to bf16), decode_attention()
  // over its q, k and v columns (`a` as decode_attention takes it, its q, k, v, their strides and out set here), then
  // y = attention @ o_w^T (linear(); o_w [H, Hq D] bf16, y [T, H] bf16). The kernels and rounding points of the three
  // calls it replaces, without the Python and torch operations between them. Thread-safe (serialized with itself).
  // Returns a Status (sizes decode_attention refuses: kBadArgs).
  int32_t attention_layer(const uint16_t* x, int64_t hidden, const uint16_t* qkv_w, const uint16_t* o_w,
                          const DecodeAttentionArgs& a, uint16_t* y);

  // One MoE layer of a decode step with every routed expert on this executor (a CPU-only engine), as one call:
  // the router's bf16 logits x @ router^T (linear()), softmax top-k routing (softmax_topk_bf16, dense.h), the
  // routes grouped by expert in ascending (expert, token, k) order, run() over them, and the float32 sum rounded
  // to bf16, plus the residual where one is given (round_add_bf16). The same work, in the same order, as the
  // Python path it replaces (router, grouping, run(), `.to(bfloat16)`, residual add), without its torch
  // operations between the native calls. *n_experts: the distinct experts the step ran. Thread-safe (serialized
  // with itself; run() and linear() with each other). Returns a Status; on error out is not written.
  // Without a router (nullptr) the routes are given: ids [T, top_k] (experts of the layer, < E) and
  // route_weights [T, top_k] float32 are read, and the call runs from the grouping on (any router's routes).
  struct MoeDecodeArgs {
    const uint16_t* x;         // [T, H] bf16, rows contiguous
    int64_t T;
    const uint16_t* router;    // [E, H] bf16, rows contiguous, or nullptr: routes given
    int64_t E, top_k;
    bool norm_topk;
    int64_t id_base;           // flat id of the layer's expert 0 (moe_layer * E)
    const uint16_t* residual;  // [T, H] bf16, or nullptr
    uint16_t* out;             // [T, H] bf16
    int64_t* ids;              // [T, top_k]: experts of the layer, descending weight (written; read without router)
    uint16_t* weights;         // [T, top_k] bf16, written (with a router)
    const float* route_weights;  // [T, top_k] float32, read (without a router)
  };
  int32_t moe_decode(const ExpertBanks& banks, const MoeDecodeArgs& a, int64_t* n_experts);

  // Sum of n floats read by all threads (the read-bandwidth test); static split, 4 KiB aligned.
  double sum_f32(const float* p, int64_t n);

  // decode_attention_bf16 (dense.h) with its chunks, then its merges, taken dynamically by the pool's threads
  // (the prologue on the caller): the same result at every thread count, and as the single-threaded call where
  // both take the same scores path (bf16_dot: here only where the executor's bf16 kernels are AVX-512-BF16, i.e.
  // also under its ISA cap). The parts buffer grows to the largest step's (about Hq (D + 2) 4 / 128 bytes a
  // cached token of the batch) and is kept. Thread-safe (serialized with run()). Returns 0, or 1 for sizes it
  // refuses.
  int32_t decode_attention(const DecodeAttentionArgs& a);

  // ISA level used for `fmt` on this CPU under the cap (-1: none); `bf16_compute` for a quantized
  // format computing in bf16 (the avx512bf16 kernels need bf16 operands: in float32 the level stops
  // at avx512).
  int isa_for(WeightFormat fmt, bool bf16_compute = true) const;
  int threads() const { return pool_.size(); }
  const std::vector<int>& pinned() const { return pool_.pinned(); }
  int caller_cpu() const { return pool_.caller_cpu(); }
  int64_t preempted_waits() const { return pool_.preempted_waits(); }

  // Call trace, for benchmarks: where a run() call's time goes. trace_calls(n) starts recording the next n calls
  // (0: stops and drops what was recorded); traced() returns them, trace_stride() values a call, in nanoseconds of
  // the steady clock: the caller's [entry, dispatch to the pool, return], then per pool thread [start of its job,
  // end of its phase-1 chunks, exit from the barrier between the phases, end of its phase-2 chunks] (0 for a thread
  // that did not run the call: a call run on the caller alone). Recording costs a clock read at each point.
  void trace_calls(int64_t capacity);
  std::vector<int64_t> traced();
  int64_t trace_stride() const { return 3 + 4 * static_cast<int64_t>(pool_.size()); }

  // Internal state of one step's job (and of one linear()), shared by the pool threads.
  struct Job;
  struct LinearJob;
  struct AttentionJob;

 private:
  static void step_job(void* job, int tid);
  static void linear_job(void* job, int tid);
  static void attention_job(void* job, int tid);
  // x [T, H] (rows ldx elements apart) in the operand format of `ks`: a pointer to x itself when no conversion
  // is needed, else to a converted copy in x_bf16_ / x_f32_ / x_q15_; *row_bytes: bytes between its rows.
  const void* prepare_x(const KernelSet& ks, bool bf16_compute, const void* x, int32_t x_fmt, int64_t T, int64_t H,
                        int64_t ldx, int64_t* row_bytes);
  void phase1_chunk(Job& J, int64_t k, int tid);  // k: a claim (TailClaims)
  void phase2_chunk(Job& J, int64_t k, int tid);

  ThreadPool pool_;
  int isa_[kNumFormats];      // per format (bf16 compute for quantized formats)
  int isa_f32_[kNumFormats];  // quantized formats computing in float32: kernels taking float32 activations
  int64_t min_parallel_bytes_;
  int64_t min_chunk_bytes_;
  std::mutex run_mutex_;
  std::vector<int64_t> trace_;           // trace_calls(): trace_stride() values a recorded call (run_mutex_)
  std::atomic<int64_t> trace_cap_{0};    // calls to record (read without the lock at a call's entry)
  int64_t trace_n_ = 0;                  // calls recorded (run_mutex_)
  // Buffers reused across steps (grow only; no allocation in steady state).
  std::vector<uint16_t> x_bf16_, act_bf16_;
  std::vector<float> x_f32_, act_f32_;
  std::vector<uint8_t> x_q15_, act_q15_;  // Q15_LANES rows (kernels.h)
  std::vector<const void*> xptr_, aptr_;
  std::vector<std::vector<float>> scratch_;  // per thread: gate, up or y tiles
  std::vector<double> partial_;
  std::vector<float> attn_q_, attn_parts_;  // decode_attention: the step's queries, the chunks' parts
  std::vector<int64_t> attn_first_;
  std::mutex layer_mutex_;  // attention_layer's buffers: the q/k/v projections, the attention output
  std::vector<uint16_t> layer_qkv_, layer_attn_;
  std::mutex moe_mutex_;  // moe_decode's buffers: the logits, the grouped routes, the float32 sums
  std::vector<uint16_t> moe_logits_;
  std::vector<int64_t> moe_order_, moe_fids_, moe_offsets_, moe_tok_;
  std::vector<float> moe_wt_, moe_acc_;
};

}  // namespace edgemoe

extern "C" {

// A step with pre-registered buffers, for callers that cannot pass arguments (StepServer below, or a
// CUDA-graph host node: cudaLaunchHostFunc(stream, edgemoe_run_step, step)). Everything is
// registered once; per step a producer (device->pinned copies from the decode graph) fills x, dims,
// fids, offsets, tok and wt, then the consumer runs the step. All pointers are host memory. Python allocates it
// through the binding (step_create) and never depends on the field layout; C callers only pass the
// pointer back to edgemoe_run_step.
typedef struct edgemoe_step {
  void* executor;           // edgemoe::Executor*
  edgemoe::ExpertBanks banks;  // the host expert pool
  int32_t x_fmt;            // 0: float32, 1: bfloat16
  const void* x;            // [max_tokens, H]
  float* out;               // [max_tokens, H] float32
  const int64_t* dims;      // [2]: T and n_experts of the current step
  const int64_t* fids;      // [max_experts]
  const int64_t* offsets;   // [max_experts + 1]
  const int64_t* tok;       // [max_routes]
  const float* wt;          // [max_routes]
  int64_t max_tokens, max_experts, max_routes;
  int32_t zero_out;         // 1: out[:T] is zeroed first (a graph replay needs a fresh partial)
  int32_t status;           // written by each call: an edgemoe::Status
  int64_t calls;            // completed calls
} edgemoe_step;

// Runs the step described by `step` (an edgemoe_step*). Never throws; sets step->status.
void edgemoe_run_step(void* step);

}  // extern "C"

namespace edgemoe {

// Serves a registered step on a doorbell in host memory, so that a device stream can hand the CPU
// branch to the pool with no host function in its path (the decode step's GPU work runs on while
// the CPU computes; issue 4, docs/benchmarks/decode.md). Protocol, per step:
//   device: copies the step's inputs into the registered buffers, then stores n = previous n + 1
//           into *request (a kernel writing mapped pinned memory), then polls *done until >= n;
//   server: a dedicated thread polls *request; when it differs from the last value served it runs
//           edgemoe_run_step(step) (the pool's worker 0 is this thread) and stores that value
//           into *done (release: out[] is complete before done moves), and just before, into *(done + 1),
//           the ns since its last poll that found no request (the join's graded lateness,
//           edgemoe/kernels/cpu_handoff.py).
// The thread pins itself to `cpu` (the executor's caller_cpu(); -1: not pinned). It spins for
// `active_spin_us` after each served step (yielding its core to any other runnable thread, and
// stopping early when it finds itself preempted: SpinWait), then polls every 50 us, and every 1 ms
// after a second of silence. The destructor stops and joins the thread (in a forked child, where the
// thread does not exist, it leaks the handle instead, as ThreadPool does).
//
// Release word (the device waits with a stream memory operation, cuStreamWaitValue32, instead of a
// polling kernel): with `release` non-null the server also stores 1 into the 32-bit *release after
// *done; the device's wait op waits for *release >= 1 and a write op stores 0 after it. A wait op
// cannot time out, so a watchdog thread stands in for the polling kernel's give-up: when a request
// stays unanswered for `watchdog_ms`, it adds 1 to *gave_up, stores 1 into *release, and from then
// on answers every later request the same way at once (the server is considered gone and stops
// serving; a step finishing late posts nothing). The destructor answers a request still pending the
// same way, so a device stream never hangs on a stopped server. Without `release` none of this runs.

class StepServer {
 public:
  StepServer(edgemoe_step* step, int64_t* request, int64_t* done, int active_spin_us, int cpu,
             uint32_t* release = nullptr, int64_t* gave_up = nullptr, int64_t watchdog_ms = 0);
  ~StepServer();
  StepServer(const StepServer&) = delete;
  StepServer& operator=(const StepServer&) = delete;
  int64_t served() const { return served_.load(std::memory_order_acquire); }
  // Served requests whose step returned a non-ok status (its out[] is then stale).
  int64_t failed() const { return failed_.load(std::memory_order_acquire); }
  // Idle spins cut short because the thread had lost its core (an oversubscribed machine).
  int64_t preempted() const { return preempted_.load(std::memory_order_relaxed); }
  // CPU the thread pinned itself to (-1: not pinned, or not yet).
  int pinned() const { return pinned_.load(std::memory_order_acquire); }

 private:
  void loop();
  void watch();
  // With mu_ held: count request `req` as given up and release the device's wait.
  void give_up_locked(int64_t req);
  edgemoe_step* step_;
  int64_t* request_;
  int64_t* done_;
  int active_spin_us_;
  int cpu_;
  uint32_t* release_;
  int64_t* gave_up_;
  int64_t watchdog_ms_;
  std::mutex mu_;            // orders the server's and the watchdog's posts of *release
  bool dead_ = false;        // under mu_: the watchdog gave the server up
  int64_t answered_ = 0;     // under mu_: the last request answered (served or given up)
  std::thread watchdog_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> served_{0};
  std::atomic<int64_t> failed_{0};
  std::atomic<int64_t> preempted_{0};
  std::atomic<int> pinned_{-1};
  long owner_pid_;
  std::thread thread_;
};

}  // namespace edgemoe

// Thread pool and step orchestration of the native CPU expert executor (see executor.h).
// Baseline code: the ISA-specific work happens only inside the kernels it calls through KernelSet.
#include "executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <system_error>

#include <unistd.h>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#include <sys/prctl.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace edgemoe {

namespace {

// The kernels' numbers assume IEEE subnormals (FP8 subnormal codes pass through float32 subnormals before
// an exact rescale; float32 FMAs keep subnormal products): a thread with flush-to-zero or
// denormals-are-zero set (torch.set_flush_denormal(True) sets both, on its own thread only; a library built
// with -ffast-math may set them when it loads; threads inherit them from their creator) would compute other
// numbers, and only on that thread. Every entry that runs kernels holds one of these: both off (MXCSR bits 15
// and 6) while it runs, the thread's setting restored after.
class IeeeSubnormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  IeeeSubnormals() : saved_(_mm_getcsr()) {
    if (saved_ & kFlush) _mm_setcsr(saved_ & ~kFlush);
  }
  ~IeeeSubnormals() {
    if (saved_ & kFlush) _mm_setcsr(saved_);
  }
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;

 private:
  static constexpr unsigned kFlush = 0x8040u;  // FTZ | DAZ
  unsigned saved_;
#else
  IeeeSubnormals() {}  // elsewhere the default floating-point environment is assumed
#endif
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

using Clock = std::chrono::steady_clock;

inline int64_t now_ns() {  // the call trace's clock
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

inline int64_t us_since(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t).count();
}

// A busy wait that gives its core away when someone else wants it. Each call of poll() is one short
// pause-spin; every kCheck polls the thread yields (sched_yield: a runnable thread on this CPU runs
// first) and reads the clock. A gap of more than kPreemptedUs between two readings means the thread
// lost its core for that long: the machine is oversubscribed, and spinning on would take a core
// from a thread that has work (a pool worker, the Python thread, the CUDA driver). poll() then
// returns false, as it does when the spin budget is spent, and the caller blocks instead.
class SpinWait {
 public:
  static constexpr int kCheck = 64;
  static constexpr int64_t kPreemptedUs = 200;
  explicit SpinWait(int64_t budget_us) : budget_us_(budget_us), t0_(Clock::now()), last_(t0_) {}
  // One poll interval; false (from then on) once the budget is spent or the thread was preempted.
  bool poll() {
    if (over_) return false;
    cpu_relax();
    if (++i_ % kCheck) return true;
    std::this_thread::yield();
    const auto now = Clock::now();
    preempted_ = std::chrono::duration_cast<std::chrono::microseconds>(now - last_).count() > kPreemptedUs;
    last_ = now;
    over_ = preempted_ || std::chrono::duration_cast<std::chrono::microseconds>(now - t0_).count() >= budget_us_;
    return !over_;
  }
  bool preempted() const { return preempted_; }

 private:
  int64_t budget_us_;
  Clock::time_point t0_, last_;
  uint32_t i_ = 0;
  bool preempted_ = false, over_ = false;
};

// Waits for `done()` inside a job (barrier, completion), where there is no one to wake a sleeper:
// pause-spin while the wait is short and the core is ours, then keep polling but yield the core
// between polls, and sleep 20 us between polls once the wait has lasted 1 ms (a peer is off its core
// for a scheduler slice: an oversubscribed machine).
template <class Pred>
inline void spin_until(Pred done) {
  SpinWait w(50);
  while (!done())
    if (!w.poll()) break;
  const auto t0 = Clock::now();
  while (!done()) {
    if (us_since(t0) < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t m) { return ceil_div(a, m) * m; }

// The claims of a phase's n chunks by p threads, each taking the next claim when done (dynamic balance): the first
// n - t chunks whole, then the last t = min(p, n - p) as two halves each (none where n <= p: one chunk a thread at
// most). Threads that run at different speeds end a phase apart by up to one claim, the wait at the barrier or the
// join; halving the claims the phase ends on halves it (guided self-scheduling, Polychronopoulos and Kuck 1987, in
// its simplest form: the chunks keep the byte floor until the last round). Only the cut moves: each output row's
// sums are the same whichever claim or thread computes it.
//
// Two build switches (EDGEMOE_NATIVE_CFLAGS), for the GPU host's Xeon, whose call trace showed small calls losing a
// fifth of phase 1 to the barrier (cpu_executor.md, "The call trace on the GPU host's Xeon"); neither is measured
// there yet, and the defaults are the measured behaviour:
// - EDGEMOE_CHUNK_ROW_UNIT (16): chunks are cut at multiples of this many rows (a multiple of 8, whole Q15_LANES
//   lanes). At 15 threads one expert's 768 gate/up rows make 12 chunks of 64 rows in units of 16, 14 of 56 in 8.
// - EDGEMOE_HALVE_ONE_ROUND: a phase of at most one chunk a thread is claimed as halves too, so that threads that
//   read slower than the others hand half of their chunk to those that finish first.
// Every cut gives the same results (test_every_chunking_gives_the_one_thread_result passes under both).
#ifndef EDGEMOE_CHUNK_ROW_UNIT
#define EDGEMOE_CHUNK_ROW_UNIT 16
#endif
static_assert(EDGEMOE_CHUNK_ROW_UNIT % 8 == 0, "chunks are cut at whole Q15_LANES lanes of 8 elements");
constexpr int64_t kRowUnit = EDGEMOE_CHUNK_ROW_UNIT;
struct TailClaims {
  int64_t n = 0, t = 0;
#ifdef EDGEMOE_HALVE_ONE_ROUND
  static TailClaims of(int64_t n, int p) { return {n, p > 1 ? (n > p ? std::min<int64_t>(p, n - p) : n) : 0}; }
#else
  static TailClaims of(int64_t n, int p) { return {n, n > p ? std::min<int64_t>(p, n - p) : 0}; }
#endif
  int64_t count() const { return n + t; }
  // claim k's chunk, and its part: -1 whole, 0 the first half, 1 the second
  std::pair<int64_t, int> at(int64_t k) const {
    const int64_t whole = n - t;
    if (k < whole) return {k, -1};
    return {whole + (k - whole) / 2, static_cast<int>((k - whole) % 2)};
  }
  // a chunk's rows [*off, *off + *rows) narrowed to the part's, cut at a multiple of kRowUnit rows (the second half
  // may be empty)
  static void part_rows(int part, int64_t* off, int64_t* rows) {
    if (part < 0) return;
    const int64_t h = std::min(*rows, round_up(ceil_div(*rows, 2), kRowUnit));
    if (part == 0) {
      *rows = h;
    } else {
      *off += h;
      *rows -= h;
    }
  }
};

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

inline float to_bf16_value(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// v as the compute dtype holds it: rounded to bf16 in a bf16 step, unchanged in a float32 one.
inline float rnd(float v, bool bf16) { return bf16 ? to_bf16_value(v) : v; }

// A projection's output plus its bias (b: nullptr without biases), rounded as the torch path's
// `F.linear(x, w) + b.to(dtype)` in the compute dtype: the product, the bias and their sum.
inline float biased(float v, const float* b, int64_t i, bool bf16) {
  v = rnd(v, bf16);
  return b ? rnd(v + rnd(b[i], bf16), bf16) : v;
}

// The gated activation of a gate / up pair (projections with their biases, as compute-dtype values),
// every op rounded as edgemoe.experts.compute.gated_activation's torch ops round it in the compute dtype.
inline float gated(const ExpertBanks& b, float g, float u, bool bf16) {
  if (b.act == kSilu) return rnd(rnd(silu(g), bf16) * u, bf16);
  g = std::min(g, b.limit);  // g, u hold compute-dtype values: min / clamp with a bf16 bound round the same
  u = std::min(std::max(u, -b.limit), b.limit);
  if (bf16) {
    g = to_bf16_value(g);
    u = to_bf16_value(u);
  }
  const float z = rnd(g * b.alpha, bf16);
  const float sig = rnd(1.0f / (1.0f + std::exp(-z)), bf16);
  return rnd(rnd(u + 1.0f, bf16) * rnd(g * sig, bf16), bf16);
}

// The float32 bias vector of section `off` in expert `fid`'s row (nullptr: the experts have none).
inline const float* bias_of(const ExpertBanks& b, int64_t fid, int64_t off) {
  return off < 0 ? nullptr : reinterpret_cast<const float*>(b.base + fid * b.row_bytes + off);
}

size_t elem_size(WeightFormat fmt) { return fmt == WeightFormat::F32 ? 4 : 2; }

}  // namespace

// ============================================================================ expert rows
WeightView expert_matrix(const ExpertBanks& b, int64_t fid, Proj p) {
  const int64_t H = b.hidden, I = b.inter;
  const bool down = p == Proj::Down;
  const int64_t K = down ? I : H;                   // columns of the matrix
  const int64_t first = p == Proj::Up ? I : 0;      // its first row within its section (up: rows [I, 2I) of w13)
  const uint8_t* row = b.base + fid * b.row_bytes;
  int64_t data_stride = 0;                          // bytes of one matrix row
  switch (b.fmt) {
    case WeightFormat::F32: data_stride = 4 * K; break;
    case WeightFormat::BF16:
    case WeightFormat::F16: data_stride = 2 * K; break;
    case WeightFormat::FP8_E4M3_BLOCK: data_stride = K; break;
    case WeightFormat::MXFP4:
    case WeightFormat::NVFP4: data_stride = K / 2; break;
  }
  WeightView w{row + (down ? b.w2_off : b.w13_off) + first * data_stride, data_stride, nullptr, 0, 0, 0, 1.0f};
  const int64_t scale_off = down ? b.w2_scale_off : b.w13_scale_off;
  if (scale_off < 0) return w;
  const uint8_t* scales = row + scale_off;
  switch (b.fmt) {
    case WeightFormat::FP8_E4M3_BLOCK: {  // float32 grid; up's grid follows gate's ceil(I / bn) scale rows
      w.scale_rows = b.block_rows;
      w.scale_cols = b.block_cols;
      w.scale_row_stride_bytes = 4 * ((K + b.block_cols - 1) / b.block_cols);
      const int64_t first_scale_row = p == Proj::Up ? (I + b.block_rows - 1) / b.block_rows : 0;
      w.scales = scales + first_scale_row * w.scale_row_stride_bytes;
      break;
    }
    case WeightFormat::MXFP4:
    case WeightFormat::NVFP4: {  // one byte per group of 32 (e8m0) or 16 (e4m3) elements of a row
      w.scale_rows = 1;
      w.scale_cols = b.fmt == WeightFormat::MXFP4 ? 32 : 16;
      w.scale_row_stride_bytes = K / w.scale_cols;
      w.scales = scales + first * w.scale_row_stride_bytes;
      const int64_t s2 = down ? b.w2_scale2_off : b.w13_scale2_off;
      if (s2 >= 0) std::memcpy(&w.global_scale, row + s2 + (p == Proj::Up ? 4 : 0), sizeof(float));
      break;
    }
    default: break;
  }
  return w;
}

// ============================================================================ ThreadPool
ThreadPool::ThreadPool(int threads, const std::vector<int>& cpus, int spin_us)
    : n_(std::max(1, threads)), spin_us_(std::max(0, spin_us)), caller_cpu_(cpus.empty() ? -1 : cpus[0]),
      owner_pid_(static_cast<long>(getpid())), pinned_(n_, -1) {
  threads_.reserve(n_ - 1);
  for (int tid = 1; tid < n_; ++tid) {
    const int cpu = tid < static_cast<int>(cpus.size()) ? cpus[tid] : -1;
    try {
      threads_.emplace_back(&ThreadPool::worker, this, tid, cpu);
    } catch (const std::system_error&) {  // out of threads: run with those we have
      n_ = tid;
      pinned_.resize(n_);
      break;
    }
  }
  spin_until([&] { return started_.load(std::memory_order_acquire) == n_ - 1; });  // pinned_ is final
}

ThreadPool::~ThreadPool() {
  if (!usable()) {  // forked child: the std::thread handles belong to the parent's threads; leak them
    new std::vector<std::thread>(std::move(threads_));
    return;
  }
  stop_.store(true, std::memory_order_release);
  gen_.fetch_add(1, std::memory_order_seq_cst);
  {
    std::lock_guard<std::mutex> lk(m_);
    cv_.notify_all();
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int tid, int cpu) {
#if defined(__linux__)
  if (cpu >= 0 && cpu < CPU_SETSIZE) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) pinned_[tid] = cpu;  // refusal: unpinned
  }
#else
  (void)cpu;
#endif
  const IeeeSubnormals ieee;  // a worker runs only jobs: for its whole life
  started_.fetch_add(1, std::memory_order_release);
  uint64_t seen = 0;
  for (;;) {
    seen = wait_for_job(seen);
    if (stop_.load(std::memory_order_acquire)) return;
    fn_(ctx_, tid);
    done_.fetch_add(1, std::memory_order_acq_rel);
  }
}

// Spin until the job generation moves or spin_us elapse (or the thread is found preempted: see
// SpinWait), then sleep on the condition variable. Lost wake-ups are impossible: a sleeper increments
// sleepers_ and re-checks gen_ under the mutex (both seq_cst), and run() bumps gen_ before it reads
// sleepers_ (Dekker pattern), so either the sleeper sees the new generation or run() sees the sleeper
// and notifies under the mutex.
uint64_t ThreadPool::wait_for_job(uint64_t seen) {
  SpinWait w(spin_us_);
  do {
    const uint64_t g = gen_.load(std::memory_order_acquire);
    if (g != seen) return g;
  } while (w.poll());
  if (w.preempted()) preempted_.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> lk(m_);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  cv_.wait(lk, [&] { return gen_.load(std::memory_order_seq_cst) != seen; });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  return gen_.load(std::memory_order_acquire);
}

bool ThreadPool::usable() const { return static_cast<long>(getpid()) == owner_pid_; }

void ThreadPool::run(void (*fn)(void*, int), void* ctx) {
  const IeeeSubnormals ieee;
  if (n_ == 1) {
    fn(ctx, 0);
    return;
  }
  fn_ = fn;
  ctx_ = ctx;
  done_.store(0, std::memory_order_relaxed);
  gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes fn_, ctx_, done_ (release)
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lk(m_);
    cv_.notify_all();
  }
  fn(ctx, 0);
  spin_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
}

// Sense-free generation barrier: the last arrival resets the count, then bumps the generation.
void ThreadPool::barrier() {
  if (n_ == 1) return;
  const uint32_t g = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == static_cast<uint32_t>(n_ - 1)) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.fetch_add(1, std::memory_order_release);
  } else {
    spin_until([&] { return bar_gen_.load(std::memory_order_acquire) != g; });
  }
}

// ============================================================================ Executor
struct Executor::Job {
  Executor* self;
  ExpertBanks b;
  StepArgs s;
  GemvFn gemv;
  ActFormat act;
  bool serial;              // run on the caller alone (no barrier)
  int64_t* trace;           // this call's trace record (trace_calls), or nullptr
  Q15StoreFn q15_store;     // act == Q15_LANES: the level's store of the activation
  int64_t H, I;
  int64_t c1, per_e1;       // phase 1: rows per chunk, chunks per expert
  int64_t c2;               // phase 2: output rows per chunk
  TailClaims k1, k2;        // each phase's chunks as the threads claim them
  const void* const* xptr;  // [R] activation row of each route's token (phase 1 input)
  const void* const* aptr;  // [R] activation row of each route (phase 2 input)
  float* act_f32;           // [R, I] when act == F32
  uint16_t* act_bf16;       // [R, I] when act is a bf16 layout
  uint8_t* act_q15;         // [R, q15_row_bytes(I)] when act == Q15_LANES
  bool bf16_points;         // bf16 compute: round where the torch path's bf16 ops do (projections, biases,
                            // each op of the activation, y, y·w)
  alignas(64) std::atomic<int64_t> next1{0};
  alignas(64) std::atomic<int64_t> next2{0};
};

Executor::Executor(int threads, const std::vector<int>& cpus, int isa_cap, int spin_us,
                   int64_t min_parallel_bytes, int64_t min_chunk_bytes)
    : pool_(threads, cpus, spin_us), min_parallel_bytes_(std::max<int64_t>(0, min_parallel_bytes)),
      min_chunk_bytes_(std::max<int64_t>(0, min_chunk_bytes)) {
  const uint32_t feats = detect_cpu_features();
  for (int f = 0; f < kNumFormats; ++f) {
    isa_[f] = select_isa(feats, isa_cap, static_cast<WeightFormat>(f));
    isa_f32_[f] = is_quantized(static_cast<WeightFormat>(f))
                      ? select_isa(feats, isa_cap, static_cast<WeightFormat>(f), /*bf16_compute=*/false)
                      : isa_[f];
  }
  scratch_.resize(pool_.size());
  partial_.resize(pool_.size());
}

int Executor::isa_for(WeightFormat fmt, bool bf16_compute) const {
  const int f = static_cast<int>(fmt);
  return (f >= 0 && f < kNumFormats) ? (bf16_compute ? isa_[f] : isa_f32_[f]) : -1;
}

int32_t Executor::run(const ExpertBanks& b, const StepArgs& s) {
  const int64_t entry_ns = trace_cap_.load(std::memory_order_relaxed) > 0 ? now_ns() : 0;
  // ---- validation (nothing is written before it passes)
  const int f = static_cast<int>(b.fmt);
  if (f < 0 || f >= kNumFormats || s.T < 0 || s.n_experts < 0 || (s.x_fmt != 0 && s.x_fmt != 1)) return kBadArgs;
  if (s.n_experts > 0 && (!s.fids || !s.offsets)) return kBadArgs;
  if (s.n_experts == 0 || s.offsets[s.n_experts] == 0) {
    if (s.zero_out && s.T > 0 && b.hidden > 0) {
      if (!s.out) return kBadArgs;
      std::memset(s.out, 0, sizeof(float) * s.T * b.hidden);
    }
    return kOk;
  }
  if (!b.base || b.row_bytes <= 0 || b.w13_off < 0 || b.w2_off < 0 || b.hidden <= 0 || b.inter <= 0 || !s.x ||
      !s.out || !s.tok || !s.wt)
    return kBadArgs;
  if (s.offsets[0] != 0) return kBadOffsets;
  for (int64_t e = 0; e < s.n_experts; ++e) {
    if (s.offsets[e + 1] < s.offsets[e]) return kBadOffsets;
    if (s.fids[e] < 0 || s.fids[e] >= b.num_ids) return kBadExpert;
  }
  const int64_t R = s.offsets[s.n_experts];
  for (int64_t r = 0; r < R; ++r)
    if (s.tok[r] < 0 || s.tok[r] >= s.T) return kBadToken;
  if (is_quantized(b.fmt) && (b.w13_scale_off < 0 || b.w2_scale_off < 0 || (b.compute != 0 && b.compute != 1)))
    return kBadArgs;
  if (b.fmt == WeightFormat::FP8_E4M3_BLOCK &&
      (b.block_rows < 1 || b.block_cols < 16 || (b.block_cols & (b.block_cols - 1)) != 0))
    return kBadArgs;  // the kernels need power-of-two scale blocks of >= 16 columns (128 x 128 in releases)
  if ((b.act != kSilu && b.act != kSwigluOai) || ((b.b13_off < 0) != (b.b2_off < 0))) return kBadArgs;
  if ((b.fmt == WeightFormat::MXFP4 && (b.hidden % 32 || b.inter % 32)) ||
      (b.fmt == WeightFormat::NVFP4 && (b.hidden % 16 || b.inter % 16)))
    return kBadArgs;
  const bool bf16c = computes_bf16(b);
  const int level = isa_for(b.fmt, bf16c);
  if (level < 0) return kNoKernel;
  const KernelSet& ks = kernels_for(static_cast<Isa>(level)).by_format[f];
  if (!ks.gemv) return kNoKernel;

  std::lock_guard<std::mutex> lock(run_mutex_);
  const int64_t T = s.T, H = b.hidden, I = b.inter;
  if (s.zero_out) std::memset(s.out, 0, sizeof(float) * T * H);

  // ---- activations: x in the kernel's operand format (a bf16 computation uses bf16-rounded x)
  int64_t x_row_bytes;
  const void* xa = prepare_x(ks, bf16c, s.x, s.x_fmt, T, H, H, &x_row_bytes);
  const int64_t a_row_bytes = act_row_bytes(ks.act, I);
  uint8_t* abase;
  if (ks.act == ActFormat::Q15_LANES) {
    act_q15_.resize(R * a_row_bytes);
    abase = act_q15_.data();
    for (int64_t r = 0; r < R; ++r) q15_lanes_clear_tail(abase + r * a_row_bytes, I);
  } else if (is_bf16_act(ks.act)) {
    act_bf16_.resize(R * I);
    abase = reinterpret_cast<uint8_t*>(act_bf16_.data());
  } else {
    act_f32_.resize(R * I);
    abase = reinterpret_cast<uint8_t*>(act_f32_.data());
  }
  xptr_.resize(R);
  aptr_.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    xptr_[r] = static_cast<const uint8_t*>(xa) + s.tok[r] * x_row_bytes;
    aptr_[r] = abase + r * a_row_bytes;
  }

  // ---- work split
  int64_t nmax = 0, active = 0;
  for (int64_t e = 0; e < s.n_experts; ++e) {
    const int64_t n = s.offsets[e + 1] - s.offsets[e];
    nmax = std::max(nmax, n);
    active += n > 0;
  }
  const IeeeSubnormals ieee;  // the serial path runs on the caller alone
  const int p = pool_.size();
  const int64_t bytes = active * b.row_bytes;
  Job J;
  J.self = this;
  J.b = b;
  J.s = s;
  J.gemv = ks.gemv;
  J.act = ks.act;
  J.q15_store = q15_store_of(ks);
  J.serial = p == 1 || bytes < min_parallel_bytes_ || !pool_.usable();
  J.H = H;
  J.I = I;
  // Chunks: EDGEMOE_CHUNKS_PER_THREAD per thread and phase (dynamic balance), fewer (at least one per thread) where
  // chunks would hold fewer than min_chunk_bytes_ of weights, in whole units of kRowUnit rows (16: chunk edges on
  // lines). A chunk's rows are a few sequential streams that each start cold (their first rows not prefetched) and stop
  // early, so a chunk of few bytes reads slowly: by rows alone, a call of 4 experts at 15 threads cut FP4 rows
  // into chunks of 64 gate and 64 up rows (2 x 68 KB) and of 48 down rows of every expert (4 x 19 KB), a quarter
  // of bf16's. On a 2-core Zen 5 given that chunking (-DEDGEMOE_CHUNKS_PER_THREAD=30 at 2 threads), calls of 3
  // experts read MXFP4 / NVFP4 rows at 28-32 GB/s, and at 34-42 with a 256 KiB floor (cpu_executor.md, "Chunks of
  // a call"). Chunking never changes a result: each output row sums its experts in step order whichever thread
  // runs it. Byte counts are of the codes (a row's stride), scales aside.
#ifndef EDGEMOE_CHUNKS_PER_THREAD
#define EDGEMOE_CHUNKS_PER_THREAD 4
#endif
  static_assert(EDGEMOE_CHUNKS_PER_THREAD >= 1, "EDGEMOE_CHUNKS_PER_THREAD must be at least 1");
  // rows of a chunk when `total` rows of `row_bytes` each are to be cut (at most `limit`: a chunk stays in one
  // expert's rows)
  auto chunk_rows = [&](int64_t total, int64_t limit, int64_t row_bytes) {
    if (J.serial) return limit;
    const int64_t floor_bytes = std::max<int64_t>(1, min_chunk_bytes_ * p);  // 0: the rows alone decide
    const int64_t per_thread = std::clamp<int64_t>(total * row_bytes / floor_bytes, 1, EDGEMOE_CHUNKS_PER_THREAD);
    return std::min(limit, std::max<int64_t>(kRowUnit, round_up(ceil_div(total, per_thread * p), kRowUnit)));
  };
  const int64_t gate_row = expert_matrix(b, s.fids[0], Proj::Gate).row_stride_bytes;  // bytes of a row's codes
  const int64_t down_row = expert_matrix(b, s.fids[0], Proj::Down).row_stride_bytes;
  J.c1 = chunk_rows(active * I, I, 2 * gate_row);  // a phase-1 row: a gate row and an up row (experts with tokens)
  J.per_e1 = ceil_div(I, J.c1);
  J.c2 = chunk_rows(H, H, active * down_row);  // a phase-2 row: that row of every expert with tokens
  const int claimants = J.serial ? 1 : p;
  J.k1 = TailClaims::of(s.n_experts * J.per_e1, claimants);
  J.k2 = TailClaims::of(ceil_div(H, J.c2), claimants);
  J.xptr = xptr_.data();
  J.aptr = aptr_.data();
  J.act_f32 = act_f32_.data();
  J.act_bf16 = act_bf16_.data();
  J.act_q15 = act_q15_.data();
  J.bf16_points = bf16c;
  const size_t need = static_cast<size_t>(nmax * std::max(2 * J.c1, J.c2));
  for (auto& v : scratch_)
    if (v.size() < need) v.resize(need);

  J.trace = nullptr;
  if (trace_n_ < trace_cap_.load(std::memory_order_relaxed)) {
    J.trace = trace_.data() + trace_n_++ * trace_stride();
    std::fill(J.trace, J.trace + trace_stride(), int64_t{0});
    J.trace[0] = entry_ns;
    J.trace[1] = now_ns();
  }
  if (J.serial)
    step_job(&J, 0);
  else
    pool_.run(&Executor::step_job, &J);
  if (J.trace) J.trace[2] = now_ns();
  return kOk;
}

void Executor::trace_calls(int64_t capacity) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  const int64_t cap = std::max<int64_t>(0, capacity);
  trace_n_ = 0;
  trace_.assign(static_cast<size_t>(cap * trace_stride()), 0);
  trace_cap_.store(cap, std::memory_order_relaxed);
}

std::vector<int64_t> Executor::traced() {
  std::lock_guard<std::mutex> lock(run_mutex_);
  return std::vector<int64_t>(trace_.begin(), trace_.begin() + trace_n_ * trace_stride());
}

void Executor::step_job(void* job, int tid) {
  Job& J = *static_cast<Job*>(job);
  int64_t* tr = J.trace ? J.trace + 3 + 4 * tid : nullptr;
  if (tr) tr[0] = now_ns();
  for (int64_t k; (k = J.next1.fetch_add(1, std::memory_order_relaxed)) < J.k1.count();)
    J.self->phase1_chunk(J, k, tid);
  if (tr) tr[1] = now_ns();
  if (!J.serial) J.self->pool_.barrier();  // every activation of the step is written
  if (tr) tr[2] = now_ns();
  for (int64_t k; (k = J.next2.fetch_add(1, std::memory_order_relaxed)) < J.k2.count();)
    J.self->phase2_chunk(J, k, tid);
  if (tr) tr[3] = now_ns();
}

// Gate rows [i0, i0 + rows) and up rows [I + i0, ...) of one expert for all its tokens, then
// a = act(gate + bias, up + bias) into the step's activation rows.
void Executor::phase1_chunk(Job& J, int64_t k, int tid) {
  const auto [c, part] = J.k1.at(k);
  const int64_t e = c / J.per_e1;
  int64_t i0 = (c % J.per_e1) * J.c1, rows = std::min(J.c1, J.I - i0);
  TailClaims::part_rows(part, &i0, &rows);
  if (rows == 0) return;
  const int64_t r0 = J.s.offsets[e], n = J.s.offsets[e + 1] - r0;
  if (n == 0) return;
  const int64_t H = J.H, I = J.I, fid = J.s.fids[e];
  const WeightView wg = expert_matrix(J.b, fid, Proj::Gate), wu = expert_matrix(J.b, fid, Proj::Up);
  float* g = scratch_[tid].data();
  float* u = g + n * rows;
  J.gemv(wg, i0, rows, H, J.xptr + r0, static_cast<int>(n), g, rows);
  J.gemv(wu, i0, rows, H, J.xptr + r0, static_cast<int>(n), u, rows);
  const float* bg = bias_of(J.b, fid, J.b.b13_off);  // [2I]: gate's bias, then up's
  const float* bu = bg ? bg + I : nullptr;
  const bool bf = J.bf16_points;
  for (int64_t j = 0; j < n; ++j) {
    const float* gj = g + j * rows;
    const float* uj = u + j * rows;
    if (J.act == ActFormat::Q15_LANES) {  // whole lanes: i0 and rows are multiples of kRowUnit (8 or more; I % 16 == 0)
      thread_local std::vector<uint16_t> ab;  // the chunk's activation as bf16
      ab.resize(rows);
      for (int64_t r = 0; r < rows; ++r)
        ab[r] = f32_to_bf16(gated(J.b, biased(gj[r], bg, i0 + r, bf), biased(uj[r], bu, i0 + r, bf), bf));
      J.q15_store(J.act_q15 + (r0 + j) * q15_row_bytes(I), i0, ab.data(), rows);
    } else if (J.act == ActFormat::BF16) {
      uint16_t* dst = J.act_bf16 + (r0 + j) * I + i0;
      for (int64_t r = 0; r < rows; ++r)
        dst[r] = f32_to_bf16(gated(J.b, biased(gj[r], bg, i0 + r, bf), biased(uj[r], bu, i0 + r, bf), bf));
    } else if (is_bf16_act(J.act)) {  // a blocked layout
      uint16_t* dst = J.act_bf16 + (r0 + j) * I;
      for (int64_t r = 0; r < rows; ++r)
        dst[bf16_act_pos(J.act, i0 + r, I)] =
            f32_to_bf16(gated(J.b, biased(gj[r], bg, i0 + r, bf), biased(uj[r], bu, i0 + r, bf), bf));
    } else {
      float* dst = J.act_f32 + (r0 + j) * I + i0;
      for (int64_t r = 0; r < rows; ++r)
        dst[r] = gated(J.b, biased(gj[r], bg, i0 + r, bf), biased(uj[r], bu, i0 + r, bf), bf);
    }
  }
}

// Output rows [o0, o0 + rows) of every expert of the step, in step order, accumulated into out.
void Executor::phase2_chunk(Job& J, int64_t k, int tid) {
  const auto [c, part] = J.k2.at(k);
  int64_t o0 = c * J.c2, rows = std::min(J.c2, J.H - o0);
  TailClaims::part_rows(part, &o0, &rows);
  if (rows == 0) return;
  const int64_t H = J.H, I = J.I;
  const bool bf = J.bf16_points;
  float* y = scratch_[tid].data();
  for (int64_t e = 0; e < J.s.n_experts; ++e) {
    const int64_t r0 = J.s.offsets[e], n = J.s.offsets[e + 1] - r0;
    if (n == 0) continue;
    const WeightView w = expert_matrix(J.b, J.s.fids[e], Proj::Down);
    J.gemv(w, o0, rows, I, J.aptr + r0, static_cast<int>(n), y, rows);
    const float* b2 = bias_of(J.b, J.s.fids[e], J.b.b2_off);  // [H]
    for (int64_t j = 0; j < n; ++j) {
      float* o = J.s.out + J.s.tok[r0 + j] * H + o0;
      const float* yj = y + j * rows;
      if (bf) {  // as the torch path: y (+ bias) and the router weight as bf16, their product rounded
        const float wt = to_bf16_value(J.s.wt[r0 + j]);
        for (int64_t r = 0; r < rows; ++r) o[r] += to_bf16_value(biased(yj[r], b2, o0 + r, true) * wt);
      } else {
        const float wt = J.s.wt[r0 + j];
        if (b2)
          for (int64_t r = 0; r < rows; ++r) o[r] += wt * (yj[r] + b2[o0 + r]);
        else
          for (int64_t r = 0; r < rows; ++r) o[r] += wt * yj[r];
      }
    }
  }
}

const void* Executor::prepare_x(const KernelSet& ks, bool bf16_compute, const void* x, int32_t x_fmt, int64_t T,
                                int64_t H, int64_t ldx, int64_t* row_bytes) {
  *row_bytes = act_row_bytes(ks.act, H);
  if (ks.act == ActFormat::Q15_LANES) {  // integer lanes of the bf16 (or bf16-rounded) row
    x_q15_.resize(T * *row_bytes);
    thread_local std::vector<uint16_t> xb;
    xb.resize(H);
    for (int64_t t = 0; t < T; ++t) {
      const uint16_t* src;
      if (x_fmt == 1) {
        src = static_cast<const uint16_t*>(x) + t * ldx;
      } else {
        const float* xr = static_cast<const float*>(x) + t * ldx;
        for (int64_t i = 0; i < H; ++i) xb[i] = f32_to_bf16(xr[i]);
        src = xb.data();
      }
      uint8_t* dst = x_q15_.data() + t * *row_bytes;
      q15_lanes_clear_tail(dst, H);
      q15_store_of(ks)(dst, 0, src, H);
    }
    return x_q15_.data();
  }
  if (ks.act == ActFormat::BF16_P64) {  // permuted copy, from bf16 or rounded
    x_bf16_.resize(T * H);
    for (int64_t t = 0; t < T; ++t) {
      uint16_t* dst = x_bf16_.data() + t * H;
      if (x_fmt == 1) {
        const uint16_t* xr = static_cast<const uint16_t*>(x) + t * ldx;
        for (int64_t i = 0; i < H; ++i) dst[p64_pos(i, H)] = xr[i];
      } else {
        const float* xr = static_cast<const float*>(x) + t * ldx;
        for (int64_t i = 0; i < H; ++i) dst[p64_pos(i, H)] = f32_to_bf16(xr[i]);
      }
    }
    return x_bf16_.data();
  }
  if (ks.act == ActFormat::BF16) {
    if (x_fmt == 1) {
      *row_bytes = 2 * ldx;
      return x;
    }
    x_bf16_.resize(T * H);
    for (int64_t t = 0; t < T; ++t) {
      const float* xr = static_cast<const float*>(x) + t * ldx;
      for (int64_t i = 0; i < H; ++i) x_bf16_[t * H + i] = f32_to_bf16(xr[i]);
    }
    return x_bf16_.data();
  }
  if (x_fmt == 0 && !bf16_compute) {
    *row_bytes = 4 * ldx;
    return x;
  }
  x_f32_.resize(T * H);
  for (int64_t t = 0; t < T; ++t) {
    if (x_fmt == 1) {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + t * ldx;
      for (int64_t i = 0; i < H; ++i) x_f32_[t * H + i] = bf16_to_f32(xr[i]);
    } else {
      const float* xr = static_cast<const float*>(x) + t * ldx;
      for (int64_t i = 0; i < H; ++i) x_f32_[t * H + i] = bf16_to_f32(f32_to_bf16(xr[i]));
    }
  }
  return x_f32_.data();
}

struct Executor::LinearJob {
  Executor* self;
  GemvFn gemv;
  WeightView w;
  int64_t N, K, M, chunk, n_chunks, ldy;
  const void* const* xptr;  // [M] operand row of each input row
  void* y;
  int32_t y_fmt;
  alignas(64) std::atomic<int64_t> next{0};
};

void Executor::linear_job(void* job, int tid) {
  LinearJob& J = *static_cast<LinearJob*>(job);
  for (int64_t c; (c = J.next.fetch_add(1, std::memory_order_relaxed)) < J.n_chunks;) {
    const int64_t r0 = c * J.chunk, rows = std::min(J.chunk, J.N - r0);
    if (J.y_fmt == 0) {  // straight into y
      J.gemv(J.w, r0, rows, J.K, J.xptr, static_cast<int>(J.M), static_cast<float*>(J.y) + r0, J.ldy);
      continue;
    }
    float* t = J.self->scratch_[tid].data();  // [M, rows]
    J.gemv(J.w, r0, rows, J.K, J.xptr, static_cast<int>(J.M), t, rows);
    for (int64_t m = 0; m < J.M; ++m) {
      uint16_t* dst = static_cast<uint16_t*>(J.y) + m * J.ldy + r0;
      for (int64_t r = 0; r < rows; ++r) dst[r] = f32_to_bf16(t[m * rows + r]);
    }
  }
}

int32_t Executor::linear(const void* w, WeightFormat fmt, int64_t N, int64_t K, int64_t w_stride, const void* x,
                         int32_t x_fmt, int64_t M, int64_t ldx, void* y, int32_t y_fmt, int64_t ldy) {
  const int f = static_cast<int>(fmt);
  if (f < 0 || f >= kNumFormats || is_quantized(fmt) || N < 0 || K < 1 || M < 0 || (x_fmt != 0 && x_fmt != 1) ||
      (y_fmt != 0 && y_fmt != 1) || ldx < K || ldy < N || w_stride < K * static_cast<int64_t>(elem_size(fmt)))
    return kBadArgs;
  if (M == 0 || N == 0) return kOk;
  if (!w || !x || !y) return kBadArgs;
  const int level = isa_[f];
  if (level < 0) return kNoKernel;
  const KernelSet& ks = kernels_for(static_cast<Isa>(level)).by_format[f];
  if (!ks.gemv) return kNoKernel;

  std::lock_guard<std::mutex> lock(run_mutex_);
  const IeeeSubnormals ieee;
  int64_t x_row_bytes;
  const void* xa = prepare_x(ks, fmt == WeightFormat::BF16, x, x_fmt, M, K, ldx, &x_row_bytes);
  xptr_.resize(M);
  for (int64_t m = 0; m < M; ++m) xptr_[m] = static_cast<const uint8_t*>(xa) + m * x_row_bytes;
  const int p = pool_.size();
  const bool serial = p == 1 || N * K * static_cast<int64_t>(elem_size(fmt)) < min_parallel_bytes_ || !pool_.usable();
  LinearJob J;
  J.self = this;
  J.gemv = ks.gemv;
  J.w = WeightView{w, w_stride, nullptr, 0, 0};
  J.N = N;
  J.K = K;
  J.M = M;
  // ~4 chunks per thread (dynamic balance), whole rows of 16
  J.chunk = std::min(N, std::max<int64_t>(16, round_up(ceil_div(N, 4 * static_cast<int64_t>(serial ? 1 : p)), 16)));
  J.n_chunks = ceil_div(N, J.chunk);
  J.ldy = ldy;
  J.xptr = xptr_.data();
  J.y = y;
  J.y_fmt = y_fmt;
  if (y_fmt == 1) {
    const size_t need = static_cast<size_t>(M * J.chunk);
    for (auto& v : scratch_)
      if (v.size() < need) v.resize(need);
  }
  if (serial)
    linear_job(&J, 0);
  else
    pool_.run(&Executor::linear_job, &J);
  return kOk;
}

int32_t Executor::attention_layer(const uint16_t* x, int64_t H, const uint16_t* qkv_w, const uint16_t* o_w,
                                  const DecodeAttentionArgs& args, uint16_t* y) {
  if (!x || !qkv_w || !o_w || !y || H < 1 || decode_attention_check(args)) return kBadArgs;
  const int64_t T = args.tokens, Nq = args.num_heads * args.head_dim, Nk = args.num_kv_heads * args.head_dim;
  const int64_t N = Nq + 2 * Nk;
  std::lock_guard<std::mutex> lock(layer_mutex_);
  layer_qkv_.resize(static_cast<size_t>(T * N));
  layer_attn_.resize(static_cast<size_t>(T * Nq));
  int32_t st = linear(qkv_w, WeightFormat::BF16, N, H, H * 2, x, 1, T, H, layer_qkv_.data(), 1, N);
  if (st) return st;
  DecodeAttentionArgs a = args;
  a.q = layer_qkv_.data();
  a.k = a.q + Nq;
  a.v = a.k + Nk;
  a.q_ld = a.k_ld = a.v_ld = N;
  a.out = layer_attn_.data();
  if (decode_attention(a)) return kBadArgs;
  return linear(o_w, WeightFormat::BF16, H, Nq, Nq * 2, layer_attn_.data(), 1, T, Nq, y, 1, H);
}

int32_t Executor::moe_decode(const ExpertBanks& b, const MoeDecodeArgs& a, int64_t* n_experts) {
  if (a.T < 1 || a.E < 1 || a.top_k < 1 || a.top_k > a.E || !a.x || !a.out || !a.ids || !n_experts || b.hidden < 1 ||
      (a.router ? !a.weights : !a.route_weights))
    return kBadArgs;
  if (a.id_base < 0 || a.id_base + a.E > b.num_ids) return kBadExpert;
  const int64_t T = a.T, H = b.hidden, E = a.E, k = a.top_k, R = T * k;
  std::lock_guard<std::mutex> lock(moe_mutex_);
  int32_t st = kOk;
  if (a.router) {
    moe_logits_.resize(static_cast<size_t>(T * E));
    if ((st = linear(a.router, WeightFormat::BF16, E, H, H * 2, a.x, 1, T, H, moe_logits_.data(), 1, E))) return st;
    softmax_topk_bf16(moe_logits_.data(), T, E, E, k, a.norm_topk, a.ids, a.weights);
  } else {
    for (int64_t r = 0; r < R; ++r)
      if (a.ids[r] < 0 || a.ids[r] >= E) return kBadExpert;
  }
  // routes r = t * k + j, stably sorted by expert: ascending (expert, token, k)
  moe_order_.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) moe_order_[r] = r;
  std::stable_sort(moe_order_.begin(), moe_order_.end(), [&](int64_t p, int64_t q) { return a.ids[p] < a.ids[q]; });
  moe_fids_.clear();
  moe_offsets_.assign(1, 0);
  moe_tok_.resize(static_cast<size_t>(R));
  moe_wt_.resize(static_cast<size_t>(R));
  for (int64_t i = 0; i < R; ++i) {
    const int64_t r = moe_order_[i], id = a.ids[r];
    if (moe_fids_.empty() || moe_fids_.back() != a.id_base + id) {
      moe_fids_.push_back(a.id_base + id);
      moe_offsets_.push_back(i);
    }
    moe_offsets_.back() = i + 1;
    moe_tok_[i] = r / k;
    if (a.router) {
      const uint32_t w = static_cast<uint32_t>(a.weights[r]) << 16;
      std::memcpy(&moe_wt_[i], &w, 4);
    } else {
      moe_wt_[i] = a.route_weights[r];
    }
  }
  moe_acc_.resize(static_cast<size_t>(T * H));
  const StepArgs s{a.x, 1, T, moe_acc_.data(), static_cast<int64_t>(moe_fids_.size()), moe_fids_.data(),
                   moe_offsets_.data(), moe_tok_.data(), moe_wt_.data(), 1};
  if ((st = run(b, s))) return st;
  round_add_bf16(moe_acc_.data(), a.residual, a.out, T * H);
  *n_experts = static_cast<int64_t>(moe_fids_.size());
  return kOk;
}

struct Executor::AttentionJob {
  const DecodeAttentionArgs* a;
  const float* qf;
  const int64_t* first;
  float* parts;
  int64_t items, merges, stride;
  bool serial;
  Executor* self;
  alignas(64) std::atomic<int64_t> next1{0};
  alignas(64) std::atomic<int64_t> next2{0};
};

void Executor::attention_job(void* job, int tid) {
  AttentionJob& J = *static_cast<AttentionJob*>(job);
  for (int64_t it; (it = J.next1.fetch_add(1, std::memory_order_relaxed)) < J.items;)
    attention_part(*J.a, J.qf, J.first, it, J.parts + it * J.stride);
  if (!J.serial) J.self->pool_.barrier();  // every part is written
  for (int64_t tg; (tg = J.next2.fetch_add(1, std::memory_order_relaxed)) < J.merges;)
    attention_merge(*J.a, J.first, J.parts, tg);
}

int32_t Executor::decode_attention(const DecodeAttentionArgs& args) {
  if (decode_attention_check(args)) return 1;
  DecodeAttentionArgs a = args;  // scores by bf16 dot products where this executor's bf16 kernels use them
  a.bf16_dot = isa_[static_cast<int>(WeightFormat::BF16)] >= static_cast<int>(Isa::Avx512Bf16) && has_bf16_dot();
  std::lock_guard<std::mutex> lock(run_mutex_);
  const IeeeSubnormals ieee;
  const size_t nq = static_cast<size_t>(a.tokens * a.num_heads * a.head_dim);
  if (attn_q_.size() < nq) attn_q_.resize(nq);
  decode_attention_prologue(a, attn_q_.data());
  AttentionJob J;
  J.a = &a;
  J.qf = attn_q_.data();
  J.items = attention_items(a, attn_first_);
  J.first = attn_first_.data();
  J.stride = attention_part_floats(a);
  if (attn_parts_.size() < static_cast<size_t>(J.items * J.stride))
    attn_parts_.resize(static_cast<size_t>(J.items * J.stride));
  J.parts = attn_parts_.data();
  J.merges = a.tokens * a.num_kv_heads;
  J.self = this;
  // one item is ~kAttnChunk keys of G heads: a step of fewer items than threads runs on fewer threads' worth
  J.serial = pool_.size() == 1 || J.items < 2 || !pool_.usable();
  if (J.serial)
    attention_job(&J, 0);
  else
    pool_.run(&Executor::attention_job, &J);
  return 0;
}

namespace {
struct SumJob {
  const float* p;
  int64_t n, chunk;
  SumFn fn;
  double* partial;
};
void sum_job(void* ctx, int tid) {
  SumJob& J = *static_cast<SumJob*>(ctx);
  const int64_t s = std::min(J.n, tid * J.chunk), e = std::min(J.n, s + J.chunk);
  J.partial[tid] = e > s ? J.fn(J.p + s, e - s) : 0.0;
}
}  // namespace

double Executor::sum_f32(const float* p, int64_t n) {
  std::lock_guard<std::mutex> lock(run_mutex_);
  const int level = std::max(0, isa_[static_cast<int>(WeightFormat::F32)]);
  SumJob J{p, n, round_up(ceil_div(n, pool_.size()), 1024), kernels_for(static_cast<Isa>(level)).by_format[0].sum_f32,
           partial_.data()};
  if (pool_.usable()) {
    pool_.run(&sum_job, &J);
  } else {
    for (int t = 0; t < pool_.size(); ++t) sum_job(&J, t);
  }
  double s = 0.0;
  for (int t = 0; t < pool_.size(); ++t) s += partial_[t];
  return s;
}

}  // namespace edgemoe

extern "C" void edgemoe_run_step(void* p) {
  auto* st = static_cast<edgemoe_step*>(p);
  if (!st) return;
  try {
    if (!st->executor || !st->dims || !st->offsets) {
      st->status = edgemoe::kBadArgs;
      return;
    }
    const int64_t T = st->dims[0], E = st->dims[1];
    if (T < 0 || E < 0 || T > st->max_tokens || E > st->max_experts ||
        (E > 0 && (st->offsets[E] < 0 || st->offsets[E] > st->max_routes))) {
      st->status = edgemoe::kTooLarge;
      return;
    }
    const edgemoe::StepArgs a{st->x, st->x_fmt, T, st->out, E, st->fids, st->offsets, st->tok, st->wt, st->zero_out};
    st->status = static_cast<edgemoe::Executor*>(st->executor)->run(st->banks, a);
    if (st->status != edgemoe::kOk && st->zero_out && st->out)  // no stale partial from an earlier call
      std::memset(st->out, 0, sizeof(float) * st->max_tokens * st->banks.hidden);
    st->calls += 1;
  } catch (...) {
    st->status = edgemoe::kInternal;
  }
}

// ============================================================================ StepServer
namespace edgemoe {

StepServer::StepServer(edgemoe_step* step, int64_t* request, int64_t* done, int active_spin_us, int cpu,
                       uint32_t* release, int64_t* gave_up, int64_t watchdog_ms)
    : step_(step), request_(request), done_(done), active_spin_us_(std::max(0, active_spin_us)), cpu_(cpu),
      release_(release), gave_up_(gave_up), watchdog_ms_(release && gave_up ? std::max<int64_t>(1, watchdog_ms) : 0),
      owner_pid_(static_cast<long>(getpid())) {
  answered_ = __atomic_load_n(request_, __ATOMIC_ACQUIRE);
  __atomic_store_n(done_, answered_, __ATOMIC_RELEASE);  // nothing pending
  thread_ = std::thread(&StepServer::loop, this);
  if (watchdog_ms_) watchdog_ = std::thread(&StepServer::watch, this);
}

StepServer::~StepServer() {
  stop_.store(true, std::memory_order_release);
  if (static_cast<long>(getpid()) != owner_pid_) {  // forked child: the threads are the parent's; leak the handles
    new std::thread(std::move(thread_));
    if (watchdog_.joinable()) new std::thread(std::move(watchdog_));
    return;
  }
  if (watchdog_.joinable()) watchdog_.join();
  if (thread_.joinable()) thread_.join();
  if (release_) {  // a request rung but not answered would hold the device's wait op forever
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t req = __atomic_load_n(request_, __ATOMIC_ACQUIRE);
    if (req != answered_) give_up_locked(req);
  }
}

void StepServer::give_up_locked(int64_t req) {
  dead_ = true;
  answered_ = req;
  __atomic_store_n(gave_up_, __atomic_load_n(gave_up_, __ATOMIC_ACQUIRE) + 1, __ATOMIC_RELEASE);  // before release
  __atomic_store_n(release_, 1u, __ATOMIC_RELEASE);
}

void StepServer::loop() {
#if defined(__linux__)
  if (cpu_ >= 0 && cpu_ < CPU_SETSIZE) {  // this thread is the pool's worker 0: its own core
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu_, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0) pinned_.store(cpu_, std::memory_order_release);
  }
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // 1 us: the 50 us idle polls below wake on time
#endif
  int64_t last = __atomic_load_n(done_, __ATOMIC_ACQUIRE);
  auto t_last = Clock::now();
  SpinWait active(active_spin_us_);
  bool counted = false;  // this idle period's preemption is counted
  auto t_empty = Clock::now();  // the last poll that found no new request
  while (!stop_.load(std::memory_order_acquire)) {
    const auto t_poll = Clock::now();
    const int64_t req = __atomic_load_n(request_, __ATOMIC_ACQUIRE);  // written by the device over PCIe
    if (req != last) {
      if (release_) {
        std::lock_guard<std::mutex> lock(mu_);
        if (dead_) return;  // given up by the watchdog, which answers from now on
      }
      edgemoe_run_step(step_);
      if (step_->status != kOk) failed_.fetch_add(1, std::memory_order_relaxed);
      // the step's time since the last poll that found no request (at most the time since the ring: the
      // request came after that poll), in the word after done (stored before done): with the device's time from
      // its ring to its join, the join bounds how long before it the CPU branch finished (graded lateness); a
      // server that was sleeping between polls overstates it, so a join errs toward "not early"
      __atomic_store_n(done_ + 1,
                       static_cast<int64_t>(
                           std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t_empty).count()),
                       __ATOMIC_RELAXED);
      last = req;
      if (release_) {
        std::lock_guard<std::mutex> lock(mu_);
        if (dead_) return;  // the watchdog answered for us: this late result is not posted
        served_.fetch_add(1, std::memory_order_release);
        __atomic_store_n(done_, req, __ATOMIC_RELEASE);
        answered_ = req;
        __atomic_store_n(release_, 1u, __ATOMIC_RELEASE);  // out[] and done are complete before it
      } else {
        served_.fetch_add(1, std::memory_order_release);  // before done: a waiter that sees done sees it
        __atomic_store_n(done_, req, __ATOMIC_RELEASE);
      }
      t_last = t_empty = Clock::now();  // the next request is rung after the device saw this one's done
      active = SpinWait(active_spin_us_);
      counted = false;
      continue;
    }
    t_empty = t_poll;
    if (active.poll()) continue;  // spinning, politely (see SpinWait)
    if (active.preempted() && !counted) {
      preempted_.fetch_add(1, std::memory_order_relaxed);
      counted = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(us_since(t_last) < 1000000 ? 50 : 1000));
  }
}

void StepServer::watch() {
  // Checks a few times per timeout while the server answers; once it is given up, every 50 us.
  const auto tick = std::chrono::microseconds(std::clamp<int64_t>(watchdog_ms_ * 125, 50, 10000));
  int64_t pending = __atomic_load_n(request_, __ATOMIC_ACQUIRE);
  auto since = Clock::now();
  while (!stop_.load(std::memory_order_acquire)) {
    const int64_t req = __atomic_load_n(request_, __ATOMIC_ACQUIRE);
    bool dead;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (req == answered_) {
        pending = req;
      } else if (dead_) {
        give_up_locked(req);
      } else if (req != pending) {
        pending = req;
        since = Clock::now();
      } else if (us_since(since) >= watchdog_ms_ * 1000) {
        give_up_locked(req);
      }
      dead = dead_;
    }
    std::this_thread::sleep_for(dead ? std::chrono::microseconds(50) : tick);
  }
}

}  // namespace edgemoe

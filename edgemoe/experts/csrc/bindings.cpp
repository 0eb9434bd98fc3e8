// Python binding of the native CPU expert executor (pybind11 only, no torch headers: the module
// compiles in seconds). Tensors cross as raw addresses; edgemoe/experts/native.py owns every check
// of dtype, shape, device and contiguity and keeps the tensors alive for the duration of a call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "dense.h"
#include "executor.h"
#include "kernels.h"

namespace py = pybind11;
using namespace edgemoe;

namespace {

template <class T>
T* ptr(uintptr_t a) {
  return reinterpret_cast<T*>(a);
}

// Allocates an edgemoe_step over registered buffers; freed by step_destroy.
uintptr_t step_create(Executor& ex, const ExpertBanks& banks, int32_t x_fmt, uintptr_t x, uintptr_t out, uintptr_t dims,
                      uintptr_t fids, uintptr_t offsets, uintptr_t tok, uintptr_t wt, int64_t max_tokens,
                      int64_t max_experts, int64_t max_routes, bool zero_out) {
  auto* s = new edgemoe_step{};
  s->executor = &ex;
  s->banks = banks;
  s->x_fmt = x_fmt;
  s->x = ptr<const void>(x);
  s->out = ptr<float>(out);
  s->dims = ptr<const int64_t>(dims);
  s->fids = ptr<const int64_t>(fids);
  s->offsets = ptr<const int64_t>(offsets);
  s->tok = ptr<const int64_t>(tok);
  s->wt = ptr<const float>(wt);
  s->max_tokens = max_tokens;
  s->max_experts = max_experts;
  s->max_routes = max_routes;
  s->zero_out = zero_out ? 1 : 0;
  return reinterpret_cast<uintptr_t>(s);
}

// A benchmark call's routes in a registered step: tokens 0 .. T-1 through each of E experts, weight 1/8
// (write_bench_routes), the experts order[i .. i + E) taken cyclically from n_order, i advanced past them
// (write_bench_experts). bench_shape: kOk, or the status refusing E and T for this step.
int32_t bench_shape(const edgemoe_step* st, int64_t E, int64_t T, int64_t n_order) {
  if (E < 1 || T < 1 || n_order < 1) return kBadArgs;
  if (E > st->max_experts || E * T > st->max_routes || T > st->max_tokens) return kTooLarge;
  return kOk;
}
void write_bench_routes(edgemoe_step* st, int64_t E, int64_t T) {
  auto* dims = const_cast<int64_t*>(st->dims);
  auto* offsets = const_cast<int64_t*>(st->offsets);
  auto* tok = const_cast<int64_t*>(st->tok);
  auto* wt = const_cast<float*>(st->wt);
  dims[0] = T;
  dims[1] = E;
  for (int64_t e = 0; e <= E; ++e) offsets[e] = e * T;
  for (int64_t r = 0; r < E * T; ++r) {
    tok[r] = r % T;
    wt[r] = 0.125f;
  }
}
void write_bench_experts(edgemoe_step* st, int64_t E, const int64_t* order, int64_t n_order, int64_t& i) {
  auto* fids = const_cast<int64_t*>(st->fids);
  for (int64_t e = 0; e < E; ++e, ++i) fids[e] = order[i % n_order];
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "edgemoe native CPU expert kernels (see edgemoe/experts/native.py)";

  m.def("cpu_features", &detect_cpu_features, "CPU feature bitmask (cpuid + xgetbv)");
  m.def(
      "select_isa",
      [](uint32_t features, int cap, int fmt, bool bf16_compute) {
        return select_isa(features, cap, static_cast<WeightFormat>(fmt), bf16_compute);
      },
      py::arg("features"), py::arg("cap"), py::arg("fmt"), py::arg("bf16_compute") = true,
      "ISA level chosen for a feature bitmask, a cap (-1: none), a weight format and whether it computes in bf16 "
      "(-1: no kernel)");
  m.def("isa_name", [](int level) { return std::string(isa_name(static_cast<Isa>(level))); });
  m.def(
      "q15_lanes_store",
      [](int level, int fmt, uintptr_t row, int64_t k0, uintptr_t x, int64_t n) {
        const KernelSet& ks = kernels_for(static_cast<Isa>(level)).by_format[fmt];
        q15_store_of(ks)(ptr<uint8_t>(row), k0, ptr<const uint16_t>(x), n);
        return ks.q15_store != nullptr;
      },
      py::arg("level"), py::arg("fmt"), py::arg("row"), py::arg("k0"), py::arg("x"), py::arg("n"),
      "Elements [k0, k0 + n) of a Q15_LANES row (kernels.h) from bf16 bits, with the store of ISA `level` for weight "
      "format `fmt` (the caller checks the CPU has the level); returns whether the level has its own (else scalar)");
  m.def("feature_bits", [] {
    return py::dict(py::arg("avx2") = uint32_t(kFeatAvx2), py::arg("fma") = uint32_t(kFeatFma),
                    py::arg("avx512f") = uint32_t(kFeatAvx512F), py::arg("avx512bw") = uint32_t(kFeatAvx512BW),
                    py::arg("avx512vl") = uint32_t(kFeatAvx512VL), py::arg("avx512_bf16") = uint32_t(kFeatAvx512Bf16),
                    py::arg("amx_bf16") = uint32_t(kFeatAmxBf16), py::arg("f16c") = uint32_t(kFeatF16C),
                    py::arg("avx512_fp16") = uint32_t(kFeatAvx512Fp16),
                    py::arg("avx512_vnni") = uint32_t(kFeatAvx512Vnni), py::arg("avx_vnni") = uint32_t(kFeatAvxVnni));
  });

  m.def(
      "rms_norm_bf16",
      [](uintptr_t x, int64_t rows, int64_t n, int64_t ldx, uintptr_t w, float eps, bool f32_scale, uintptr_t y,
         int64_t ldy) {
        py::gil_scoped_release nogil;
        rms_norm_bf16(ptr<const uint16_t>(x), rows, n, ldx, ptr<const uint16_t>(w), eps, f32_scale, ptr<uint16_t>(y),
                      ldy);
      },
      "RMSNorm over rows of bf16 (dense.h)");
  m.def(
      "add_rms_norm_bf16",
      [](uintptr_t x, uintptr_t delta, int64_t rows, int64_t n, uintptr_t w, float eps, bool f32_scale, uintptr_t r,
         uintptr_t y) {
        py::gil_scoped_release nogil;
        add_rms_norm_bf16(ptr<const uint16_t>(x), ptr<const uint16_t>(delta), rows, n, ptr<const uint16_t>(w), eps,
                          f32_scale, ptr<uint16_t>(r), ptr<uint16_t>(y));
      },
      "The residual add and RMSNorm over rows of bf16 (dense.h)");
  m.def(
      "decode_attention_bf16",
      [](Executor* e, uintptr_t q, uintptr_t k, uintptr_t v, int64_t q_ld, int64_t k_ld, int64_t v_ld, int64_t tokens,
         int64_t hq, int64_t hk, int64_t d, uintptr_t q_norm, uintptr_t k_norm, float eps, bool f32_scale,
         uintptr_t cos, uintptr_t sin, int64_t cos_ld, int64_t rotary_dim, uintptr_t kv_slots, uintptr_t k_cache,
         uintptr_t v_cache, uintptr_t page_tables, int64_t page_table_ld, uintptr_t kv_lens, int64_t page_size,
         float scale, uintptr_t out) {
        DecodeAttentionArgs a{ptr<const uint16_t>(q), ptr<const uint16_t>(k), ptr<const uint16_t>(v), q_ld, k_ld, v_ld,
                              tokens, hq, hk, d, ptr<const uint16_t>(q_norm), ptr<const uint16_t>(k_norm), eps,
                              f32_scale, ptr<const uint16_t>(cos), ptr<const uint16_t>(sin), cos_ld, rotary_dim,
                              ptr<const int64_t>(kv_slots), ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache),
                              ptr<const int64_t>(page_tables), page_table_ld, ptr<const int64_t>(kv_lens), page_size,
                              scale, ptr<uint16_t>(out)};
        py::gil_scoped_release nogil;
        return e ? e->decode_attention(a) : decode_attention_bf16(a);
      },
      "q/k norm, RoPE, K/V write and attention of a decode step in bf16 (dense.h), on an executor's pool "
      "(Executor::decode_attention) or, executor None, on the calling thread; returns 0, or 1 for refused sizes");
  m.def(
      "attention_layer_bf16",
      [](Executor& e, uintptr_t x, int64_t hidden, uintptr_t qkv_w, uintptr_t o_w, int64_t tokens, int64_t hq,
         int64_t hk, int64_t d, uintptr_t q_norm, uintptr_t k_norm, float eps, bool f32_scale, uintptr_t cos,
         uintptr_t sin, int64_t cos_ld, int64_t rotary_dim, uintptr_t kv_slots, uintptr_t k_cache, uintptr_t v_cache,
         uintptr_t page_tables, int64_t page_table_ld, uintptr_t kv_lens, int64_t page_size, float scale, uintptr_t y) {
        // q, k, v and out are the executor's own buffers (Executor::attention_layer)
        DecodeAttentionArgs a{nullptr, nullptr, nullptr, 0, 0, 0, tokens, hq, hk, d, ptr<const uint16_t>(q_norm),
                              ptr<const uint16_t>(k_norm), eps, f32_scale, ptr<const uint16_t>(cos),
                              ptr<const uint16_t>(sin), cos_ld, rotary_dim, ptr<const int64_t>(kv_slots),
                              ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), ptr<const int64_t>(page_tables),
                              page_table_ld, ptr<const int64_t>(kv_lens), page_size, scale, nullptr};
        py::gil_scoped_release nogil;
        return e.attention_layer(ptr<const uint16_t>(x), hidden, ptr<const uint16_t>(qkv_w), ptr<const uint16_t>(o_w),
                                 a, ptr<uint16_t>(y));
      },
      "An attention layer of a decode step in bf16: fused q/k/v GEMV, decode attention, o GEMV "
      "(Executor::attention_layer); returns an edgemoe Status code (0 = ok)");

  py::class_<ExpertBanks>(m, "ExpertBanks")
      .def(py::init([](uintptr_t base, int64_t row_bytes, int64_t num_ids, int64_t hidden, int64_t inter, int32_t fmt,
                       int64_t w13_off, int64_t w2_off, int64_t w13_scale_off, int64_t w2_scale_off,
                       int64_t w13_scale2_off, int64_t w2_scale2_off, int64_t b13_off, int64_t b2_off,
                       int32_t block_rows, int32_t block_cols, int32_t compute, int32_t act, float alpha,
                       float limit) {
             return ExpertBanks{ptr<const uint8_t>(base), row_bytes, num_ids, hidden, inter,
                                static_cast<WeightFormat>(fmt), w13_off, w2_off, w13_scale_off, w2_scale_off,
                                w13_scale2_off, w2_scale2_off, b13_off, b2_off, block_rows, block_cols, compute,
                                act, alpha, limit};
           }),
           py::arg("base"), py::arg("row_bytes"), py::arg("num_ids"), py::arg("hidden"), py::arg("inter"),
           py::arg("fmt"), py::arg("w13_off"), py::arg("w2_off"), py::arg("w13_scale_off"), py::arg("w2_scale_off"),
           py::arg("w13_scale2_off"), py::arg("w2_scale2_off"), py::arg("b13_off"), py::arg("b2_off"),
           py::arg("block_rows"), py::arg("block_cols"), py::arg("compute"), py::arg("act"), py::arg("alpha"),
           py::arg("limit"),
           "The host expert pool's byte bank as the executor reads it (executor.h, ExpertBanks)")
      .def_readonly("row_bytes", &ExpertBanks::row_bytes)
      .def_readonly("num_ids", &ExpertBanks::num_ids)
      .def_property_readonly("fmt", [](const ExpertBanks& b) { return static_cast<int32_t>(b.fmt); })
      .def(
          "matrix",
          [](const ExpertBanks& b, int64_t fid, int32_t proj) {
            const WeightView w = expert_matrix(b, fid, static_cast<Proj>(proj));
            return py::dict(py::arg("data") = reinterpret_cast<uintptr_t>(w.data),
                            py::arg("row_stride_bytes") = w.row_stride_bytes,
                            py::arg("scales") = reinterpret_cast<uintptr_t>(w.scales),
                            py::arg("scale_row_stride_bytes") = w.scale_row_stride_bytes,
                            py::arg("scale_rows") = w.scale_rows, py::arg("scale_cols") = w.scale_cols,
                            py::arg("global_scale") = w.global_scale);
          },
          py::arg("fid"), py::arg("proj"),
          "The WeightView of projection proj (0 gate, 1 up, 2 down) of expert fid, as a dict of addresses");

  py::class_<Executor>(m, "Executor")
      .def(py::init<int, const std::vector<int>&, int, int, int64_t, int64_t>(), py::arg("threads"), py::arg("cpus"),
           py::arg("isa_cap"), py::arg("spin_us"), py::arg("min_parallel_bytes"), py::arg("min_chunk_bytes"))
      .def_property_readonly("threads", &Executor::threads)
      .def_property_readonly("pinned", &Executor::pinned)
      .def_property_readonly("caller_cpu", &Executor::caller_cpu)
      .def_property_readonly("preempted_waits", &Executor::preempted_waits)
      .def("trace_calls", &Executor::trace_calls, py::arg("capacity"),
           "Record the next `capacity` run() calls (0: stop); see Executor::trace_calls")
      .def("traced", &Executor::traced, "The recorded calls, trace_stride values each (ns of the steady clock)")
      .def_property_readonly("trace_stride", &Executor::trace_stride)
      .def(
          "isa_for",
          [](const Executor& e, int fmt, bool bf16_compute) { return e.isa_for(static_cast<WeightFormat>(fmt), bf16_compute); },
          py::arg("fmt"), py::arg("bf16_compute") = true)
      .def_property_readonly("address", [](Executor& e) { return reinterpret_cast<uintptr_t>(&e); })
      .def(
          "run",
          [](Executor& e, const ExpertBanks& b, uintptr_t x, int32_t x_fmt, int64_t T, uintptr_t out,
             const std::vector<int64_t>& fids, const std::vector<int64_t>& offsets, uintptr_t tok, uintptr_t wt) {
            if (offsets.size() != fids.size() + 1) return static_cast<int32_t>(kBadOffsets);
            const StepArgs s{ptr<const void>(x), x_fmt, T, ptr<float>(out), static_cast<int64_t>(fids.size()),
                             fids.data(), offsets.data(), ptr<const int64_t>(tok), ptr<const float>(wt), 0};
            py::gil_scoped_release nogil;  // the whole step runs without the GIL
            return e.run(b, s);
          },
          "One step; returns an edgemoe Status code (0 = ok)")
      .def(
          "linear",
          [](Executor& e, uintptr_t w, int32_t fmt, int64_t N, int64_t K, int64_t w_stride, uintptr_t x, int32_t x_fmt,
             int64_t M, int64_t ldx, uintptr_t y, int32_t y_fmt, int64_t ldy) {
            py::gil_scoped_release nogil;
            return e.linear(ptr<const void>(w), static_cast<WeightFormat>(fmt), N, K, w_stride, ptr<const void>(x),
                            x_fmt, M, ldx, ptr<void>(y), y_fmt, ldy);
          },
          "Dense rows y[M, N] = x[M, K] @ W[N, K]^T on the pool; returns an edgemoe Status code (0 = ok)")
      .def(
          "moe_decode",
          [](Executor& e, const ExpertBanks& b, uintptr_t x, int64_t T, uintptr_t router, int64_t E, int64_t top_k,
             bool norm_topk, int64_t id_base, uintptr_t residual, uintptr_t out, uintptr_t ids, uintptr_t weights,
             uintptr_t route_weights) {
            const Executor::MoeDecodeArgs a{ptr<const uint16_t>(x), T, ptr<const uint16_t>(router), E, top_k,
                                            norm_topk, id_base, ptr<const uint16_t>(residual), ptr<uint16_t>(out),
                                            ptr<int64_t>(ids), ptr<uint16_t>(weights), ptr<const float>(route_weights)};
            int64_t n = 0;
            int32_t st;
            {
              py::gil_scoped_release nogil;
              st = e.moe_decode(b, a, &n);
            }
            return py::make_tuple(st, n);
          },
          "One MoE layer of a CPU decode step (router, softmax top-k or given routes, experts, residual; "
          "Executor::moe_decode); returns (Status, distinct experts run)")
      .def(
          "sum_f32",
          [](Executor& e, uintptr_t p, int64_t n) {
            py::gil_scoped_release nogil;
            return e.sum_f32(ptr<const float>(p), n);
          },
          "Parallel sum of n float32 at address p (read-bandwidth test)");

  m.def("step_create", &step_create, "Allocate an edgemoe_step over registered buffers; returns its address");
  m.def(
      "step_bench",
      [](uintptr_t sp, uintptr_t order, int64_t n_order, int64_t tokens, int64_t experts_per_call,
         double seconds) -> py::tuple {
        // B_H the way the decode path calls the executor (no Python per call): run the registered step
        // over experts order[i .. i + experts_per_call) (rotating), each applied to tokens 0..tokens-1
        // with weight 1/8, until `seconds` elapse. Returns (calls, elapsed seconds, status).
        auto* st = ptr<edgemoe_step>(sp);
        const int64_t E = experts_per_call, T = tokens;
        if (const int32_t bad = bench_shape(st, E, T, n_order); bad != kOk) return py::make_tuple(int64_t{0}, 0.0, bad);
        const auto* ord = ptr<const int64_t>(order);
        write_bench_routes(st, E, T);
        int64_t calls = 0, i = 0;
        double dt = 0.0;
        {
          py::gil_scoped_release nogil;
          const auto t0 = std::chrono::steady_clock::now();
          do {
            write_bench_experts(st, E, ord, n_order, i);
            edgemoe_run_step(st);
            ++calls;
            dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          } while (st->status == kOk && dt < seconds);
        }
        return py::make_tuple(calls, dt, st->status);
      },
      "Run a registered step over rotating experts for `seconds` (B_H measurement); (calls, seconds, status)");
  m.def(
      "server_bench",
      [](uintptr_t sp, uintptr_t request, uintptr_t done, uintptr_t order, int64_t n_order, int64_t tokens,
         int64_t experts_per_call, double seconds, int64_t gap_us, int64_t poll_us) -> py::tuple {
        // The device decode step's CPU side without a GPU: this thread stands in for the device. Per
        // call it writes the registered step's work (as the decode graph's copies do), advances the
        // request word (as the ring kernel does), polls the done word every poll_us (the wait kernel
        // polls from the GPU, using no CPU core; 0: spin), then idles gap_us (the GPU's own work
        // between two MoE layers). The step runs on the StepServer serving it. Returns (calls,
        // elapsed seconds, status of the last step).
        auto* st = ptr<edgemoe_step>(sp);
        const int64_t E = experts_per_call, T = tokens;
        if (const int32_t bad = bench_shape(st, E, T, n_order); bad != kOk) return py::make_tuple(int64_t{0}, 0.0, bad);
        const auto* ord = ptr<const int64_t>(order);
        auto* req = ptr<int64_t>(request);
        const auto* fin = ptr<const int64_t>(done);
        int64_t calls = 0, i = 0;
        double dt = 0.0;
        {
          py::gil_scoped_release nogil;
#if defined(__linux__)
          prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
          int64_t n = __atomic_load_n(req, __ATOMIC_ACQUIRE);
          const auto t0 = std::chrono::steady_clock::now();
          do {
            write_bench_routes(st, E, T);
            write_bench_experts(st, E, ord, n_order, i);
            __atomic_store_n(req, ++n, __ATOMIC_RELEASE);
            while (__atomic_load_n(fin, __ATOMIC_ACQUIRE) < n) {
              if (poll_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(poll_us));
            }
            ++calls;
            if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
            dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          } while (st->status == kOk && dt < seconds);
        }
        return py::make_tuple(calls, dt, st->status);
      },
      "Ring a served registered step over rotating experts for `seconds` (the device side emulated); "
      "(calls, seconds, status)");
  m.def("step_destroy", [](uintptr_t s) { delete ptr<edgemoe_step>(s); });
  m.def("step_status", [](uintptr_t s) { return ptr<edgemoe_step>(s)->status; });
  m.def("step_calls", [](uintptr_t s) { return ptr<edgemoe_step>(s)->calls; });
  m.def(
      "server_start",
      [](uintptr_t step, uintptr_t request, uintptr_t done, int active_spin_us, int cpu, uintptr_t release,
         uintptr_t gave_up, int64_t watchdog_ms) {
        return reinterpret_cast<uintptr_t>(new StepServer(ptr<edgemoe_step>(step), ptr<int64_t>(request),
                                                          ptr<int64_t>(done), active_spin_us, cpu,
                                                          ptr<uint32_t>(release), ptr<int64_t>(gave_up), watchdog_ms));
      },
      "Start a thread serving a registered step on a doorbell (request/done int64 words; release: 0, or the "
      "uint32 word posted after done, with gave_up and a watchdog of watchdog_ms); returns its handle");
  m.def(
      "server_stop",
      [](uintptr_t s) {
        py::gil_scoped_release nogil;  // joins the thread, which may be finishing a step
        delete ptr<StepServer>(s);
      },
      "Stop and join a step server");
  m.def("server_served", [](uintptr_t s) { return ptr<StepServer>(s)->served(); });
  m.def("server_failed", [](uintptr_t s) { return ptr<StepServer>(s)->failed(); });
  m.def("server_preempted", [](uintptr_t s) { return ptr<StepServer>(s)->preempted(); });
  m.def("server_pinned", [](uintptr_t s) { return ptr<StepServer>(s)->pinned(); });
  m.def("run_step_address", [] { return reinterpret_cast<uintptr_t>(&edgemoe_run_step); },
        "Address of the C entry point void edgemoe_run_step(void* step) (cudaLaunchHostFunc-compatible)");
}

"""The laptop case: Qwen3.6-35B-A3B geometry with 4-bit (NVFP4) experts served from an 8 GB GPU budget.

Serves the model through edgemoe's HTTP server (the app and uvicorn server that ``edgemoe serve`` runs, in a
child process of this script, dummy weights) and measures it from this process over the OpenAI API
(``POST /v1/completions``, streamed):

- **TTFT** (seconds, request sent to first streamed token) of an 8192-token prompt: the first request
  after the expert cache is set to its final size (cold expert cache), then a second, different 8192-token
  prompt (nothing shared, so the prefix cache cannot help).
- **Decode tokens/s** at batch 1 after each prompt: ``--decode-tokens`` (64) tokens timed after
  ``--decode-warmup`` (8) untimed ones (the first decode step after a resize captures its CUDA graph), from
  the client's arrival times; the expert cache's decode hit rate, fills and CPU experts per token over the
  request (``GET /admin/expert-cache`` before and after).
- **Memory**: GPU peak over the measured requests (bytes; ``torch.cuda.max_memory_reserved`` plus the
  memory the process holds outside torch's allocator — CUDA context, kernel modules — and, with
  ``nvidia-ml-py``, the peak NVML reports, sampled every 20 ms), host RSS (current and peak) and the
  pinned host expert pool (checked to be under 24 GB).
- **B_P / B_H** the engine measured at start-up (its bandwidth profile: isolated and concurrent pairs,
  GB/s = 1e9 bytes/s) and the **bytes bound** of decode::

      t_token ~= t_resident + M * r / (B_P + B_H)

  ``M``: expert misses per token (measured), ``r``: bytes of one packed expert row, ``t_resident``: the
  all-resident decode time per token (measured here with every expert cached, the cap lifted). With the
  q* split (``q = M * B_P / (B_P + B_H)`` misses copied over PCIe, the rest computed by the CPU from host
  memory) both branches finish together, which is this bound; the bound of the split the policy really
  made, ``t_resident + max(F * r / B_P, C * r / B_H)`` (``F`` fills, ``C`` CPU experts per token), is
  reported beside it. The laptop prediction keeps ``M``, ``r`` and our ``B_H`` (concurrent and
  isolated: a slower link contends less for DRAM) with ``B_P = --laptop-pcie-gbps`` (11.8: PCIe x8), and
  ``t_resident`` at least the time to read the bytes a decode step reads from GPU memory (non-expert
  weights on the GPU but the embedding, KV and recurrent state, the experts computed on the GPU) at
  ``--laptop-vram-gbps`` (256: an RTX 4060 Laptop GPU's GDDR6).

The GPU budget ``--gpu-gb`` (8; GB = 1e9 bytes: an "8 GB" laptop GPU has 8 GiB, part of it taken by the
display) covers everything the process holds on the GPU: non-expert weights (the token embedding only with
``--token-embedding device``), KV cache, recurrent state and its checkpoints, CUDA graphs and workspaces,
activations, the CUDA context, and the expert cache, which gets what is left. The engine's own ``gpu_budget``
covers only the expert and KV caches, so the expert cache is sized by calibration: the server starts with an
expert cache of two MoE layers (what a streamed prefill needs) and no cap, serves one untimed 8192-token request
(Triton compiles its kernels, decode captures its CUDA graph: its TTFT is reported as the process's first
request); then

    expert slots = (budget - memory outside torch - (torch's peak reserved - calibration cache) - margin) / r

(torch's peak over the calibration request, from the end of loading on: what serving needs besides the expert
cache; loading's own peak, dummy weights' temporaries included, is reported beside it.)

``torch.cuda.set_per_process_memory_fraction`` caps torch's allocator at ``budget - non-torch memory``,
and ``POST /admin/memory`` (the server's own API) fixes the engine's budget at exactly the expert cache
plus the KV cache (a fixed budget: nothing grows). An out-of-memory step during the measurements would
show in the engine's resize counts (``resizes``), which the output reports. Without ``nvidia-ml-py`` the
memory outside torch's allocator is the device's used memory (``torch.cuda.mem_get_info``) less torch's
reserved memory, which counts other processes' memory too (the GPU host runs nothing else).

Benchmark-side changes to the served model (their tables, ~17 MB on the GPU, count against the budget):
routing is uniform by default (``--routing uniform``: each token draws top-k distinct experts per layer, no
locality; a random-weight router sends every token to nearly the same experts, which would flatter any
cache), and sampling is restricted to the tokenizer's single-character tokens (a bias added to the logits),
so every token streams as one character (the dummy model has 248k token ids, its built-in tokenizer 1024: most ids
decode to nothing and would stream no event). Other engine options are a one-user laptop's: one sequence
(``--max-num-seqs 1``), ``--max-model-len`` 16384, 4 recurrent-state checkpoints (the engine default 32
would hold 2 GB of this GPU), prefill in chunks of 2048 tokens (an 8192-token chunk's activations
leave no room for an expert cache in 8 GB), the engine's default expert policy, and on CUDA the token embedding
in page-locked host memory (``--token-embedding auto``: the engine's ``token_embedding host`` for a model whose LM
head is not tied to the embedding, as Qwen3.6-35B-A3B's: the 1.02 GB of GPU memory its 248320 x 2048 bf16 table
would hold go to the expert cache, and each step gathers its rows over PCIe; ``device`` keeps the table in GPU
memory, the engine's default).

Writes ``laptop.json`` and ``laptop.md`` (date, machine, command, tables) under ``--out``, and the server's
log to ``laptop-server.log``. Expected 2-4 minutes on the GPU host (``scripts/gpu_check.sh laptop`` allows 8).

    python benchmarks/laptop.py --out results/laptop                     # GPU host: the laptop case
    python benchmarks/laptop.py --preset qwen3.5-moe-tiny --device cpu --dtype float32 --cpu-executor torch \\
        --prompt-tokens 128 --decode-tokens 8 --decode-warmup 2 --max-model-len 512 --out /tmp/laptop  # CPU smoke
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9
HOST = "127.0.0.1"
HOST_POOL_LIMIT_GB = 24.0  # the laptop's host memory for the expert pool
PAPER_TOKENS_PER_S = 39.3  # FreeToken's figure for this case (RTX 4060 Laptop, PCIe x8)


# ----------------------------------------------------------------------------------------------- options

def parse_args(argv=None) -> argparse.Namespace:
    from edgemoe.synth import QUANT_LAYOUTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint or config-only directory (default: write --preset's config)")
    ap.add_argument("--arch", default="qwen3_5_moe", help="architecture of --preset (a make-model --arch)")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--layers", type=int, help="num_hidden_layers of --preset's config (its first layers; a check of "
                    "the full-width geometry on a machine without the host memory for all 40)")
    ap.add_argument("--quant", default="nvfp4-modelopt", choices=[*QUANT_LAYOUTS, "none"],
                    help="routed experts' released format (dummy rows of it); none: the dtype's")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gpu-gb", type=float, default=8.0,
                    help="GPU budget in GB (1e9 bytes) for everything the server process holds on the GPU")
    ap.add_argument("--margin-gb", type=float, default=0.1,
                    help="part of the budget left unplanned (allocator fragmentation, late kernel modules)")
    ap.add_argument("--cpu-threads", type=int, default=6, help="CPU expert executor threads")
    ap.add_argument("--cpu-executor", default="auto", choices=["auto", "native", "torch"])
    ap.add_argument("--policy", help="expert policy (default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--state-checkpoints", type=int, default=4, help="recurrent-state checkpoint slots (GPU)")
    ap.add_argument("--prefill-chunk-tokens", type=int, default=2048,
                    help="prompt tokens per prefill step (2048: on the GPU host the engine's default, 8192, peaked at "
                    "7.39 GB of torch memory besides the expert cache, leaving no expert cache in 8 GB; 2048 "
                    "peaked at 6.19 GB)")
    ap.add_argument("--token-embedding", default="auto", choices=["auto", "device", "host"],
                    help="where the token-embedding table lives (the engine's token_embedding); auto: host on CUDA for "
                    "a model whose LM head is not tied to the embedding (the laptop case), else device")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode tokens timed per request")
    ap.add_argument("--decode-warmup", type=int, default=8, help="decode tokens before the timed ones")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "model"],
                    help="uniform: top-k distinct experts drawn per token and layer; model: the dummy router's")
    ap.add_argument("--cpu-cache-slots", type=int,
                    help="expert-cache slots on a CPU device (no GPU budget there; default: a quarter of the experts)")
    ap.add_argument("--no-resident", action="store_true", help="skip the all-resident reference (t_resident)")
    ap.add_argument("--bandwidth-pcie-gbps", type=float, help="B_P override (skips the start-up measurement "
                    "with --bandwidth-cpu-gbps)")
    ap.add_argument("--bandwidth-cpu-gbps", type=float, help="B_H override")
    ap.add_argument("--laptop-pcie-gbps", type=float, default=11.8, help="the laptop's B_P (PCIe x8)")
    ap.add_argument("--laptop-vram-gbps", type=float, default=256.0,
                    help="the laptop GPU's memory bandwidth (RTX 4060 Laptop: 128-bit GDDR6 at 16 Gbps)")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for the server to load")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--port", type=int, default=0, help="server port (0: a free one)")
    ap.add_argument("--out", default=".", help="folder for laptop.json, laptop.md and laptop-server.log")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server child
    ap.add_argument("--calibration-slots", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def model_dir(a: argparse.Namespace) -> str:
    """``--model``, or a temporary config-only directory of ``--arch``'s ``--preset`` with ``--quant`` experts."""
    if a.model is not None:
        return a.model
    from edgemoe.synth import PRESETS, write_config_only

    quant = None if a.quant == "none" else a.quant
    overrides = None
    if a.layers is not None:
        overrides = {"num_hidden_layers": a.layers}
        types = PRESETS[a.arch][a.preset].get("layer_types")
        if types:
            overrides["layer_types"] = list(types[:a.layers])
    return str(write_config_only(tempfile.mkdtemp(prefix="edgemoe-laptop-"), a.arch, a.preset, quant=quant,
                                 overrides=overrides))


# ----------------------------------------------------------------------------------------------- server child

def _proc_status() -> dict:
    """Host memory of this process (bytes): ``rss`` and its peak ``hwm`` (Linux ``/proc/self/status``)."""
    out = {"rss": None, "hwm": None}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out["rss" if key == "VmRSS" else "hwm"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class GpuMeter:
    """GPU memory this process holds, from NVML when ``nvidia-ml-py`` is there (measured against the device's
    used memory before CUDA was initialized, and NVML's per-process figure when it lists this process),
    else from ``torch.cuda.mem_get_info`` (used memory of the whole device). A thread samples it every
    ``period_s`` and keeps the peak since :meth:`reset_peak`."""

    def __init__(self, period_s: float = 0.02):
        self.nvml = None
        self.handle = None
        self.baseline = 0
        self.source = "torch.cuda.mem_get_info (whole device)"
        try:
            import pynvml

            pynvml.nvmlInit()
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
            self.handle = (pynvml.nvmlDeviceGetHandleByIndex(int(vis)) if vis.isdigit()
                           else pynvml.nvmlDeviceGetHandleByUUID(vis))
            self.baseline = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self.nvml = pynvml
            self.source = "NVML (device used memory minus its value before CUDA started)"
        except Exception as exc:  # no NVML: the CUDA runtime's view
            self.nvml_error = f"{type(exc).__name__}: {exc}"
        self.peak = 0
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def used(self) -> int:
        """Bytes of GPU memory this process holds (see the class doc for the source)."""
        if self.nvml is not None:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used) - self.baseline
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)

    def process_used(self) -> int | None:
        """NVML's per-process figure for this process (``None`` when NVML does not list it, e.g. in a
        container with its own process ids)."""
        if self.nvml is None:
            return None
        try:
            for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                if p.pid == os.getpid() and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
        except Exception:
            return None
        return None

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.period_s):
                try:
                    self.peak = max(self.peak, self.used())
                except Exception:
                    return

        self._thread = threading.Thread(target=loop, name="laptop-gpu-meter", daemon=True)
        self._thread.start()

    def reset_peak(self) -> None:
        self.peak = self.used()


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (a benchmark killed by its timeout must not
    leave its server holding the GPU)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve_child(a: argparse.Namespace) -> int:
    """The server: edgemoe's app on uvicorn (as ``edgemoe serve`` runs it) with the benchmark's hooks and
    three ``/bench/`` routes (memory snapshot, torch allocator cap, peak reset)."""
    import logging

    _die_with_parent()

    import edgemoe  # noqa: F401 - before torch: OMP_WAIT_POLICY

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    import torch
    import uvicorn

    import edgemoe.experts.bandwidth as bandwidth
    from edgemoe.config import EngineConfig
    from edgemoe.engine.async_engine import AsyncLLM
    from edgemoe.models import load_config
    from edgemoe.server.app import build_app
    from edgemoe.server.config import ServerConfig
    from edgemoe.server.transport import uvicorn_config

    tied = load_config(a.model).tie_word_embeddings
    embedding = token_embedding(a.token_embedding, EngineConfig(device=a.device).resolved_device().type, tied)
    cfg = EngineConfig.from_kwargs(
        device=a.device, dtype=a.dtype, load_format="dummy", expert_cache_slots=a.calibration_slots,
        token_embedding=embedding,
        expert_policy=a.policy, cpu_threads=a.cpu_threads, cpu_executor=a.cpu_executor,
        max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, state_checkpoints=a.state_checkpoints,
        prefill_chunk_tokens=a.prefill_chunk_tokens,
        bandwidth_pcie_gbps=a.bandwidth_pcie_gbps, bandwidth_cpu_gbps=a.bandwidth_cpu_gbps)
    dev = cfg.resolved_device()
    cuda = dev.type == "cuda"
    meter = GpuMeter() if cuda else None  # its baseline before this process touches CUDA
    if cuda and dev.index is None:  # torch's memory-fraction call wants an index
        dev = torch.device("cuda", torch.cuda.current_device())
    info: dict = {"cap_bytes": None, "context_bytes": None, "profiles": [], "pid": os.getpid()}
    if cuda:
        torch.zeros(1, device=dev)  # the CUDA context, before anything else
        torch.cuda.synchronize(dev)
        info["context_bytes"] = meter.used()
        info["device_total_bytes"] = torch.cuda.mem_get_info(dev)[1]
        info["gpu_name"] = torch.cuda.get_device_name(dev)
        meter.start()

    measure = bandwidth.measure

    def recorded_measure(*args, **kw):  # the engine's start-up bandwidth profile, kept for the report
        prof = measure(*args, **kw)
        info["profiles"].append(prof)
        return prof

    bandwidth.measure = recorded_measure

    def torch_mem() -> dict | None:
        if not cuda:
            return None
        return {"reserved": torch.cuda.memory_reserved(dev), "max_reserved": torch.cuda.max_memory_reserved(dev),
                "allocated": torch.cuda.memory_allocated(dev), "max_allocated": torch.cuda.max_memory_allocated(dev)}

    def gpu_mem() -> dict | None:
        if not cuda:
            return None
        used = meter.used()
        return {"used": used, "process_nvml": meter.process_used(), "peak_sampled": max(meter.peak, used),
                "source": meter.source}

    def on_ready(engine) -> None:
        runner = engine.runner
        info["load"] = {"torch": torch_mem(), "gpu": gpu_mem(), "host": _proc_status(),
                        "load_seconds": runner.load_seconds}
        if a.routing == "uniform":
            from decode import route_uniformly

            route_uniformly(runner, seed=1)
        # sampling restricted to single-character tokens: each token streams as one character
        tok = runner.tokenizer
        ids = []
        for i in range(min(len(tok), runner.model_config.vocab_size)):
            s = tok.decode([i], skip_special_tokens=True)
            if len(s) == 1 and s.isascii() and s.isprintable() and not s.isspace():
                ids.append(i)
        bias = torch.full((runner.model_config.vocab_size,), float("-inf"), device=dev)
        bias[torch.tensor(ids, device=dev)] = 0.0
        info["output_tokens"] = len(ids)
        execute = runner.execute

        def execute_single_chars(inputs, phase):
            return execute(inputs, phase) + bias

        runner.execute = execute_single_chars
        if cuda:  # blocks cached by loading (dummy weights' temporaries) go back; serving's peak starts here
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
            meter.reset_peak()
        print(runner.summary(), flush=True)

    def snapshot(engine) -> dict:
        r = engine.runner
        cfgm = r.model_config
        bw = r.experts.bandwidths
        ck = r.prefix.checkpoints
        return {
            **{k: v for k, v in info.items() if k != "profiles"},
            "profile": info["profiles"][-1] if info["profiles"] else None,  # the one used (a retry replaces one)
            "torch": torch_mem(), "gpu": gpu_mem(), "host": _proc_status(),
            "device": str(dev), "summary": r.summary(),
            "pool_bytes": r.pool.nbytes, "pinned": r.pinned, "row_bytes": r.pool.row_bytes,
            "pool_format": r.pool.format.value, "experts_total": r.pool.num_ids,
            "moe_layers": cfgm.num_moe_layers, "num_experts": cfgm.num_experts, "top_k": cfgm.top_k,
            "slots": r.experts.cache.num_slots, "policy": r.experts.policy.name,
            "kv_bytes": r.kv.nbytes, "kv_bytes_per_token": r.kv.bytes_per_token, "kv_tokens": r.kv.capacity_tokens,
            "state_bytes": 0 if r.state is None else r.state.nbytes,
            "state_bytes_per_seq": 0 if r.state is None else r.state.nbytes // r.state.num_slots,
            "checkpoint_bytes": 0 if ck is None else ck.nbytes,
            **weight_figures(r.model), "token_embedding": r.engine_config.token_embedding,
            "prefill_streams": r.experts.hybrid.prefill.can_stream(a.prompt_tokens * cfgm.top_k),
            "decode_path": r.experts.decode_path.value, "cpu_executor": r.experts.cpu_executor.name,
            "graphs": None if r.graphs is None else {"captured": sorted(r.graphs.captured_sizes()),
                                                     "failed": sorted(r.graphs.failed)},
            "cpu_threads": r.experts.cpu_executor.threads,
            "bandwidths": {"b_p_gbps": bw.pcie, "b_h_gbps": bw.cpu, "source": bw.source,
                           "fill_fixed_s": bw.fill_fixed_s, "cpu_fixed_s": bw.cpu_fixed_s},
            "memory": r.memory.stats(history=False),
        }

    server_config = ServerConfig(host=HOST, port=a.port, log_level="warning")
    server: uvicorn.Server | None = None

    def stop_serving(_exc: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    llm = AsyncLLM(a.model, cfg, on_ready=on_ready, on_load_error=stop_serving, start=False, progress=False)
    app = build_app(llm, server_config)

    @app.get("/bench/stats")
    def bench_stats():
        return llm.call_in_engine_thread(snapshot, 120)

    @app.post("/bench/cap")
    def bench_cap(gpu_bytes: float = 0.0):
        """Cap torch's allocator at ``gpu_bytes`` (0: no cap) and reset the peaks."""
        def apply(_engine):
            if cuda:
                total = torch.cuda.mem_get_info(dev)[1]
                frac = 1.0 if gpu_bytes <= 0 else min(1.0, gpu_bytes / total)
                torch.cuda.set_per_process_memory_fraction(frac, dev)
                info["cap_bytes"] = None if gpu_bytes <= 0 else int(gpu_bytes)
                info["cap_fraction"] = frac
            return {"cap_bytes": info["cap_bytes"]}

        return llm.call_in_engine_thread(apply, 120)

    @app.post("/bench/reset-peak")
    def bench_reset_peak():
        def reset(_engine):
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()  # free blocks cached before (e.g. the calibration's graphs) go back
                torch.cuda.reset_peak_memory_stats(dev)
                meter.reset_peak()
            return {"ok": True}

        return llm.call_in_engine_thread(reset, 120)

    server = uvicorn.Server(uvicorn_config(app, server_config))
    llm.start()
    try:
        server.run()
    except KeyboardInterrupt:  # SIGINT from the benchmark: uvicorn stopped gracefully, then re-raised it
        pass
    finally:
        llm.shutdown()
    if llm.load_error is not None:
        print(f"laptop server: model failed to load: {llm.load_error}", file=sys.stderr, flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------- client

class Client:
    """JSON and streamed completions against the server (standard library only)."""

    def __init__(self, port: int, timeout: float):
        self.port, self.timeout = port, timeout

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout or self.timeout)
        try:
            conn.request(method, path, None if body is None else json.dumps(body),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {data[:600].decode(errors='replace')}")
            return json.loads(data)
        finally:
            conn.close()

    def health(self) -> bool:
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion of ``prompt`` (token ids), ``max_tokens`` tokens (EOS ignored).

        Returns ``t_send`` and ``events`` (arrival time, characters = tokens) and the ``usage`` block.
        """
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "seed": 0,
                "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
        events: list[tuple[float, int]] = []
        usage = None
        try:
            t_send = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"completion: HTTP {resp.status}: {resp.read()[:600].decode(errors='replace')}")
            for raw in resp:
                t = time.perf_counter()
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    raise RuntimeError(f"completion failed: {obj['error']}")
                if obj.get("usage"):
                    usage = obj["usage"]
                n = sum(len(c.get("text") or "") for c in obj.get("choices") or [])
                if n:
                    events.append((t, n))
        finally:
            conn.close()
        return {"t_send": t_send, "events": events, "usage": usage}


def timing(res: dict, warmup: int) -> dict:
    """TTFT and decode tokens/s of one streamed completion (each streamed character is one token)."""
    ev, t0 = res["events"], res["t_send"]
    if not ev:
        raise RuntimeError("the completion streamed no tokens")
    tokens = sum(n for _, n in ev)
    usage = res["usage"] or {}
    out = {"ttft_s": ev[0][0] - t0, "tokens": tokens, "completion_tokens": usage.get("completion_tokens"),
           "prompt_tokens": usage.get("prompt_tokens"),
           "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
           "events": len(ev), "total_s": ev[-1][0] - t0}
    first_t, first_n = ev[0]
    if tokens > first_n:
        out["decode_tokens_per_s_all"] = (tokens - first_n) / (ev[-1][0] - first_t)
    seen, start = 0, None
    for t, n in ev:  # the window starts at the event that completes token 1 + warmup
        seen += n
        if start is None and seen >= 1 + warmup:
            start = (t, seen)
    if start is not None and tokens > start[1]:
        out["decode_tokens_timed"] = tokens - start[1]
        out["decode_tokens_per_s"] = (tokens - start[1]) / (ev[-1][0] - start[0])
        out["decode_ms_per_token"] = 1e3 / out["decode_tokens_per_s"]
    return out


def counters_delta(before: dict, after: dict, steps: int) -> dict:
    """Decode hit rate, fills / CPU experts / misses per decode step between two expert-cache reads."""
    d = {k: after["decode"][k] - before["decode"][k] for k in ("hits", "misses", "fills", "cpu")}
    p = {k: after["prefill"][k] - before["prefill"][k] for k in ("hits", "misses", "fills", "cpu")}
    uses = d["hits"] + d["misses"]
    return {"decode": d, "prefill": p, "decode_steps": steps,
            "hit_rate": d["hits"] / uses if uses else None,
            "misses_per_token": d["misses"] / steps if steps else None,
            "fills_per_token": d["fills"] / steps if steps else None,
            "cpu_per_token": d["cpu"] / steps if steps else None}


# ----------------------------------------------------------------------------------------------- the run

def token_embedding(choice: str, device_type: str, tied: bool) -> str:
    """``--token-embedding`` resolved into the engine's ``token_embedding``: ``auto`` is ``host`` on CUDA for a model
    whose LM head is not tied to the embedding (the engine refuses ``host`` otherwise), else ``device``."""
    if choice != "auto":
        return choice
    return "host" if device_type == "cuda" and not tied else "device"


def weight_figures(model) -> dict:
    """The served model's own weights (the routed experts aside), in bytes: ``weights_bytes`` on the GPU (what
    the budget holds besides the caches), ``embed_bytes`` the token embedding's part of them (one row of it is
    read per token, so the bytes bound leaves it out; 0 when the table is in host memory) and
    ``host_embedding_bytes`` the table in host memory (0 when it is on the GPU)."""
    on_device, on_host = model.weight_bytes()
    table = model.decoder.embed_tokens.weight
    return {"weights_bytes": on_device, "embed_bytes": 0 if on_host else table.numel() * table.element_size(),
            "host_embedding_bytes": on_host}


def check_run(st: dict, slots: int, cuda: bool) -> None:
    """Raises ``RuntimeError`` when the served engine left the measured configuration: an out-of-memory step
    under the cap (the engine shrinks its expert cache and retries), an expert cache of another size, or, on
    CUDA, batch size 1 decoding eagerly after a failed CUDA-graph capture."""
    oom = st["memory"].get("resizes", {}).get("out-of-memory", 0)
    if oom:
        raise RuntimeError(f"{oom} out-of-memory step(s) under the GPU budget: the expert cache was shrunk; the "
                           "budget does not fit this configuration (see laptop-server.log)")
    if st["slots"] != slots:
        raise RuntimeError(f"the expert cache has {st['slots']} slots, not the {slots} it was sized to")
    g = st.get("graphs")
    if cuda and g is not None and 1 in g["failed"]:
        raise RuntimeError("capturing the batch-1 decode graph failed under the GPU budget: decode runs eagerly")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    ram = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    import torch

    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(), "ram_bytes": ram,
            "python": platform.python_version(), "torch": torch.__version__}


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def bound(t_res_s: float | None, misses: float, fills: float, cpu: float, row: int, prof: dict | None,
          used: dict, laptop_pcie: float, laptop_vram: float, vram_bytes: float) -> dict:
    """The bytes bound per decode token (see the module doc), ours and the laptop's, in seconds."""
    out: dict = {"row_bytes": row, "misses_per_token": misses, "fills_per_token": fills, "cpu_per_token": cpu,
                 "t_resident_s": t_res_s}
    if prof is not None:
        iso, conc = prof["isolated"], prof["concurrent"]
        bp_i, bh_i, bp_c, bh_c = iso["b_p_gbps"], iso["b_h_gbps"], conc["b_p_gbps"], conc["b_h_gbps"]
    else:  # no start-up profile (given, or read from a saved one): the engine's pair as both; a saved concurrent
        bp_i = bp_c = used["b_p_gbps"]  # pair's B_H is the policy's B_P,c + B_H,c (bandwidths_from_profile): undone
        bh = used["b_h_gbps"]
        if "concurrent pair" in str(used.get("source", "")):
            bh -= bp_i
        bh_i = bh_c = bh
    out.update(b_p_isolated=bp_i, b_h_isolated=bh_i, b_p_concurrent=bp_c, b_h_concurrent=bh_c)
    if not (bp_c and bh_c):
        return out
    both = fills > 0 and cpu > 0
    bp, bh = (bp_c, bh_c) if both else (bp_i, bh_i)
    out["miss_s_as_run"] = max(fills * row / (bp * 1e9), cpu * row / (bh * 1e9))
    out["miss_s_balanced"] = misses * row / ((bp_c + bh_c) * 1e9)
    out["laptop_miss_s"] = {"b_h_concurrent": misses * row / ((laptop_pcie + bh_c) * 1e9),
                            "b_h_isolated": misses * row / ((laptop_pcie + bh_i) * 1e9)}
    out["laptop_vram_s"] = vram_bytes / (laptop_vram * 1e9)
    out["laptop_vram_bytes"] = vram_bytes
    if t_res_s is not None:
        out["bound_s_as_run"] = t_res_s + out["miss_s_as_run"]
        out["bound_s_balanced"] = t_res_s + out["miss_s_balanced"]
        t_lap = max(t_res_s, out["laptop_vram_s"])
        out["laptop_t_resident_s"] = t_lap
        out["laptop_s"] = {k: t_lap + v for k, v in out["laptop_miss_s"].items()}
        out["laptop_tokens_per_s"] = {k: 1 / v for k, v in out["laptop_s"].items()}
    return out


def run(a: argparse.Namespace, argv) -> int:
    t_start = time.perf_counter()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    from edgemoe.models import load_config

    a.generated_model = a.model is None
    a.model = model_dir(a)
    mcfg = load_config(a.model)
    E, L, k = mcfg.num_experts, mcfg.num_moe_layers, mcfg.top_k
    total_experts = E * L
    if a.prompt_tokens + 1 + a.decode_warmup + a.decode_tokens > a.max_model_len:
        raise SystemExit("--max-model-len is shorter than the prompt plus the decode tokens")
    port = a.port or _free_port()
    calib = min(total_experts, 2 * E)  # two MoE layers: a streamed prefill's staging regions
    child_args = [sys.executable, str(Path(__file__).resolve()), "--serve", "--port", str(port),
                  "--calibration-slots", str(calib), "--model", a.model, "--device", a.device, "--dtype", a.dtype,
                  "--cpu-threads", str(a.cpu_threads), "--cpu-executor", a.cpu_executor,
                  "--max-num-seqs", str(a.max_num_seqs), "--max-model-len", str(a.max_model_len),
                  "--state-checkpoints", str(a.state_checkpoints), "--routing", a.routing,
                  "--prompt-tokens", str(a.prompt_tokens), "--token-embedding", a.token_embedding]
    for flag, v in (("--policy", a.policy), ("--prefill-chunk-tokens", a.prefill_chunk_tokens),
                    ("--bandwidth-pcie-gbps", a.bandwidth_pcie_gbps),
                    ("--bandwidth-cpu-gbps", a.bandwidth_cpu_gbps)):
        if v is not None:
            child_args += [flag, str(v)]
    log_path = out_dir / "laptop-server.log"
    say(f"model {a.model} ({mcfg.architecture}, {L} MoE layers x {E} experts, top-{k}); starting the server "
        f"on port {port} (log: {log_path})")
    log = open(log_path, "w")
    old_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: the server stops
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    child = subprocess.Popen(child_args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    client = Client(port, a.request_timeout)
    result: dict = {"meta": {}, "phases": {}}

    def tail() -> str:
        log.flush()
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    try:
        deadline = time.perf_counter() + a.start_timeout
        while not client.health():
            if child.poll() is not None:
                raise RuntimeError(f"the server exited ({child.returncode}) while loading:\n{tail()}")
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the server did not load within {a.start_timeout:.0f} s:\n{tail()}")
            time.sleep(0.5)
        st_load = client.call("GET", "/bench/stats")
        say("server ready:\n" + st_load["summary"])
        cuda = st_load["device"].startswith("cuda")
        row, kv = st_load["row_bytes"], st_load["kv_bytes"]
        pool_gb = st_load["pool_bytes"] / GB
        say(f"host expert pool {pool_gb:.2f} GB ({st_load['pool_format']}, "
            f"{'pinned' if st_load['pinned'] else 'pageable'}): "
            f"{'under' if pool_gb < HOST_POOL_LIMIT_GB else 'NOT under'} {HOST_POOL_LIMIT_GB:.0f} GB")
        vocab = mcfg.vocab_size
        max_tokens = 1 + a.decode_warmup + a.decode_tokens

        # calibration: the process's first request (kernels compile, CUDA graph captured), no cap
        say(f"calibration request: {a.prompt_tokens}-token prompt, {max_tokens} tokens, expert cache {calib} slots "
            "(no cap)")
        res = timing(client.stream(_prompt(1, a.prompt_tokens, vocab), max_tokens), a.decode_warmup)
        result["phases"]["first_request"] = res
        say(f"  first request of the process: TTFT {res['ttft_s']:.3f} s, decode "
            f"{res.get('decode_tokens_per_s', float('nan')):.1f} tokens/s")
        st_cal = client.call("GET", "/bench/stats")
        plan: dict = {"calibration_slots": calib}
        if cuda:
            budget = a.gpu_gb * GB
            gpu_now, reserved_now = st_cal["gpu"]["used"], st_cal["torch"]["reserved"]
            non_torch = max(0, gpu_now - reserved_now)
            peak_reserved = st_cal["torch"]["max_reserved"]  # serving's peak (from the end of loading on)
            others = peak_reserved - calib * row  # torch's peak without the calibration cache
            slots = int((budget - non_torch - others - a.margin_gb * GB) // row)
            slots = max(0, min(total_experts, slots))
            plan.update(budget_bytes=budget, non_torch_bytes=non_torch, torch_peak_reserved_calibration=peak_reserved,
                        torch_peak_without_cache=others, margin_bytes=a.margin_gb * GB, slots=slots,
                        cap_bytes=budget - non_torch)
            say(f"budget {budget / GB:.2f} GB = outside torch {non_torch / GB:.3f} GB (CUDA context, modules) + torch "
                f"peak without the expert cache {others / GB:.3f} GB + margin {a.margin_gb:.2f} GB + expert cache "
                f"{slots} slots x {row / 1e6:.3f} MB = {slots * row / GB:.3f} GB")
            if slots == 0:
                raise RuntimeError(f"nothing of the {a.gpu_gb:g} GB budget is left for an expert cache: serving "
                                   f"besides it peaked at {others / GB:.2f} GB of torch memory (a smaller "
                                   f"--prefill-chunk-tokens than {a.prefill_chunk_tokens} lowers its peak)")
            if slots < 2 * E:
                say(f"warning: {slots} slots hold less than two MoE layers ({2 * E}): prefill cannot stream")
            client.call("POST", f"/bench/cap?gpu_bytes={budget - non_torch:.0f}")
            client.call("POST", "/admin/memory", {"budget_gb": (slots * row + kv + 1000) / GB, "expert_slots": slots})
        else:
            slots = a.cpu_cache_slots if a.cpu_cache_slots is not None else total_experts // 4
            plan["slots"] = slots
            say(f"device {st_load['device']}: no GPU budget; expert cache {slots} slots")
            client.call("POST", "/admin/memory", {"expert_slots": slots})
        result["plan"] = plan
        # one untimed request at the final size and under the cap: the regime the measured requests run in
        # (a cache below two MoE layers prefills without streaming, which calibration did not exercise)
        settle = timing(client.stream(_prompt(5, a.prompt_tokens, vocab), max_tokens), a.decode_warmup)
        result["phases"]["settle"] = settle
        say(f"untimed request at the final size: TTFT {settle['ttft_s']:.3f} s")
        client.call("POST", "/bench/reset-peak")
        st_sized = client.call("GET", "/bench/stats")
        check_run(st_sized, plan["slots"], cuda)
        say(f"expert cache {st_sized['slots']} slots ({100 * st_sized['slots'] / total_experts:.1f}% of experts), "
            f"policy {st_sized['policy']}; the prefill of {a.prompt_tokens} tokens "
            f"{'streams whole layers' if st_sized['prefill_streams'] else 'does NOT stream (cache below two layers)'}")

        for name, seed in (("request_1", 2), ("request_2", 3)):
            before = client.call("GET", "/admin/expert-cache")
            res = timing(client.stream(_prompt(seed, a.prompt_tokens, vocab), max_tokens), a.decode_warmup)
            after = client.call("GET", "/admin/expert-cache")
            res["experts"] = counters_delta(before, after, res["tokens"] - 1)
            result["phases"][name] = res
            check_run(client.call("GET", "/bench/stats"), plan["slots"], cuda)
            hr = res["experts"]["hit_rate"]
            say(f"{name}: TTFT {res['ttft_s']:.3f} s (cached prompt tokens {res['cached_tokens']}), decode "
                f"{res.get('decode_tokens_per_s', float('nan')):.2f} tokens/s over {res.get('decode_tokens_timed')} "
                f"tokens, hit rate {'-' if hr is None else f'{hr:.3f}'}, misses/token "
                f"{res['experts']['misses_per_token']:.1f} (fills {res['experts']['fills_per_token']:.1f}, CPU "
                f"{res['experts']['cpu_per_token']:.1f})")
        st_run = client.call("GET", "/bench/stats")
        result["stats"] = {"load": st_load, "calibration": st_cal, "sized": st_sized, "measured": st_run}

        if not a.no_resident:  # the all-resident reference for t_resident: cap lifted, every expert cached
            client.call("POST", "/bench/cap?gpu_bytes=0")
            body = {"expert_slots": total_experts, "policy": "static"}
            if cuda:
                body["budget_gb"] = (total_experts * row + kv + 1000) / GB
            client.call("POST", "/admin/memory", body)
            res = timing(client.stream(_prompt(4, a.prompt_tokens, vocab), max_tokens), a.decode_warmup)
            result["phases"]["resident"] = res
            say(f"all resident (reference, no cap): TTFT {res['ttft_s']:.3f} s, decode "
                f"{res.get('decode_tokens_per_s', float('nan')):.2f} tokens/s")
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGINT)  # uvicorn's graceful stop
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        log.close()
        signal.signal(signal.SIGTERM, old_sigterm)

    report(a, argv, result, mcfg)
    say(f"wrote {out_dir / 'laptop.json'} and {out_dir / 'laptop.md'}")
    return 0


def report(a: argparse.Namespace, argv, result: dict, mcfg) -> None:
    """Assemble the figures, write ``laptop.json`` and ``laptop.md``, print the markdown."""
    st = result["stats"]
    load, sized, meas = st["load"], st["sized"], st["measured"]
    ph = result["phases"]
    r1, r2 = ph["request_1"], ph["request_2"]
    res = ph.get("resident")
    row = meas["row_bytes"]
    cuda = meas["device"].startswith("cuda")
    # GPU peak over the measured requests: torch's peak reserved + what the process holds outside torch
    gpu = None
    if cuda:
        non_torch = max(0, meas["gpu"]["used"] - meas["torch"]["reserved"])
        gpu = {"budget_bytes": a.gpu_gb * GB, "cap_bytes": meas.get("cap_bytes"),
               "torch_max_reserved": meas["torch"]["max_reserved"],
               "torch_max_allocated": meas["torch"]["max_allocated"],
               "non_torch_bytes": non_torch, "peak_bytes": meas["torch"]["max_reserved"] + non_torch,
               "sampled_peak_bytes": meas["gpu"]["peak_sampled"], "process_nvml_bytes": meas["gpu"]["process_nvml"],
               "context_bytes": meas.get("context_bytes"), "source": meas["gpu"]["source"],
               "load_peak_bytes": load["load"]["torch"]["max_reserved"] + (load["load"]["gpu"]["used"]
                                                                          - load["load"]["torch"]["reserved"])}
        gpu["within_budget"] = max(gpu["peak_bytes"], gpu["sampled_peak_bytes"]) <= gpu["budget_bytes"]
    resizes = meas["memory"].get("resizes", {})
    # bytes bound from request 2 (warm process, cold-then-warming cache as in request 1)
    t_res = None if res is None or "decode_ms_per_token" not in res else res["decode_ms_per_token"] / 1e3
    ctx = a.prompt_tokens + 1 + a.decode_warmup + a.decode_tokens // 2
    bounds = {}
    for name, rq in (("request_1", r1), ("request_2", r2)):
        ex = rq["experts"]
        if ex["misses_per_token"] is None:
            continue
        gpu_experts = mcfg.top_k * mcfg.num_moe_layers - ex["cpu_per_token"]  # experts computed on the GPU
        vram = (meas["weights_bytes"] - meas["embed_bytes"] + meas["kv_bytes_per_token"] * ctx
                + 2 * meas["state_bytes_per_seq"] + gpu_experts * row)
        b = bound(t_res, ex["misses_per_token"], ex["fills_per_token"], ex["cpu_per_token"], row, meas["profile"],
                  meas["bandwidths"], a.laptop_pcie_gbps, a.laptop_vram_gbps, vram)
        if "decode_ms_per_token" in rq:
            b["measured_s"] = rq["decode_ms_per_token"] / 1e3
            if "bound_s_as_run" in b:
                b["bound_over_measured"] = b["bound_s_as_run"] / b["measured_s"]
        bounds[name] = b
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python " + " ".join([f"benchmarks/{Path(__file__).name}",
                                         *(argv if argv is not None else sys.argv[1:])]),
        "machine": {**_machine(), "gpu": meas.get("gpu_name"), "device": meas["device"]},
        "served_through": "edgemoe's HTTP server (the app and uvicorn server of `edgemoe serve`, dummy weights) in a "
                          "child process; streamed POST /v1/completions from this process",
        "model": mcfg.architecture, "preset": a.preset if a.generated_model else a.model,
        "quant": a.quant, "moe_layers": mcfg.num_moe_layers, "experts_per_layer": mcfg.num_experts,
        "top_k": mcfg.top_k, "routing": a.routing, "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens, "decode_warmup": a.decode_warmup, "max_num_seqs": a.max_num_seqs,
        "max_model_len": a.max_model_len, "state_checkpoints": a.state_checkpoints,
        "prefill_chunk_tokens": a.prefill_chunk_tokens, "token_embedding": meas["token_embedding"],
        "gpu_gb": a.gpu_gb, "margin_gb": a.margin_gb, "cpu_threads_asked": a.cpu_threads,
        "laptop_pcie_gbps": a.laptop_pcie_gbps, "laptop_vram_gbps": a.laptop_vram_gbps,
        "paper_tokens_per_s": PAPER_TOKENS_PER_S,
    }
    summary = {
        "host_pool_bytes": meas["pool_bytes"], "host_pool_under_24gb": meas["pool_bytes"] < HOST_POOL_LIMIT_GB * GB,
        "pinned": meas["pinned"], "pool_format": meas["pool_format"], "row_bytes": row,
        "expert_cache_slots": sized["slots"], "expert_cache_bytes": sized["slots"] * row,
        "expert_cache_share": sized["slots"] / meas["experts_total"], "policy": sized["policy"],
        "prefill_streams": sized["prefill_streams"], "decode_path": sized["decode_path"],
        "cpu_executor": sized["cpu_executor"], "cpu_threads": sized["cpu_threads"],
        "weights_bytes": meas["weights_bytes"], "host_embedding_bytes": meas["host_embedding_bytes"],
        "kv_bytes": meas["kv_bytes"], "state_bytes": meas["state_bytes"],
        "checkpoint_bytes": meas["checkpoint_bytes"],
        "ttft_first_request_s": ph["first_request"]["ttft_s"],
        "ttft_8k_cold_s": r1["ttft_s"], "ttft_8k_second_s": r2["ttft_s"],
        "decode_tokens_per_s_1": r1.get("decode_tokens_per_s"), "decode_tokens_per_s_2": r2.get("decode_tokens_per_s"),
        "hit_rate_1": r1["experts"]["hit_rate"], "hit_rate_2": r2["experts"]["hit_rate"],
        "resident_decode_tokens_per_s": None if res is None else res.get("decode_tokens_per_s"),
        "gpu": gpu, "host_rss_bytes": meas["host"]["rss"], "host_peak_rss_bytes": meas["host"]["hwm"],
        "engine_resizes": resizes,
        "bandwidths_engine": meas["bandwidths"], "profile": meas["profile"],
    }
    out = Path(a.out)
    (out / "laptop.json").write_text(json.dumps({"meta": meta, "summary": summary, "bounds": bounds,
                                                 "plan": result["plan"], "phases": result["phases"],
                                                 "stats": st}, indent=2, default=str))
    md = markdown(meta, summary, bounds, result["plan"], meas)
    (out / "laptop.md").write_text(md)
    print(md, flush=True)


def _f(v, fmt: str = ".2f", scale: float = 1.0, none: str = "-") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v * scale, fmt)


def markdown(meta: dict, s: dict, bounds: dict, plan: dict, meas: dict) -> str:
    m = meta["machine"]
    g = s["gpu"]
    embedding = (f"the token embedding in host memory: {_f(s['host_embedding_bytes'], '.3f', 1 / GB)} GB" if
                 s["host_embedding_bytes"] else "the token embedding included")
    lines = [
        f"# Laptop case: {meta['preset']} geometry, {s['pool_format']} experts, {meta['gpu_gb']:g} GB GPU budget, "
        f"{s['cpu_threads']} CPU threads",
        "",
        f"- date: {meta['date']}",
        f"- machine: {m.get('gpu') or m['device']}; {m['cpu']}, {m['cores']} cores, "
        f"{_f(m['ram_bytes'], '.0f', 1 / 2**30)} GiB RAM; torch {m['torch']}, Python {m['python']}",
        f"- command: `{meta['command']}`",
        f"- served through {meta['served_through']}",
        f"- {meta['moe_layers']} MoE layers x {meta['experts_per_layer']} experts, top-{meta['top_k']}, routing "
        f"{meta['routing']}; batch 1 (max {meta['max_num_seqs']} sequence), {meta['state_checkpoints']} state "
        f"checkpoints, max_model_len {meta['max_model_len']}; policy {s['policy']}, CPU executor {s['cpu_executor']} "
        f"x {s['cpu_threads']} threads; decode path {s['decode_path']}; token embedding on the "
        f"{meta['token_embedding']}",
        "",
    ]
    if not s["prefill_streams"]:
        lines += [f"**The expert cache holds fewer than two MoE layers: the {meta['prompt_tokens']}-token prefill does "
                  "not stream whole layers (double buffering); its TTFT is the on-demand path's.**", ""]
    lines += [
        "| what | value |",
        "|---|---|",
        f"| host expert pool | {_f(s['host_pool_bytes'], '.2f', 1 / GB)} GB, "
        f"{'pinned' if s['pinned'] else 'pageable'}, {'under' if s['host_pool_under_24gb'] else '**not** under'} "
        f"{HOST_POOL_LIMIT_GB:.0f} GB ({_f(s['row_bytes'], '.3f', 1e-6)} MB per expert) |",
        f"| expert cache | {s['expert_cache_slots']} slots = {_f(s['expert_cache_bytes'], '.3f', 1 / GB)} GB "
        f"({_f(s['expert_cache_share'], '.1f', 100)}% of the experts); the prefill of {meta['prompt_tokens']} tokens "
        f"{'streams whole layers' if s['prefill_streams'] else 'does not stream (cache < two layers)'} |",
        f"| on the {'GPU' if g is not None else 'device'} besides | non-expert weights "
        f"{_f(s['weights_bytes'], '.3f', 1 / GB)} GB ({embedding}), KV cache "
        f"{_f(s['kv_bytes'], '.3f', 1 / GB)} GB, recurrent state {_f(s['state_bytes'], '.3f', 1 / GB)} GB, "
        f"state checkpoints {_f(s['checkpoint_bytes'], '.3f', 1 / GB)} GB |",
    ]
    if g is not None:
        lines += [
            f"| GPU peak, measured requests | **{_f(g['peak_bytes'], '.3f', 1 / GB)} GB** = torch max reserved "
            f"{_f(g['torch_max_reserved'], '.3f', 1 / GB)} + outside torch {_f(g['non_torch_bytes'], '.3f', 1 / GB)} "
            f"(CUDA context at start {_f(g['context_bytes'], '.3f', 1 / GB)}); sampled peak "
            f"{_f(g['sampled_peak_bytes'], '.3f', 1 / GB)} GB ({g['source']}); NVML per process "
            f"{_f(g['process_nvml_bytes'], '.3f', 1 / GB)} GB; budget {_f(g['budget_bytes'], '.2f', 1 / GB)} GB: "
            f"{'within' if g['within_budget'] else '**exceeded**'} |",
            f"| GPU peak while loading (calibration cache of {plan['calibration_slots']} slots; dummy weights are "
            "drawn in float32 first) | "
            f"{_f(g['load_peak_bytes'], '.3f', 1 / GB)} GB |",
        ]
    lines += [
        f"| host memory of the server | RSS {_f(s['host_rss_bytes'], '.2f', 1 / GB)} GB, peak "
        f"{_f(s['host_peak_rss_bytes'], '.2f', 1 / GB)} GB (the pinned pool included) |",
        f"| TTFT, {meta['prompt_tokens']}-token prompt, first request (cold expert cache) | "
        f"**{_f(s['ttft_8k_cold_s'], '.3f')} s** |",
        f"| TTFT, a second, different {meta['prompt_tokens']}-token prompt | "
        f"**{_f(s['ttft_8k_second_s'], '.3f')} s** |",
        f"| decode, batch 1, after the prompt (request 1 / 2) | **{_f(s['decode_tokens_per_s_1'])} / "
        f"{_f(s['decode_tokens_per_s_2'])} tokens/s** over {meta['decode_tokens']} tokens after "
        f"{meta['decode_warmup']} |",
        f"| decode hit rate (request 1 / 2) | {_f(s['hit_rate_1'], '.3f')} / {_f(s['hit_rate_2'], '.3f')} |",
        f"| the process's first request (Triton compiles, CUDA graph capture; calibration cache, no cap) | TTFT "
        f"{_f(s['ttft_first_request_s'], '.3f')} s |",
        f"| all experts resident (reference, cap lifted) | {_f(s['resident_decode_tokens_per_s'])} tokens/s |",
        f"| engine memory resizes during the run | {s['engine_resizes'] or 'none'} |",
    ]
    bw, prof = s["bandwidths_engine"], s["profile"]
    lines += ["", "## Bandwidths (the engine's start-up measurement)", ""]
    if prof is not None:
        iso, conc = prof["isolated"], prof["concurrent"]
        lines.append(f"- isolated: B_P {iso['b_p_gbps']:.2f} GB/s, B_H {iso['b_h_gbps']:.2f} GB/s; concurrent: B_P "
                     f"{conc['b_p_gbps']:.2f} GB/s, B_H {conc['b_h_gbps']:.2f} GB/s ({prof['cpu_executor']} x "
                     f"{prof['machine']['cpu_threads']} threads, {prof['expert']['format']} rows)")
    lines.append(f"- the policy's pair: B_P {_f(bw['b_p_gbps'])} GB/s, B_H {_f(bw['b_h_gbps'])} GB/s [{bw['source']}]")
    lines += [
        "", "## Bytes bound of decode", "",
        "    t_token = t_resident + M * r / (B_P + B_H)        (q* split: both branches finish together)",
        "    as run:  t_resident + max(F * r / B_P, C * r / B_H)  (concurrent pair when both branches ran)",
        "",
        "M: expert misses per token, F fills, C CPU experts (measured), r: packed expert bytes; t_resident: all "
        "experts cached (measured). Laptop: B_P = "
        f"{meta['laptop_pcie_gbps']:g} GB/s, our B_H (concurrent / isolated), M and r; its t_resident at least "
        f"the bytes a decode step reads from GPU memory at {meta['laptop_vram_gbps']:g} GB/s (non-expert weights "
        "on the GPU but the embedding, KV, recurrent state, the experts computed on the GPU).",
        "",
        "| request | M | F | C | r (MB) | t_resident (ms) | bound as run (ms) | q* bound (ms) | measured (ms) "
        "| bound/measured | laptop t_resident (ms) | laptop miss term (ms), B_H conc. / iso. "
        "| laptop predicted tokens/s, B_H conc. / iso. | paper (tokens/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, b in bounds.items():
        lap = b.get("laptop_tokens_per_s") or {}
        lm = b.get("laptop_miss_s") or {}
        lines.append(
            f"| {name} | {_f(b['misses_per_token'], '.1f')} | {_f(b['fills_per_token'], '.1f')} | "
            f"{_f(b['cpu_per_token'], '.1f')} | {_f(b['row_bytes'], '.3f', 1e-6)} | "
            f"{_f(b.get('t_resident_s'), '.2f', 1e3)} | {_f(b.get('bound_s_as_run'), '.2f', 1e3)} | "
            f"{_f(b.get('bound_s_balanced'), '.2f', 1e3)} | {_f(b.get('measured_s'), '.2f', 1e3)} | "
            f"{_f(b.get('bound_over_measured'))} | {_f(b.get('laptop_t_resident_s'), '.2f', 1e3)} "
            f"(VRAM floor {_f(b.get('laptop_vram_s'), '.2f', 1e3)}) | "
            f"{_f(lm.get('b_h_concurrent'), '.2f', 1e3)} / {_f(lm.get('b_h_isolated'), '.2f', 1e3)} | "
            f"{_f(lap.get('b_h_concurrent'), '.1f')} / {_f(lap.get('b_h_isolated'), '.1f')} | "
            f"{meta['paper_tokens_per_s']:g} |")
    if "budget_bytes" in plan:
        lines += ["", "Expert-cache sizing: budget "
                  f"{plan['budget_bytes'] / GB:.2f} GB - outside torch {plan['non_torch_bytes'] / GB:.3f} GB - "
                  f"torch peak without the expert cache {plan['torch_peak_without_cache'] / GB:.3f} GB - margin "
                  f"{plan['margin_bytes'] / GB:.2f} GB = {plan['slots']} slots; torch's allocator capped at "
                  f"{plan['cap_bytes'] / GB:.3f} GB (set_per_process_memory_fraction), the engine's budget fixed at "
                  "the expert cache + the KV cache (POST /admin/memory)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.serve:
        return serve_child(a)
    return run(a, argv)


if __name__ == "__main__":
    raise SystemExit(main())

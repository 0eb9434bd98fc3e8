"""The model runner: loads a checkpoint, owns the model and its pools, runs steps.

Only the engine's step thread calls into a runner. The runner turns a list of
:class:`~edgemoe.core.StepInput` into a :class:`~edgemoe.core.ForwardBatch` (allocating KV pages and
recurrent-state slots) and returns last-token logits. What it owns, by seam:

- the model (built on the meta device from its architecture's file, weights loaded strictly) and
  the host expert pool, the paged KV pool and (hybrid models) the recurrent-state pool;
- :class:`~edgemoe.engine.expert_runtime.ExpertRuntime` (``self.experts``): expert cache, policy,
  bandwidths, CPU executor, device decode path;
- :class:`~edgemoe.engine.gpu_memory.GpuMemory` (``self.memory``): the device-memory budget of the
  expert cache and the KV pool (auto mode, the KV / expert re-split), applied between steps;
- :class:`~edgemoe.engine.prefix_state.PrefixStateManager` (``self.prefix``): prefix cache and
  recurrent-state checkpoints;
- :class:`~edgemoe.engine.cuda_graphs.DecodeGraphs` (``self.graphs``): device-path decode steps and
  their CUDA graphs (``None`` off the device path).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from edgemoe.config import DEFAULT_PREFILL_CHUNK_TOKENS, EngineConfig, parse_dtype
from edgemoe.core import ForwardBatch, Phase, SeqSlice, StepInput
from edgemoe.engine.cuda_graphs import SCRATCH_SEQ, DecodeGraphs, DecodeInputs
from edgemoe.engine.expert_runtime import DecodePath, ExpertRuntime, NoGpuError, configure_torch_threads
from edgemoe.engine.gpu_memory import GpuMemory, make_probe
from edgemoe.engine.host_malloc import keep_freed_memory
from edgemoe.engine.prefix_state import Plan, PrefixStateManager
from edgemoe.engine.tokenizer import check_remote_code, load_tokenizer
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels import unavailable_reason
from edgemoe.kvcache.pool import KVCacheFullError, PagedKVPool
from edgemoe.kvcache.state import RecurrentStatePool, StateSlotsFullError, StateSnapshot
from edgemoe.layers.embedding import HostEmbedding
from edgemoe.models import load_config, model_class
from edgemoe.startup import size, startup_step
from edgemoe.weights.bootstrap import pin_or_fallback
from edgemoe.weights.dtypes import checkpoint_dtype
from edgemoe.weights.ftw import is_ftw, load_ftw
from edgemoe.weights.loader import dummy_layout, init_dummy, load_checkpoint

log = logging.getLogger(__name__)


class WarmUpError(RuntimeError):
    """A step of the start-up warm-up failed (:meth:`ModelRunner.warm_up`); the runner was reset and is usable."""


WARMUP_SEQ = -2  # the start-up warm-up's throwaway sequence (SCRATCH_SEQ, -1, owns the padding rows' page)
WARMUP_PROMPT_TOKENS = 8  # the length of its prompt

__all__ = ["DEFAULT_PREFILL_CHUNK_TOKENS", "KVCacheFullError", "ModelRunner", "StepInput"]

DEFAULT_MAX_MODEL_LEN = 32768


def _check_join_lateness(config: EngineConfig) -> None:
    """Refuse a graded join count (``join_lateness="graded"``) without what it times the joins with.

    Raises:
        ValueError: graded with the ``stream-op`` doorbell wait (no join kernel to time) or the torch CPU
            executor (no doorbell server to write the CPU branch's step time).
    """
    if config.join_lateness == "graded" and (config.doorbell_wait == "stream-op" or config.cpu_executor == "torch"):
        raise ValueError("join_lateness graded times each join in the kernel doorbell wait against the native "
                         f"executor's step time: not with doorbell_wait {config.doorbell_wait} and cpu_executor "
                         f"{config.cpu_executor}")


class ModelRunner:
    """Loads ``model_dir`` under ``config`` and executes prefill/decode steps.

    Args:
        model_dir: a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) or an
            FTW directory written by ``edgemoe convert`` (detected by its ``ftw.json``; fast bootstrap).
        config: engine options.
        progress: show progress bars while loading.

    Raises:
        FileNotFoundError / ValueError: missing or unsupported config; ``NoGpuError`` (a ``ValueError``):
            ``gpu_budget``, ``expert_cache_gb``, ``token_embedding="host"`` or another CUDA option
            (``gpu_headroom_gb``, ``doorbell_wait``, ``join_lateness``, ``enforce_eager``) for a device that is not
            a GPU;
            ``RemoteCodeError`` (a ``ValueError``): a tokenizer that is custom code without
            ``config.trust_remote_code``; ``token_embedding="host"`` for a model whose LM head is tied to the
            embedding, or without Triton.
        CheckpointError: a checkpoint that does not match the config (file and tensor named).
        RuntimeError: ``token_embedding="host"`` and pinning the table was refused.
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig, progress: bool = True):
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"{self.model_dir}: not a directory")
        self.engine_config = config
        self.device = config.resolved_device()
        for name, value in (("gpu_budget", config.gpu_budget_bytes), ("expert_cache_gb", config.expert_cache_gb)):
            if value is not None and self.device.type != "cuda":  # before the weights: fail fast
                raise NoGpuError(f"{name} {getattr(config, name)}: the device is {self.device}, not a GPU, so there "
                                 "is no GPU memory to budget; size an expert cache on this device with "
                                 "expert_cache_slots")
        if self.device.type != "cuda":  # options of the CUDA decode path: refused, not ignored
            for name, what in (("gpu_headroom_gb", "the free device memory auto mode keeps"),
                               ("doorbell_wait", "how the device decode step waits for its CPU experts"),
                               ("join_lateness", "how the device decode step counts its CPU hand-offs' joins"),
                               ("enforce_eager", "no CUDA graphs for decode")):
                if getattr(config, name) != EngineConfig.__dataclass_fields__[name].default:
                    raise NoGpuError(f"{name} {getattr(config, name)} ({what}) is a CUDA option, and the device is "
                                     f"{self.device}")
        _check_join_lateness(config)
        cfg = self.model_config = load_config(self.model_dir)
        check_remote_code(self.model_dir, config.trust_remote_code)  # before the weights: fail fast
        self.generation_config: dict = self._read_generation_config()  # raw, as saved; also fails fast
        self.dtype = (checkpoint_dtype(cfg.torch_dtype, self.model_dir) if config.dtype == "auto"
                      else parse_dtype(config.dtype))
        self.max_model_len = self._max_model_len(config.max_model_len)  # before the weights: a bad value fails fast
        configure_torch_threads(config.cpu_threads)
        model_cls = model_class(cfg.architecture)
        # built before the tokenizer thread starts: a scaled RoPE imports transformers' initializers here, and
        # transformers' lazy module is not safe to import from two threads at once
        with torch.device("meta"):
            self.model = model_cls(cfg)
        self.model.eval()
        if config.token_embedding == "host":  # before the weights: fail fast
            self._keep_embedding_on_host()
        # the tokenizer (and the rest of the transformers import behind it) loads while the weights are read
        tokenizer_loader = ThreadPoolExecutor(1, thread_name_prefix="edgemoe-tokenizer")
        tokenizer_future = tokenizer_loader.submit(self._load_tokenizer)
        tokenizer_loader.shutdown(wait=False)

        self.load_stats = None  # FTWLoadStats when bootstrapped from FTW
        self.weights_format = ("dummy weights" if config.load_format == "dummy" else
                               "FTW" if is_ftw(self.model_dir) else "HF safetensors")
        if config.seed != EngineConfig.seed and config.load_format != "dummy":  # said, not silently ignored
            log.warning("seed %d: seeds dummy weights only (load_format dummy); these are read from %s, so it is "
                        "not used", config.seed, self.weights_format)
        if config.verify_weights is not None and self.weights_format != "FTW":
            log.warning("verify_weights %s: applies to the checksums of an FTW checkpoint (`edgemoe convert`); these "
                        "weights are %s, so it is not used", config.verify_weights, self.weights_format)
        self.pool: HostExpertPool
        placed = ("routed experts and the token embedding into host memory" if config.token_embedding == "host"
                  else "routed experts into host memory")
        with startup_step(f"loading {cfg.architecture} from {self.model_dir} ({self.weights_format}; {placed}, "
                          f"the rest onto {self.device})"):
            if config.load_format == "dummy":
                layout = dummy_layout(self.model, self.model_dir, cfg, self.dtype)
                self.pool = init_dummy(self.model, layout, cfg, self.dtype, self.device, config.seed,
                                       progress=progress)
            elif is_ftw(self.model_dir):
                self.pool, self.load_stats = load_ftw(self.model, self.model_dir, self.dtype, self.device, cfg,
                                                      verify=config.verify_weights, progress=progress)
            else:
                self.pool = load_checkpoint(self.model, self.model_dir, cfg, self.dtype, self.device,
                                            progress=progress)
            self.tokenizer = tokenizer_future.result()
        if self.device.type == "cuda":  # blocks cached by loading (dummy weights' temporaries) go back before
            torch.cuda.empty_cache()  # the expert cache is sized from the free device memory
        self.eos_token_ids = self._eos_ids()
        pinning = startup_step(f"pinning the {size(self.pool.nbytes)} host expert pool (cudaHostRegister)")
        with pinning if self.device.type == "cuda" else contextlib.nullcontext():  # after filling, not before
            self.pin_outcome = pin_or_fallback(self.pool, self.device)
        self.pinned = self.pin_outcome.pinned
        embed = self.model.decoder.embed_tokens
        if isinstance(embed, HostEmbedding):  # after filling, as the pool
            with startup_step(f"pinning the {size(embed.nbytes)} token embedding (cudaHostRegister)"):
                if not embed.pin():
                    raise RuntimeError(f"token_embedding host: pinning the {size(embed.nbytes)} token embedding was "
                                       "refused (cudaHostRegister; check `ulimit -l` and free RAM), so the GPU cannot "
                                       "read it; serve with token_embedding device")

        kv_tokens = int(config.kv_cache_tokens or self.max_model_len)
        ps = config.page_size
        cuda = self.device.type == "cuda"
        # on CUDA one scratch page and one scratch state slot take the padding rows of captured decode
        # batches; reserved now, so they never count as capacity a request could take
        self._scratch_pages = int(cuda)
        self.kv = PagedKVPool(self.model.kv_spec(), -(-kv_tokens // ps) + self._scratch_pages, ps, self.dtype,
                              self.device, prefix_caching=config.enable_prefix_caching)
        if cuda:
            self.kv.allocate(SCRATCH_SEQ, 1)
        spec = self.model.state_spec()
        self.state = None if spec is None else RecurrentStatePool(spec, config.max_num_seqs + int(cuda), self.dtype,
                                                                  self.device)
        if self.state is not None and cuda:
            self.state.allocate(SCRATCH_SEQ)
        self.prefix = PrefixStateManager(self.kv, self.state, self.tokenizer, self.eos_token_ids, self.dtype,
                                         self.device)
        self.prefix.set_checkpoints(config.state_checkpoints, config.state_checkpoint_interval,
                                    config.anchor_checkpoints)
        self.experts = ExpertRuntime(self.pool, cfg, config, self.device, fallback=self.pin_outcome.fallback,
                                     graphs_supported=model_cls.supports_cuda_graphs, kv_bytes=self.kv.nbytes)
        self.graphs: DecodeGraphs | None = None
        self._bind()
        max_kv_pages = config.max_num_seqs * -(-self.max_model_len // ps) + self._scratch_pages
        self.memory = GpuMemory(self.experts, self.kv, config, max_kv_pages=max_kv_pages, rebind=self._bind,
                                probe=make_probe(self.device))
        self._step = 0
        self.record = None  # optional routing recorder callback (see ForwardBatch.record)
        self.host_malloc = None  # the summary's line when freed host memory is kept (a CPU device)
        if self.device.type == "cpu" and config.keep_freed_host_memory:
            self.host_malloc = keep_freed_memory()
        self.load_seconds = time.perf_counter() - t0  # the warm-up below is reported on its own
        self.warmup_seconds: float | None = None  # the start-up warm-up's time (None: it did not run)
        if config.warmup and cuda:
            try:
                with startup_step("warming up: a short prefill and two decode steps compile the GPU kernels",
                                  "seconds on a machine's first start, well under one after"):
                    self.warmup_seconds = self.warm_up()
            except WarmUpError as exc:  # said, and the engine starts cold as with --no-warmup
                log.warning("start-up warm-up: %s; the engine starts without it (as with --no-warmup)", exc)

    def warm_up(self, prompt_tokens: int = WARMUP_PROMPT_TOKENS) -> float | None:
        """Run the steps a first request runs, then start over as a fresh runner would: a prefill of
        ``prompt_tokens`` tokens (fewer where ``max_model_len`` is shorter) and two decode steps of one throwaway
        sequence (``WARMUP_SEQ``), its KV pages and recurrent state freed (nothing enters the prefix cache, and no
        recurrent-state checkpoint is taken), the expert cache rebuilt cold under a policy back at its prior with
        every count at zero (:meth:`ExpertRuntime.restart`), the step clock at 0.

        On a GPU the first decode step of a process compiles the decode kernels (Triton JIT: seconds on a
        machine's first start, well under one once Triton's disk cache holds them) and captures the decode
        step; without this the first request pays that in its first decode step, and the expert policy reads
        that step's time. What stays are the compiled kernels of a one-sequence decode step and of a short
        prompt's prefill; a larger batch or a prompt long enough to stream its layers (``edgemoe.experts.prefill``)
        still compiles its own kernels at first use. The captured graphs are dropped with the rebuilt cache (their
        capture, which runs no kernel, comes with the first request's first decode step); the ``static`` policy
        places its layers again.

        Returns:
            Seconds taken, or ``None`` when it did not run: the steps would not fit in ``max_model_len`` or in the
            free KV pages without borrowing from the expert cache (logged).

        Raises:
            WarmUpError: a step failed; the runner was reset as above and is usable (its first request then
                runs the same steps and may fail the same way).
            RuntimeError: the reset failed (e.g. the cache could not be allocated again); the runner is not usable.
        """
        t0 = time.perf_counter()
        n = min(prompt_tokens, self.max_model_len - 2)  # the prompt, then two decode positions
        if n < 1 or self.kv.pages_needed(WARMUP_SEQ, n + 2) > self.kv.free_pages:
            log.info("start-up warm-up skipped: %d prompt and 2 decode tokens do not fit (max_model_len %d, %d free KV "
                     "pages)", max(n, 0), self.max_model_len, self.kv.free_pages)
            return None
        skip = set(self.eos_token_ids) | set(self.prefix.anchor_ids)
        ids = [t for t in range(n + len(skip)) if t not in skip][:n]
        failed = None
        store, self.prefix.checkpoints = self.prefix.checkpoints, None  # no step of it plans a state checkpoint
        try:
            self.execute([StepInput(WARMUP_SEQ, ids, 0)], Phase.PREFILL)
            for pos in range(n, n + 2):
                self.execute([StepInput(WARMUP_SEQ, ids[:1], pos)], Phase.DECODE)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # the reset below still runs; a failure there is raised as it is
            log.debug("start-up warm-up step failed", exc_info=True)
            failed = f"{type(exc).__name__}: {exc}"  # the message only: the traceback's frames may hold device memory
        finally:
            self.prefix.checkpoints = store
        # outside inference mode, as a resize rebuilds the cache: its new tensors stay writable by every caller
        self.free(WARMUP_SEQ)
        if self.graphs is not None:
            self.graphs.invalidate()  # the captured graphs' memory goes before the cache is allocated again
        self.experts.restart()
        self._bind()
        self._step = 0
        if failed is not None:
            raise WarmUpError(f"a warm-up step failed: {failed}")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ loading helpers
    def _keep_embedding_on_host(self) -> None:
        """``token_embedding="host"``: swap the model's token embedding for a ``HostEmbedding`` (before the
        weights are loaded).

        Raises:
            ValueError: tied embeddings (``MoECausalLM.keep_embedding_on_host``), or no Triton kernels.
            NoGpuError: a device that is not a GPU (every weight is in host memory already).
        """
        self.model.keep_embedding_on_host()
        if self.device.type != "cuda":
            raise NoGpuError(f"token_embedding host: the device is {self.device}, not a GPU, so every weight is in "
                             "host memory already and there is no GPU memory to free; use token_embedding device")
        reason = unavailable_reason(self.device)
        if reason is not None:
            raise ValueError(f"token_embedding host: the rows are gathered by a Triton kernel, and {reason}")

    def _max_model_len(self, requested: int | None) -> int:
        """``requested`` (``--max-model-len``), else the model's context length capped at
        ``DEFAULT_MAX_MODEL_LEN``.

        Raises:
            ValueError: ``requested`` exceeds the model's context length (``ModelConfig.context_length``:
                ``max_position_embeddings``, extended by a RoPE scaling config): positions past it were
                never trained and give garbage, so it is refused rather than accepted silently.
        """
        cfg = self.model_config
        limit = cfg.context_length()
        if requested is not None and requested > limit:
            scaled = ("" if limit == cfg.max_position_embeddings else
                      f", extended by its {cfg.rope_parameters['rope_type']} RoPE scaling")
            raise ValueError(f"max_model_len {requested} exceeds the model's context length {limit} "
                             f"(max_position_embeddings {cfg.max_position_embeddings} in config.json{scaled}); "
                             "to go further, add a RoPE scaling entry (rope_scaling) to config.json")
        return int(requested or min(limit, DEFAULT_MAX_MODEL_LEN))

    def _load_tokenizer(self):
        return load_tokenizer(self.model_dir, self.engine_config.trust_remote_code)

    def _eos_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            eos = list(self.model_config.eos_token_ids) or self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return [int(i) for i in ids]

    def _read_generation_config(self) -> dict:
        """The checkpoint's ``generation_config.json`` (``{}`` when it has none), its fields edgemoe reads
        checked: ``eos_token_id`` (the stop tokens) and the sampling defaults
        (:data:`~edgemoe.engine.sampling.GENERATION_CONFIG_KEYS`, checked as
        :class:`~edgemoe.engine.sampling.SamplingParams` checks them).

        Raises:
            ValueError: the file is not valid JSON, not a JSON object, or one of those fields has a value of
                the wrong type or range (the message names the file and the field).
        """
        from edgemoe.engine.sampling import GENERATION_CONFIG_KEYS, SamplingParams, SamplingParamsError

        path = self.model_dir / "generation_config.json"
        if not path.is_file():
            return {}
        try:
            gen = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(gen, dict):
            raise ValueError(f"{path}: not a JSON object")
        eos = gen.get("eos_token_id")
        if eos is not None and not all(isinstance(i, int) and not isinstance(i, bool)
                                       for i in (eos if isinstance(eos, list) else [eos])):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
        try:
            SamplingParams(**{k: gen[k] for k in GENERATION_CONFIG_KEYS if gen.get(k) is not None})
        except SamplingParamsError as exc:
            raise ValueError(f"{path}: {exc.field} {exc.reason}") from None
        return gen

    def _cpu_dense(self):
        """The CPU executor's native decode GEMVs, norms and attention (``CpuExecutor.dense``) on a CPU
        device, else ``None``."""
        return self.experts.cpu_executor.dense if self.device.type == "cpu" else None

    def _bind(self) -> None:
        """Attach the pools, the expert executor and the checkpoint store to the model's layers, and
        set up the decode graphs for the current decode path (after any of them was rebuilt)."""
        self.model.bind(kv=self.kv, experts=self.experts.hybrid, state=self.state,
                        checkpoints=self.prefix.checkpoints, dense=self._cpu_dense())
        if self.engine_config.prefetch == "next-layer":
            self.experts.hybrid.set_prefetch([blk.route for blk in self.model.moe_blocks()])
        if self.experts.decode_path is DecodePath.EAGER:
            self.graphs = None
        elif self.graphs is None:
            cfg = self.model_config
            inputs = DecodeInputs(self.kv, self.state, cfg.num_heads, cfg.head_dim, self.max_model_len,
                                  self.engine_config.max_num_seqs, self.device)
            self.graphs = DecodeGraphs(inputs, self.device)
        else:
            self.graphs.invalidate()  # a rebuilt cache moved the tensors the graphs captured

    # ------------------------------------------------------------------ run-time changes
    def set_expert_cache(self, slots: int, policy: str) -> None:
        """Rebuild the device expert cache with ``slots`` slots under ``policy`` (a safe point between
        steps; see :meth:`ExpertRuntime.set_cache`); decode graphs are captured again.

        Raises:
            ValueError: negative ``slots`` or an unknown policy (checked before anything changes).
        """
        try:
            self.experts.set_cache(slots, policy)
        finally:
            self._bind()

    def set_join_lateness(self, lateness: str) -> None:
        """Count the device decode path's joins ``lateness`` (``EngineConfig.join_lateness``) from now on, at a safe
        point between steps (benchmarks compare the counts in one process this way): the expert cache is rebuilt
        cold (same size and policy); decode graphs are captured again.

        Raises:
            ValueError: an unknown count, or ``graded`` where the start-up check or the device decode path refuses
                it; any error of the rebuild (e.g. out of device memory) is raised too. The runner then keeps
                counting as before, on a cache rebuilt cold.
        """
        config = replace(self.engine_config, join_lateness=lateness)  # checks the choice
        _check_join_lateness(config)
        if lateness != "yes-no" and self.device.type != "cuda":
            raise NoGpuError(f"join_lateness {lateness} is a CUDA option, and the device is {self.device}")
        try:
            self.experts.set_join_lateness(lateness)  # on an error: the count before, on a cache rebuilt cold
            self.engine_config = config
        finally:
            self._bind()

    def set_cpu_threads(self, threads: int | None, oversubscribe: bool = False) -> None:
        """Rebuild the CPU expert executor with ``threads`` (``None``: the default count) and torch's
        intra-op threads to match, at a safe point between steps (benchmarks sweep the count this
        way; ``oversubscribe`` lifts the cap, see :meth:`ExpertRuntime.set_cpu_threads`). The expert
        cache is rebuilt cold over the new executor; decode graphs are captured again. B_H changes
        with the count: set :attr:`ExpertRuntime.bandwidths` anew for the q* rule.

        Raises:
            ValueError: ``threads < 1``.
        """
        try:
            self.experts.set_cpu_threads(threads, oversubscribe)
        finally:
            self._bind()
        configure_torch_threads(threads)

    def resize_expert_cache(self, gb: float | None = None, slots: int | None = None, policy: str | None = None) -> dict:
        """Change the GPU budget and/or policy of the expert cache at run time (elastic memory), at a
        safe point between steps. The host pool and the KV cache stay as they are; the new cache
        starts cold; decode graphs are captured again; the new size is the one auto mode grows back
        to (:meth:`GpuMemory.configure`). If the new size cannot be allocated, the previous size and
        policy are restored and the error is raised.

        Returns:
            :meth:`expert_stats` after the change.

        Raises:
            NoGpuError: ``gb`` on a device that is not a GPU. ValueError: see :meth:`ExpertRuntime.resize`.
            ResizeError: the new cache could not be set up (the previous one is kept).
        """
        if gb is not None and slots is not None:
            raise ValueError("give gb or slots, not both")
        if gb is None and slots is None and policy is None:
            raise ValueError("give gb, slots or policy")
        if gb is not None and not self.memory.gpu:
            raise NoGpuError(f"gb {gb}: the device is {self.device}, not a GPU, so there is no GPU memory to budget; "
                             "size the expert cache on this device in slots")
        self.memory.configure(expert_gb=gb, expert_slots=slots, policy=policy)
        return self.expert_stats()

    def set_state_checkpoints(self, slots: int, interval: int, anchors: bool = True) -> None:
        """(Re)build the recurrent-state checkpoint store (hybrid models) at a safe point between
        steps, dropping the checkpoints it held (see :meth:`PrefixStateManager.set_checkpoints`).

        Raises:
            ValueError: negative ``slots`` or ``interval``.
        """
        self.model.bind(kv=self.kv, experts=self.experts.hybrid, state=self.state, checkpoints=None,
                        dense=self._cpu_dense())
        try:
            self.prefix.set_checkpoints(slots, interval, anchors)
        finally:
            self._bind()

    # ------------------------------------------------------------------ capacity (the scheduler's interface)
    @property
    def page_size(self) -> int:
        return self.kv.page_size

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds for requests now (the padding rows' scratch page excluded)."""
        return self.kv.capacity_tokens - self._scratch_pages * self.kv.page_size

    @property
    def kv_limit_tokens(self) -> int:
        """Tokens the KV cache can hold for requests, counting the pages it may borrow from the expert
        cache or the free device memory (:meth:`GpuMemory.lendable_kv_pages`, as of the last change:
        safe to read from any thread)."""
        return (self.memory.kv_limit_pages - self._scratch_pages) * self.kv.page_size

    def kv_free_tokens(self) -> int:
        """Free KV tokens of the pool as it is."""
        return self.kv.free_tokens()

    def kv_available_tokens(self) -> int:
        """Free KV tokens plus those of the pages the KV cache may borrow (a step that needs them
        borrows them, :meth:`GpuMemory.lend_kv`): what the scheduler may plan with."""
        return (self.kv.free_pages + self.memory.lendable_kv_pages()) * self.kv.page_size

    def can_allocate(self, seq_id: int, total_len: int) -> bool:
        fits = self.kv.pages_needed(seq_id, total_len) <= self.kv.free_pages + self.memory.lendable_kv_pages()
        return fits and (self.state is None or self.state.can_hold(seq_id))

    def free(self, seq_id: int) -> None:
        self.kv.free(seq_id)
        if self.state is not None:
            self.state.free(seq_id)
            self.prefix.forget(seq_id)

    def attach_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """See :meth:`PrefixStateManager.attach`: tokens of ``token_ids`` reused from the prefix cache."""
        return self.prefix.attach(seq_id, token_ids)

    def cache_prefix(self, seq_id: int, token_ids: list[int]) -> None:
        """See :meth:`PrefixStateManager.cache`."""
        self.prefix.cache(seq_id, token_ids)

    # ------------------------------------------------------------------ recurrent state
    def snapshot_state(self, seq_id: int) -> StateSnapshot:
        """A copy of ``seq_id``'s recurrent state (conv + delta-rule memory of every linear layer) after
        its last step; opaque to callers, for :meth:`restore_state`.

        Raises:
            ValueError: the model has no recurrent state. KeyError: ``seq_id`` holds no state.
        """
        if self.state is None:
            raise ValueError(f"{self.model_config.architecture} has no recurrent state")
        return self.state.snapshot(seq_id)

    def restore_state(self, seq_id: int, snapshot: StateSnapshot) -> None:
        """Make ``snapshot`` the recurrent state of ``seq_id`` (a slot is allocated if it holds none).
        The caller provides the matching KV (the snapshot's token count) and continues with
        ``start_pos`` = that count.

        Raises:
            ValueError: no recurrent state, or a snapshot of another geometry.
            StateSlotsFullError: ``seq_id`` holds no slot and none is free.
        """
        if self.state is None:
            raise ValueError(f"{self.model_config.architecture} has no recurrent state")
        self.state.restore(seq_id, snapshot)

    def can_resume(self, seq_id: int) -> bool:
        """Whether ``seq_id`` can continue from its cached tokens: always for KV-only models; for models
        with recurrent state, only while its state slot is held (a failed step drops the states it
        half-advanced, see :meth:`execute`)."""
        return self.state is None or self.state.slot(seq_id) is not None

    def _state_slots(self, inputs: list[StepInput]) -> list[int | None]:
        """Each input's recurrent-state slot; a sequence's first chunk (``start_pos == 0``) gets a zeroed one.

        Raises:
            StateSlotsFullError: more new sequences than free slots (nothing allocated then).
            ValueError: a continuing sequence (``start_pos > 0``) without a state.
        """
        if self.state is None:
            return [None] * len(inputs)
        new = [inp.seq_id for inp in inputs if inp.start_pos == 0 and self.state.slot(inp.seq_id) is None]
        if len(new) > self.state.free_slots:
            raise StateSlotsFullError(f"recurrent-state slots full: step needs {len(new)}, "
                                      f"{self.state.free_slots} free of {self.state.num_slots}")
        for inp in inputs:
            if inp.start_pos > 0 and self.state.slot(inp.seq_id) is None:
                raise ValueError(f"sequence {inp.seq_id}: starts at position {inp.start_pos} without a recurrent "
                                 "state (restore a state snapshot first; cached KV alone cannot resume it)")
        return [self.state.allocate(inp.seq_id) if inp.start_pos == 0 else self.state.slot(inp.seq_id)
                for inp in inputs]

    # ------------------------------------------------------------------ execution
    @torch.inference_mode()
    def execute(self, inputs: list[StepInput], phase: Phase) -> torch.Tensor:
        """Run one step.

        Args:
            inputs: the sequences of this step (all prefill or all decode).
            phase: ``Phase.PREFILL`` or ``Phase.DECODE``.

        Returns:
            ``[len(inputs), vocab]`` float32 logits of each sequence's last new token, on ``self.device``.

        Raises:
            KVCacheFullError: not enough free KV pages for all inputs, or (``StateSlotsFullError``) not
                enough recurrent-state slots for the new sequences (nothing allocated then).
            ValueError: an empty input, a sequence longer than ``max_model_len``, or (hybrid models) a
                continuing sequence without a recurrent state. When the forward itself raises, the
                recurrent states of the step's sequences are dropped (partly updated), so those
                sequences can only restart from position 0 or a restored snapshot.
        """
        need = 0
        for inp in inputs:
            end = inp.start_pos + len(inp.token_ids)
            if not inp.token_ids:
                raise ValueError(f"sequence {inp.seq_id}: empty step input")
            if end > self.max_model_len:
                raise ValueError(f"sequence {inp.seq_id}: {end} tokens exceed max_model_len {self.max_model_len}")
            need += self.kv.pages_needed(inp.seq_id, end)
        if need > self.kv.free_pages and not self.memory.lend_kv(need - self.kv.free_pages):
            raise KVCacheFullError(f"KV cache full: step needs {need} pages, {self.kv.free_pages} free")
        self._step += 1
        state_slots = self._state_slots(inputs)
        plans = self.prefix.plan(inputs)
        self.experts.begin_step(self._step, phase, len(inputs))
        if phase is Phase.DECODE and self.graphs is not None:
            for inp in inputs:
                self.kv.allocate(inp.seq_id, inp.start_pos + 1)
            return self._run_model(inputs, self._device_decode, state_slots, plans, phase)
        ids, pos, slots, seqs, last = [], [], [], [], []
        q = 0
        for inp, state_slot, plan in zip(inputs, state_slots, plans):
            n, end = len(inp.token_ids), inp.start_pos + len(inp.token_ids)
            self.kv.allocate(inp.seq_id, end)
            ids.extend(inp.token_ids)
            pos.extend(range(inp.start_pos, end))
            slots.append(self.kv.slots(inp.seq_id, inp.start_pos, end))
            ckpts = [(p - inp.start_pos, c) for p, c in plan] if phase is Phase.PREFILL else []
            seqs.append(SeqSlice(inp.seq_id, q, n, end, self.kv.page_table(inp.seq_id), state_slot, ckpts))
            q += n
            last.append(q - 1)
        dev = self.device
        batch = ForwardBatch(
            phase=phase,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            kv_slots=torch.cat(slots),
            seqs=seqs,
            logits_index=torch.tensor(last, dtype=torch.int64, device=dev),
            step=self._step,
            record=self.record,
            state_slots=None if self.state is None else torch.tensor(state_slots, dtype=torch.int64, device=dev),
        )
        return self._run_model(inputs, lambda _inputs, _slots: self._forward(batch), state_slots, plans, phase)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's forward over ``batch``; on the CPU with torch's intra-op threads as the CPU executor
        sets them for its rows (``CpuExecutor.forward_threads``: a decode step's GEMVs, norms and attention
        run on the executor's kernels, bound to the layers as ``dense``)."""
        if self.device.type != "cpu":
            return self.model(batch)
        with self.experts.cpu_executor.forward_threads(int(batch.input_ids.numel())):
            return self.model(batch)

    def _device_decode(self, inputs: list[StepInput], state_slots: list[int | None]) -> torch.Tensor:
        graphs = self.experts.decode_path is DecodePath.DEVICE_GRAPHS
        dd = self.experts.device_decode
        armed = dd is not None and dd.armed
        arming = dd.arming if dd is not None and dd.can_disarm else None
        logits = self.graphs.run(self.model, inputs, state_slots, self._step, self.record, graphs, armed=armed,
                                 arming=arming)
        self.experts.check_decode_step()
        return logits

    def _run_model(self, inputs: list[StepInput], forward, state_slots: list[int | None], plans: list[Plan],
                   phase: Phase) -> torch.Tensor:
        """Run ``forward(inputs, state_slots)`` (the model step); on failure drop the recurrent states it
        half-advanced and the checkpoints it planned (``can_resume`` then tells the engine to
        recompute), and re-raise."""
        try:
            logits = forward(inputs, state_slots)
        except Exception:
            if self.state is not None:  # layers before the failure advanced these states: never reuse them
                for inp in inputs:
                    self.state.free(inp.seq_id)
                self.prefix.discard(inputs, plans)
            raise
        self.prefix.commit(inputs, state_slots, plans, phase)
        return logits

    # ------------------------------------------------------------------ reporting
    def expert_stats(self) -> dict:
        """Expert-cache state and counters for metrics and the summary (see :meth:`ExpertRuntime.stats`),
        with the memory budget under ``memory`` (:meth:`GpuMemory.stats`, without its history)."""
        return {**self.experts.stats(), "memory": self.memory.stats(history=False)}

    def _weights_line(self) -> str:
        """The start-up summary's line of the model's own weights (the routed experts aside) and where the
        token embedding is, in GB (1e9 bytes)."""
        on_device, _ = self.model.weight_bytes()
        embed = self.model.decoder.embed_tokens
        table = embed.weight.numel() * embed.weight.element_size()
        where = (f"host ({'pinned' if embed.pinned else 'pageable'}, {table / 1e9:.2f} GB; each step's rows "
                 "gathered over PCIe)" if isinstance(embed, HostEmbedding) else
                 f"{self.device} ({table / 1e9:.2f} GB of those)")
        return (f"  weights      {on_device / 1e9:.2f} GB on {self.device} besides the routed experts; token "
                f"embedding: {where}")

    def summary(self) -> str:
        """Start-up summary: device, cache slots, B_P, B_H, q*/m, decode path, GPU budget, KV cache."""
        cfg = self.model_config
        dev = str(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            dev += f" ({torch.cuda.get_device_name(self.device)}, {total / 2**30:.0f} GiB)"
        ex = self.experts.cpu_executor
        lines = [
            f"edgemoe: {cfg.architecture} from {self.model_dir} ({self.weights_format}, {self.pool.format.value} "
            f"experts), dtype {str(self.dtype).replace('torch.', '')}, loaded in {self.load_seconds:.1f} s"
            + (f", then warmed up in {self.warmup_seconds:.1f} s" if self.warmup_seconds is not None else ""),
            f"  device       {dev}; CPU executor {ex.name}, {ex.threads} threads"
            + (f" ({ex.threads_note})" if ex.threads_note else ""),
            self._weights_line(),
            *self.experts.summary_lines(self.pinned),
            self.memory.summary_line(),
            *([f"  host memory  {self.host_malloc}"] if self.host_malloc else []),
            f"  KV cache     {self.kv.capacity_tokens} tokens in pages of {self.kv.page_size}, "
            f"{self.kv.bytes_per_token / 1024:.1f} KiB per token ({self.kv.spec.describe()}) = "
            f"{self.kv.nbytes / 1e9:.3f} GB; "
            f"max_model_len {self.max_model_len}; prefix caching {'on' if self.kv.prefix_cache is not None else 'off'}",
        ]
        if self.state is not None:
            lines.append(f"  state        {self.state.spec.num_layers} linear-attention layers, {self.state.num_slots} "
                         f"sequence slots = {self.state.nbytes / 1e9:.3f} GB")
            ck, pf = self.prefix.checkpoints, self.prefix
            lines.append("  checkpoints  off" if ck is None else
                         f"  checkpoints  {ck.num_slots} slots = {ck.nbytes / 1e9:.3f} GB; at "
                         f"{len(pf.anchor_ids)} anchor tokens, every {pf.interval or '-'} tokens")
        return "\n".join(lines)

"""The model runner: loads a checkpoint, owns the model, the KV pool and the expert path, runs steps.

Only the engine's step thread calls into a runner. The runner turns a list of :class:`StepInput`
into a :class:`~edgemoe.core.ForwardBatch` (allocating KV pages) and returns last-token logits.
"""

from __future__ import annotations

import json
import logging
import math
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from edgemoe.config import EXPERT_POLICIES, EngineConfig, ModelConfig, parse_dtype
from edgemoe.core import DecodeMeta, ForwardBatch, Phase, SeqSlice
from edgemoe.experts.bandwidth import resolve_bandwidths
from edgemoe.experts.cache import ExpertCache
from edgemoe.experts.cpu_executor import make_cpu_executor
from edgemoe.experts.device_decode import DeviceDecode, device_path_available
from edgemoe.experts.hybrid import HybridExperts
from edgemoe.experts.policy import make_policy
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kvcache.pool import KVCacheFullError, PagedKVPool
from edgemoe.kvcache.state import RecurrentStatePool, StateSlotsFullError, StateSnapshot
from edgemoe.kvcache.state_checkpoints import StateCheckpointStore, anchor_token_ids, checkpoint_positions
from edgemoe.models import model_class
from edgemoe.weights.bootstrap import FALLBACK_POLICY, pin_or_fallback
from edgemoe.weights.ftw import is_ftw, load_ftw
from edgemoe.weights.loader import init_dummy, load_checkpoint

log = logging.getLogger(__name__)

__all__ = ["ModelRunner", "StepInput", "KVCacheFullError"]

DEFAULT_MAX_MODEL_LEN = 32768
GRAPH_BATCH_SIZES = (1, 2, 4, 8)  # decode batch sizes with a captured CUDA graph (smaller batches pad up)
GPU_MEMORY_MARGIN = 2 << 30  # bytes left free on the GPU when the expert cache is sized automatically


@dataclass
class StepInput:
    """One sequence's work in a step.

    Attributes:
        seq_id: engine-chosen id; owns KV pages until :meth:`ModelRunner.free`.
        token_ids: the new tokens to compute (a prompt, a prefill chunk, or one decode token).
        start_pos: absolute position of ``token_ids[0]``; the KV cache already holds ``[0, start_pos)``.
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


class ModelRunner:
    """Loads ``model_dir`` under ``config`` and executes prefill/decode steps.

    Args:
        model_dir: a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) or an
            FTW directory written by ``edgemoe convert`` (detected by its ``ftw.json``; fast bootstrap).
        config: engine options.
        progress: show progress bars while loading.

    Raises:
        FileNotFoundError / ValueError: missing or unsupported config.
        CheckpointError: a checkpoint that does not match the config (file and tensor named).
    """

    def __init__(self, model_dir: str | Path, config: EngineConfig, progress: bool = True):
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"{self.model_dir}: not a directory")
        self.engine_config = config
        self.device = config.resolved_device()
        cfg = self.model_config = ModelConfig.from_hf(self.model_dir)
        self.dtype = parse_dtype(cfg.torch_dtype if config.dtype == "auto" else config.dtype)
        # the tokenizer (and the transformers import behind it) loads while the weights are read
        tokenizer_loader = ThreadPoolExecutor(1, thread_name_prefix="edgemoe-tokenizer")
        tokenizer_future = tokenizer_loader.submit(self._load_tokenizer)
        tokenizer_loader.shutdown(wait=False)

        with torch.device("meta"):
            self.model = model_class(cfg.architecture)(cfg)
        self.model.eval()
        self.pool = HostExpertPool(cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size,
                                   cfg.moe_intermediate_size, self.dtype)
        self.load_stats = None  # FTWLoadStats when bootstrapped from FTW
        if config.load_format == "dummy":
            self.weights_format = "dummy weights"
            init_dummy(self.model, self.pool, self.dtype, self.device, config.seed, progress=progress)
        elif is_ftw(self.model_dir):
            self.weights_format = "FTW"
            self.load_stats = load_ftw(self.model, self.pool, self.model_dir, self.dtype, self.device, cfg,
                                       verify=config.verify_weights, progress=progress)
        else:
            self.weights_format = "HF safetensors"
            load_checkpoint(self.model, self.pool, self.model_dir, self.dtype, self.device, cfg.num_experts,
                            progress=progress)
        self.tokenizer = tokenizer_future.result()
        self.generation_config: dict = _read_json(self.model_dir / "generation_config.json")  # raw, as saved
        self.eos_token_ids = self._eos_ids()
        self.pin_outcome = pin_or_fallback(self.pool, self.device)  # pinned after filling (DESIGN.md §5)
        self.pinned = self.pin_outcome.pinned

        self.max_model_len = int(config.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN))
        kv_tokens = int(config.kv_cache_tokens or self.max_model_len)
        ps = config.page_size
        attn_layers = self.model.attention_layers()
        scratch_pages = int(self.device.type == "cuda")  # the padding rows' page of captured decode batches
        self.kv = PagedKVPool(len(attn_layers), -(-kv_tokens // ps) + scratch_pages, ps, cfg.num_kv_heads, cfg.head_dim,
                              self.dtype, self.device, prefix_caching=config.enable_prefix_caching)
        for attn in attn_layers:
            attn.kv = self.kv
        self._scratch_pages = scratch_pages
        if scratch_pages:  # reserved now, so it never counts as capacity a request could take
            self.kv.allocate(_SCRATCH_SEQ, 1)
        self._decode_inputs = None  # static decode inputs of the device path (built with the expert cache)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # hybrid models: one recurrent-state slot per sequence the engine runs at once
        spec = self.model.state_spec()
        self.state = None if spec is None else RecurrentStatePool(
            spec, config.max_num_seqs + (self.device.type == "cuda"), self.dtype, self.device)  # + a scratch slot: padding rows of captured decode batches
        if self.state is not None:
            for layer in self.model.state_layers():
                layer.state = self.state
            if self.device.type == "cuda":  # reserved now: the scheduler sees max_num_seqs free slots
                self.state.allocate(_SCRATCH_SEQ)
        self.checkpoints: StateCheckpointStore | None = None
        self.set_state_checkpoints(config.state_checkpoints, config.state_checkpoint_interval,
                                   config.anchor_checkpoints)

        self.cpu_executor = make_cpu_executor(self.pool, config.cpu_threads, config.cpu_executor)
        self.cache = None
        self.bandwidths = None
        if self.pin_outcome.fallback:  # pinning refused: pageable pool, every expert on the CPU
            self.set_expert_cache(0, FALLBACK_POLICY)
        else:
            self.set_expert_cache(self._cache_slots(), config.expert_policy)
        self._step = 0
        self._last_decode = None  # (start time, batch size) of the previous step when it was a decode
        self.record = None  # optional routing recorder callback (see ForwardBatch.record)
        self.load_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ loading helpers
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir))

    def _eos_ids(self) -> list[int]:
        eos = self.generation_config.get("eos_token_id")
        if eos is None:
            eos = list(self.model_config.eos_token_ids) or self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        return [int(i) for i in ids]

    def _cache_slots(self) -> int:
        cfg, row = self.engine_config, self.pool.row_bytes
        n = self.pool.num_ids
        if cfg.expert_cache_slots is not None:
            return min(int(cfg.expert_cache_slots), n)
        if cfg.expert_cache_gb is not None:
            return min(int(cfg.expert_cache_gb * 1e9 // row), n)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(0, min(n, int((free - GPU_MEMORY_MARGIN) // row)))
        return 0

    def set_expert_cache(self, slots: int, policy: str) -> None:
        """(Re)build the device expert cache with ``slots`` slots under ``policy``, at a safe point
        between steps (no step in flight). The host pool and the KV cache are untouched; the new cache
        starts cold (a static policy re-places its layers). Counters restart from zero.

        Raises:
            ValueError: negative ``slots`` or an unknown policy (checked before anything changes).
        """
        if slots < 0:
            raise ValueError("expert cache slots must be >= 0")
        if policy not in EXPERT_POLICIES:
            raise ValueError(f"unknown expert policy {policy!r}; choose one of {', '.join(EXPERT_POLICIES)}")
        slots = min(int(slots), self.pool.num_ids)
        old = getattr(getattr(self, "experts", None), "device_decode", None)
        if old is not None:  # its doorbell server stops now, not whenever the last reference goes
            old.close()
            self.experts.device_decode = None
        if self.cache is not None:  # free the old banks before allocating the new ones
            self.cache.banks.clear()
            self.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.cache = ExpertCache(slots, self.pool.num_ids, [tuple(self.pool.w13.shape[1:]), tuple(self.pool.w2.shape[1:])],
                                 self.dtype, self.device)
        if self.bandwidths is None or (policy in ("qstar", "adaptive") and self.bandwidths.pcie is None and slots > 0):
            cfg = self.engine_config
            if cfg.expert_policy != policy:
                from dataclasses import replace

                cfg = replace(cfg, expert_policy=policy)
            self.bandwidths = resolve_bandwidths(cfg, self.pool, self.cache, self.cpu_executor)
        self.policy = make_policy(policy, self.bandwidths)
        self.experts = HybridExperts(self.pool, self.cache, self.policy, self.cpu_executor,
                                     self.model_config.num_experts, self.device)
        for blk in self.model.moe_blocks():
            blk.experts = self.experts
        self._setup_device_decode()

    def resize_expert_cache(self, gb: float | None = None, slots: int | None = None, policy: str | None = None) -> dict:
        """Change the GPU budget of the expert cache at run time (DESIGN.md §4, elastic memory).

        Call at a safe point (no step in flight: the engine thread between steps). The host pool and
        the KV cache stay as they are; the new cache starts cold (a static policy re-places layers);
        decode graphs are captured again. If the new size cannot be allocated, the previous size and
        policy are restored and the error is raised.

        Args:
            gb: new budget in GB (1e9 bytes); or ``slots``: new size in (layer, expert) slots.
            policy: a new expert policy (default: keep the current one).

        Returns:
            :meth:`expert_stats` after the change.

        Raises:
            ValueError: both or neither of ``gb``/``slots`` with no ``policy``, a negative or infinite
                size, an unknown policy, a pool that could not be pinned (CPU-only), or a failure
                setting up the new cache (the previous one is back in place; if even that fails, the
                CPU-only cache of 0 slots is).
        """
        if gb is not None and slots is not None:
            raise ValueError("give gb or slots, not both")
        if (gb is not None and gb < 0) or (slots is not None and slots < 0):
            raise ValueError("the expert-cache size must be >= 0")
        if gb is None and slots is None and policy is None:
            raise ValueError("give gb, slots or policy")
        if policy is not None and policy not in EXPERT_POLICIES:
            raise ValueError(f"unknown expert policy {policy!r}; choose one of {', '.join(EXPERT_POLICIES)}")
        if gb is not None and not math.isfinite(gb):
            raise ValueError("gb must be a finite number")
        old_slots, old_policy = self.cache.num_slots, self.policy.name
        new_slots = old_slots if gb is None and slots is None else (
            min(int(slots), self.pool.num_ids) if slots is not None else
            int(min(gb * 1e9, self.pool.nbytes) // self.pool.row_bytes))
        if self.pin_outcome.fallback and (new_slots > 0 or (policy or old_policy) != FALLBACK_POLICY):
            raise ValueError("the host expert pool could not be pinned at start-up, so experts run on the CPU "
                             f"only: the cache stays at 0 slots with policy {FALLBACK_POLICY}")
        try:
            self.set_expert_cache(new_slots, policy or old_policy)
        except Exception as exc:  # noqa: BLE001 - any failure: put the previous cache back
            log.warning("expert cache resize to %d slots failed (%s); restoring %d slots", new_slots, exc, old_slots)
            try:
                self.set_expert_cache(old_slots, old_policy)
                kept = f"kept {old_slots} slots"
            except Exception:  # noqa: BLE001 - even the old size failed: the CPU-only cache always fits
                self.set_expert_cache(0, FALLBACK_POLICY)
                kept = f"the previous size no longer fits either: now 0 slots, policy {FALLBACK_POLICY}"
            raise ValueError(f"could not set up {new_slots} expert-cache slots "
                             f"({new_slots * self.pool.row_bytes / 1e9:.2f} GB): {exc}; {kept}") from None
        log.info("expert cache resized: %d -> %d slots (%.2f GB), policy %s", old_slots, self.cache.num_slots,
                 self.cache.nbytes / 1e9, self.policy.name)
        return self.expert_stats()

    def _setup_device_decode(self) -> None:
        """Enable the device decode path (routing control on the device, Triton kernels, CUDA graphs)
        when CUDA and Triton are present and the cache has slots; otherwise decode takes the eager path."""
        self.graphs.clear()  # a re-budgeted cache invalidates every captured graph (and their memory pool)
        self.graphs_failed: set[int] = set()  # batch sizes whose capture failed: they run eagerly
        self.graph_pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.decode_path = "eager"
        reason = device_path_available(self.device)
        if reason is None and self.cache.num_slots == 0:
            reason = "no expert cache slots"
        if reason is not None:
            self.decode_path_reason = reason
            return
        cfg, ecfg = self.model_config, self.engine_config
        max_bs = max(ecfg.max_num_seqs, 1)
        dd = DeviceDecode(self.pool, self.cache, self.policy, self.cpu_executor, cfg.num_experts, cfg.top_k, max_bs)
        self.experts.device_decode = dd
        if self._decode_inputs is None:
            self._decode_inputs = _DecodeInputs(self, max_bs)
        graphs = not ecfg.enforce_eager and dd.capturable and getattr(self.model, "supports_cuda_graphs", False)
        self.decode_path = "device + CUDA graphs" if graphs else "device"
        self.decode_path_reason = None if graphs else (
            "--enforce-eager" if ecfg.enforce_eager else
            "the CPU branch needs the native executor to be captured" if not dd.capturable else
            "this architecture is not captured yet")

    # ------------------------------------------------------------------ capacity
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds for requests (the padding rows' scratch page excluded)."""
        return self.kv.capacity_tokens - self._scratch_pages * self.kv.page_size

    def kv_free_tokens(self) -> int:
        return self.kv.free_tokens()

    def can_allocate(self, seq_id: int, total_len: int) -> bool:
        return self.kv.can_allocate(seq_id, total_len) and (self.state is None or self.state.can_hold(seq_id))

    def free(self, seq_id: int) -> None:
        self.kv.free(seq_id)
        if self.state is not None:
            self.state.free(seq_id)
            self._tokens.pop(seq_id, None)

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

    # ------------------------------------------------------------------ state checkpoints
    def set_state_checkpoints(self, slots: int, interval: int, anchors: bool = True) -> None:
        """(Re)build the recurrent-state checkpoint store (hybrid models; DESIGN.md §4) at a safe point
        between steps, dropping the checkpoints it held.

        Args:
            slots: checkpoints kept, LRU (0: none, so a hybrid model reuses no cached prefix).
            interval: also checkpoint every ``interval`` tokens (0: only at anchors).
            anchors: checkpoint after each anchor token (``anchor_token_ids`` of the tokenizer plus
                the model's EOS ids).

        Checkpoints need the prefix cache (the KV of a checkpoint's whole pages lives in its pages);
        without it, or without recurrent state, or when nothing would ever be checkpointed, no store
        is built (``self.checkpoints is None``).

        Raises:
            ValueError: negative ``slots`` or ``interval``.
        """
        if slots < 0 or interval < 0:
            raise ValueError(f"state checkpoints: slots ({slots}) and interval ({interval}) must be >= 0")
        self.checkpoint_interval = interval
        self.anchor_ids = anchor_token_ids(self.tokenizer, self.eos_token_ids) if anchors else frozenset()
        self._tokens: dict[int, array] = {}  # seq_id -> its tokens so far (the key of its checkpoints)
        if self.state is None:
            self.checkpoints = None
            return
        layers = self.model.state_layers()
        self.checkpoints = None  # the old store is released before the new one is allocated
        for layer in layers:
            layer.checkpoints = None
        if slots and self.kv.prefix_cache is not None and (self.anchor_ids or interval):
            cfg, kv = self.model_config, self.kv
            self.checkpoints = StateCheckpointStore(self.state.spec, slots, self.dtype, kv.k.shape[0], kv.page_size,
                                                    cfg.num_kv_heads, cfg.head_dim, kv.k.dtype, self.device)
            for layer in layers:
                layer.checkpoints = self.checkpoints

    def _track_tokens(self, inp: StepInput) -> array | None:
        """Append ``inp``'s tokens to its sequence's token record (cut back to ``start_pos`` first, which
        a rewind may need); ``None`` (and the record dropped) when the tokens before ``start_pos`` are
        unknown here, e.g. after a caller's :meth:`restore_state`."""
        tokens = self._tokens.get(inp.seq_id)
        if inp.start_pos == 0:
            tokens = array("q")
        elif tokens is None or len(tokens) < inp.start_pos:
            self._tokens.pop(inp.seq_id, None)
            return None
        else:
            del tokens[inp.start_pos:]
        tokens.extend(inp.token_ids)
        self._tokens[inp.seq_id] = tokens
        return tokens

    def _plan_checkpoints(self, inputs: list[StepInput]) -> list[list[tuple[int, int]]]:
        """Per input, ``(position, checkpoint slot)`` ascending for the positions this step passes where
        a checkpoint is due (after an anchor token, at a multiple of the interval), each slot reserved
        (pending) in the store. Only the deepest ``num_slots`` of a sequence are taken (no more can
        survive the step); positions already checkpointed with the same tokens are skipped."""
        store = self.checkpoints
        plans: list[list[tuple[int, int]]] = [[] for _ in inputs]
        if store is None:
            return plans
        for inp, plan in zip(inputs, plans):
            tokens = self._track_tokens(inp)
            if tokens is None:
                continue
            due = checkpoint_positions(inp.token_ids, inp.start_pos, self.anchor_ids, self.checkpoint_interval)
            for p in due[-store.num_slots:]:
                slot = store.reserve(tokens[:p])
                if slot is not None:
                    plan.append((p, slot))
        return plans

    def _commit_checkpoints(self, inputs: list[StepInput], state_slots: list[int | None],
                            plans: list[list[tuple[int, int]]], phase: Phase) -> None:
        """After a successful step: complete its checkpoints (a decode step's state is copied here; the
        layers saved a prefill step's) with the K/V rows of their partial last page."""
        store, kv = self.checkpoints, self.kv
        for inp, state_slot, plan in zip(inputs, state_slots, plans):
            for p, slot in plan:
                if phase is Phase.DECODE:
                    store.save_state(slot, self.state, state_slot)
                if p % kv.page_size:
                    store.save_kv(slot, kv.k, kv.v, kv.slots(inp.seq_id, p - p % kv.page_size, p))
                store.commit(slot)

    # ------------------------------------------------------------------ prefix cache
    def reusable_prefix(self, token_ids: list[int], n_matched: int) -> int:
        """How many of the ``n_matched`` leading tokens of ``token_ids`` whose KV pages are cached may
        really be skipped by prefill: all of them, since every layer of a model without recurrent
        state keeps its state in those pages (a hook for a model that can resume only at some
        positions). The caller floors the answer to a page boundary. Models with recurrent state do
        not come here: they resume at a state checkpoint (:meth:`attach_prefix`).
        """
        return n_matched

    def attach_prefix(self, seq_id: int, token_ids: list[int]) -> int:
        """Give the new sequence ``seq_id`` the longest reusable cached prefix of ``token_ids`` (the
        tokens it must hold, a prompt or, after preemption, prompt + output).

        At least the last token is always left to compute (its logits are needed); the match is
        trimmed by :meth:`reusable_prefix` and floored to whole pages. A model with recurrent state
        resumes instead at the deepest state checkpoint (DESIGN.md §4) whose tokens start
        ``token_ids`` and whose whole KV pages the tree holds: it borrows those pages, gets the
        checkpoint's partial-page K/V rows in a fresh page of its own and its recurrent state
        restored; without a usable checkpoint it reuses nothing.

        Returns:
            tokens reused: the sequence's prefill starts at this position (0 when prefix caching is off).
        """
        cache, ps = self.kv.prefix_cache, self.kv.page_size
        if cache is None or len(token_ids) <= ps:
            return 0
        match = cache.match_prefix(token_ids[:-1])
        if self.state is not None:
            return self._restore_checkpoint(seq_id, token_ids, match.num_tokens)
        n = min(self.reusable_prefix(token_ids, match.num_tokens), match.num_tokens) // ps * ps
        if n == 0:
            return 0
        if n < match.num_tokens:
            match = cache.match_prefix(token_ids[:n])
        self.kv.attach_prefix(seq_id, match)
        return n

    def _restore_checkpoint(self, seq_id: int, token_ids: list[int], kv_tokens: int) -> int:
        """Resume the new sequence ``seq_id`` at the deepest usable state checkpoint (``kv_tokens``:
        leading tokens whose whole pages are cached); returns its position, 0 (nothing attached) when
        none is usable, no state slot is free or no page is free for the partial page."""
        store = self.checkpoints
        if store is None or not self.state.can_hold(seq_id):
            return 0
        ids = array("q", token_ids)
        found = store.find(ids, len(ids) - 1, kv_tokens)
        if found is None:
            return 0
        ps, p = self.kv.page_size, found.num_tokens
        full = p // ps * ps
        if full:
            self.kv.attach_prefix(seq_id, self.kv.prefix_cache.match_prefix(token_ids[:full]))
        if p > full:
            try:
                self.kv.allocate(seq_id, p)
            except KVCacheFullError:
                self.kv.free(seq_id)
                return 0
            store.load_kv(found.slot, self.kv.k, self.kv.v, self.kv.slots(seq_id, full, p))
        self.state.restore(seq_id, store.snapshot(found.slot))
        self._tokens[seq_id] = ids[:p]
        return p

    def cache_prefix(self, seq_id: int, token_ids: list[int]) -> None:
        """Make the full KV pages of ``seq_id`` (holding ``token_ids`` from position 0) reusable by
        later requests (no-op when prefix caching is off)."""
        self.kv.cache_prefix(seq_id, token_ids)

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
        if need > self.kv.free_pages:
            raise KVCacheFullError(f"KV cache full: step needs {need} pages, {self.kv.free_pages} free")
        self._step += 1
        if self.cache.num_slots:
            self.cache.clock.fill_(self._step)
        state_slots = self._state_slots(inputs)
        plans = self._plan_checkpoints(inputs)
        self._observe_step(phase, len(inputs))
        if phase is Phase.DECODE and self.experts.device_decode is not None:
            for inp in inputs:
                self.kv.allocate(inp.seq_id, inp.start_pos + 1)
            return self._run_model(inputs, lambda: self._checked(self._execute_device_decode(inputs, state_slots)),
                                   state_slots, plans, phase)
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
        return self._run_model(inputs, lambda: self.model(batch), state_slots, plans, phase)

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        """With a CPU branch in the device decode step: wait for the step (the engine's sampling would
        anyway) and raise if that branch went wrong (``DeviceDecode.check``), so the engine fails
        those requests instead of sampling from logits that lack the CPU experts."""
        dd = self.experts.device_decode
        if dd.step is not None:
            torch.cuda.current_stream(self.device).synchronize()
            dd.check()
        return logits

    def _observe_step(self, phase: Phase, batch_size: int) -> None:
        """Feed an online policy (``adaptive``) the wall time of the previous decode step: the time
        from its start to this step's start, counted only between two decode steps of one batch size
        (the engine samples, a sync, in between). A rule change goes to the device policy tensor."""
        now = time.perf_counter()
        prev, self._last_decode = self._last_decode, (now, batch_size) if phase is Phase.DECODE else None
        observe = getattr(self.policy, "observe", None)
        if observe is None or prev is None or phase is not Phase.DECODE or prev[1] != batch_size:
            return
        if observe(now - prev[0], batch_size):
            dd = self.experts.device_decode
            if dd is not None:
                dd.policy.copy_(torch.tensor(self.policy.fill_rule(), dtype=torch.float64))

    def _run_model(self, inputs: list[StepInput], forward, state_slots: list[int | None],
                   plans: list[list[tuple[int, int]]], phase: Phase):
        """Run ``forward()`` (the model step); on failure drop the recurrent states it half-advanced and
        the checkpoints it planned (``can_resume`` then tells the engine to recompute), and re-raise."""
        try:
            logits = forward()
        except Exception:
            if self.state is not None:  # layers before the failure advanced these states: never reuse them
                for inp in inputs:
                    self.state.free(inp.seq_id)
                    self._tokens.pop(inp.seq_id, None)
                for plan in plans:
                    for _, slot in plan:
                        self.checkpoints.discard(slot)
            raise
        if self.checkpoints is not None:
            self._commit_checkpoints(inputs, state_slots, plans, phase)
        return logits

    def _execute_device_decode(self, inputs: list[StepInput], state_slots: list[int | None]) -> torch.Tensor:
        """A decode step on the device path: fixed-shape inputs, replayed from a CUDA graph when one is
        captured for the (padded) batch size; the first step of each size runs eagerly and captures."""
        B = len(inputs)
        d = self._decode_inputs
        sizes = [b for b in (*GRAPH_BATCH_SIZES, d.max_bs) if B <= b <= d.max_bs and b not in self.graphs_failed]
        use_graphs = self.decode_path == "device + CUDA graphs" and self.record is None and sizes
        sizes = sorted(sizes)
        bs = sizes[0] if use_graphs else B
        batch = d.load(self, inputs, state_slots, bs, self._step)
        if use_graphs and bs in self.graphs:
            graph, logits = self.graphs[bs]
            graph.replay()
            return logits[:B].clone()
        logits = self.model(batch)  # eager (and the warm-up of a capture: Triton compiles here)
        if use_graphs:
            try:
                self._capture(bs, batch)
            except Exception:  # noqa: BLE001 - this size stays eager; the eager result stands
                log.exception("capturing the decode step for batch size %d failed; it runs eagerly from now on", bs)
                self.graphs_failed.add(bs)
                torch.cuda.synchronize(self.device)
        return logits[:B]

    def _capture(self, bs: int, batch: ForwardBatch) -> None:
        """Capture the decode step for batch size ``bs`` over the static inputs (no kernel runs)."""
        graph = torch.cuda.CUDAGraph()
        batch.step_cache.clear()  # tensors derived during the eager step must be recomputed inside the graph
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(graph, pool=self.graph_pool):
            logits = self.model(batch)
        self.graphs[bs] = (graph, logits)
        log.info("captured the decode step for batch size %d", bs)

    # ------------------------------------------------------------------ reporting
    def expert_stats(self) -> dict:
        """Expert-cache state and counters (see ``CacheCounters``) for metrics and the summary."""
        bw = self.bandwidths
        return {
            "policy": self.policy.name,
            "slots": self.cache.num_slots,
            "slots_used": self.cache.slots_used,
            "experts_total": self.pool.num_ids,
            "b_p_gbps": bw.pcie,
            "b_h_gbps": bw.cpu,
            "bandwidth_source": bw.source,
            "q_ratio": self.policy.q_ratio(),
            "policy_active": getattr(self.policy, "active_name", self.policy.name),
            **self.experts.stats(),
        }

    def summary(self) -> str:
        """Start-up summary: device, budget, cache slots, B_P, B_H, q*/m."""
        cfg = self.model_config
        dev = str(self.device)
        if self.device.type == "cuda":
            dev += f" ({torch.cuda.get_device_name(self.device)}, {torch.cuda.mem_get_info(self.device)[1] / 2**30:.0f} GiB)"
        bw = self.bandwidths
        fmt = lambda v: "n/a" if v is None else f"{v:.1f} GB/s"  # noqa: E731
        lines = [
            f"edgemoe: {cfg.architecture} from {self.model_dir} ({self.weights_format}), "
            f"dtype {str(self.dtype).replace('torch.', '')}, loaded in {self.load_seconds:.1f} s",
            f"  device       {dev}; CPU executor {self.cpu_executor.name}, {self.cpu_executor.threads} threads",
            f"  experts      {cfg.num_moe_layers} MoE layers x {cfg.num_experts} experts, top-{cfg.top_k}; "
            f"host pool {self.pool.nbytes / 1e9:.2f} GB ({'pinned' if self.pinned else 'pageable'}"
            f"{': pinning refused, so policy cpu-all without expert cache' if self.pin_outcome.fallback else ''})",
            f"  expert cache {self.cache.num_slots} slots = {self.cache.nbytes / 1e9:.2f} GB "
            f"({100 * self.cache.num_slots / max(1, self.pool.num_ids):.1f}% of experts), policy {self.policy.name}",
            f"  bandwidth    B_P {fmt(bw.pcie)}, B_H {fmt(bw.cpu)} [{bw.source}]; q*/m = {self.policy.q_ratio():.3f}",
            f"  KV cache     {self.kv.capacity_tokens} tokens in pages of {self.kv.page_size}; max_model_len {self.max_model_len}; "
            f"prefix caching {'on' if self.kv.prefix_cache is not None else 'off'}",
            f"  decode path  {self.decode_path}" + (f" ({self.decode_path_reason})" if self.decode_path_reason else ""),
        ]
        if self.state is not None:
            lines.append(f"  state        {self.state.spec.num_layers} linear-attention layers, {self.state.num_slots} "
                         f"sequence slots = {self.state.nbytes / 1e9:.3f} GB")
            ck = self.checkpoints
            lines.append("  checkpoints  off" if ck is None else
                         f"  checkpoints  {ck.num_slots} slots = {ck.nbytes / 1e9:.3f} GB; at "
                         f"{len(self.anchor_ids)} anchor tokens, every {self.checkpoint_interval or '-'} tokens")
        return "\n".join(lines)


class _DecodeInputs:
    """Static (fixed-address) inputs of device-path decode steps, for batch sizes up to ``max_bs``.

    A step of ``B`` sequences padded to ``bs`` rows fills rows ``[0, bs)``; padding rows decode token 0
    at position 0 into a scratch KV page no sequence owns, attend to one key, and route like row 0
    with weight 0 (``ForwardBatch.decode.valid``), so they change nothing a real row reads.
    """

    def __init__(self, runner: "ModelRunner", max_bs: int):
        from edgemoe.kernels.decode_attention import make_decode_scratch

        dev, cfg, kv = runner.device, runner.model_config, runner.kv
        self.max_bs = max_bs
        self.max_pages = -(-runner.max_model_len // kv.page_size)
        self.scratch_page = kv.pages_of(_SCRATCH_SEQ)[0]  # reserved by the runner: the padding rows' page
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(max_bs, dtype=i64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=i64, device=dev)
        self.kv_slots = torch.zeros(max_bs, dtype=i64, device=dev)
        self.logits_index = torch.arange(max_bs, dtype=i64, device=dev)
        self.block_tables = torch.zeros(max_bs, self.max_pages, dtype=i32, device=dev)
        self.context_lens = torch.ones(max_bs, dtype=i32, device=dev)
        self.valid = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        self.state_slots = None
        if runner.state is not None:  # hybrid models: padding rows update a scratch recurrent-state slot
            self.state_slots = torch.zeros(max_bs, dtype=i64, device=dev)
            self.scratch_state = runner.state.slot(_SCRATCH_SEQ)  # reserved by the runner
        self.attn_scratch = make_decode_scratch(max_bs, cfg.num_heads, cfg.head_dim, runner.max_model_len, dev)
        # host staging: one pinned buffer per input, copied in with one transfer each
        pin = dev.type == "cuda"
        self._h_i64 = torch.zeros(4, max_bs, dtype=i64, pin_memory=pin)
        self._h_tables = torch.zeros(max_bs, self.max_pages, dtype=i32, pin_memory=pin)
        self._h_lens = torch.zeros(max_bs, dtype=i32, pin_memory=pin)
        self._h_valid = torch.zeros(max_bs, dtype=torch.bool, pin_memory=pin)

    def load(self, runner: "ModelRunner", inputs: list[StepInput], state_slots: list[int | None], bs: int,
             step: int) -> ForwardBatch:
        """Write ``inputs`` (one token each; their KV pages and state slots already allocated) into rows
        ``[0, bs)``."""
        kv, ps = runner.kv, runner.kv.page_size
        h = self._h_i64
        h[:, :bs] = 0
        h[2, :bs] = self.scratch_page * ps
        if self.state_slots is not None:
            h[3, :bs] = self.scratch_state
        self._h_tables[:bs] = self.scratch_page
        self._h_lens[:bs] = 1
        self._h_valid[:bs] = False
        seqs = []
        for row, inp in enumerate(inputs):
            pos = inp.start_pos
            pages = kv.pages_of(inp.seq_id)
            h[0, row], h[1, row] = inp.token_ids[0], pos
            h[2, row] = pages[pos // ps] * ps + pos % ps
            if self.state_slots is not None:
                h[3, row] = state_slots[row]
            self._h_tables[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._h_lens[row] = pos + 1
            self._h_valid[row] = True
            seqs.append(SeqSlice(inp.seq_id, row, 1, pos + 1, None, state_slots[row]))
        self.input_ids[:bs].copy_(h[0, :bs], non_blocking=True)
        self.positions[:bs].copy_(h[1, :bs], non_blocking=True)
        self.kv_slots[:bs].copy_(h[2, :bs], non_blocking=True)
        self.block_tables[:bs].copy_(self._h_tables[:bs], non_blocking=True)
        self.context_lens[:bs].copy_(self._h_lens[:bs], non_blocking=True)
        self.valid[:bs].copy_(self._h_valid[:bs], non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:bs].copy_(h[3, :bs], non_blocking=True)
        if runner.device.type == "cuda":  # the staging buffers are rewritten by the next step
            torch.cuda.current_stream(runner.device).synchronize()
        return ForwardBatch(
            phase=Phase.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            kv_slots=self.kv_slots[:bs], seqs=seqs, logits_index=self.logits_index[:bs], step=step,
            record=runner.record,
            decode=DecodeMeta(self.block_tables[:bs], self.context_lens[:bs], self.valid[:bs], self.attn_scratch),
            state_slots=None if self.state_slots is None else self.state_slots[:bs],
        )


_SCRATCH_SEQ = -1  # KV pool owner id of the padding rows' scratch page

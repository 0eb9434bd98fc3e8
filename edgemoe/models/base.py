"""The contract every architecture implements: :class:`MoECausalLM`.

An architecture is one file in ``edgemoe.models`` holding a subclass of :class:`MoECausalLM` with

- ``architectures`` / ``model_types``: the Hugging Face names it serves (the registry's keys);
- ``config_from_hf(raw)``: the architecture's ``config.json`` normalized into a
  :class:`~edgemoe.config.ModelConfig` (the only place its raw names are read);
- its layers, under the checkpoint's own parameter names, so non-expert weights load by name;
- ``attention_layers()`` (owners of KV pages) and ``kv_spec()`` (what one token stores per attention
  layer: grouped-query K/V by default, or one latent row for multi-head latent attention); for hybrid
  models, ``state_layers()`` and ``state_spec()`` (owners of recurrent state; empty by default);
- class-level capabilities (``supports_cuda_graphs``) and ``skipped_prefixes`` (checkpoint tensors a
  text-only server does not load, e.g. a vision tower or a multi-token-prediction head; the
  ``cfg.num_mtp_layers`` layers stored after the decoder are added per instance);
- ``float32_parameters``: parameter-name suffixes kept in float32 at every model dtype (as the
  reference's ``_keep_in_fp32_modules_strict``, e.g. a sigmoid router and its correction bias);
- ``fused_experts``: the layout of the checkpoint's fused ``[E, ...]`` expert tensors
  (:class:`FusedExpertLayout`: transposed and/or gate/up interleaved, gpt-oss's);
- for ``edgemoe make-model`` and the parity tests: ``hf_classes`` (the ``transformers`` config and
  model classes of the reference implementation, whose ``save_pretrained`` writes the release
  layout), ``presets`` (HF config kwargs of the geometries edgemoe tests and benchmarks with;
  ``fixed_vocab_presets`` keep their ``vocab_size`` instead of taking the tokenizer's) and
  ``synth_tokenizer`` (the name of the tokenizer flavour make-model builds: special tokens and chat
  template in the family's own markup, ``edgemoe.synth.tokenizer.TOKENIZERS``).

The base class supplies what every architecture shares: the checkpoint-name → expert-bank mapping
from the declared layer prefix (:meth:`MoECausalLM.expert_target`), :meth:`MoECausalLM.bind` (the
runner attaches the KV pool, the routed-expert executor, the recurrent-state pool and the state
checkpoints in one call) and the forward tail (embedding → decoder layers → final norm of the rows
whose logits are needed → LM head, tied or not). Models are built on the meta device; the weight
loader materializes them (:meth:`MoECausalLM.materialize`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from torch import nn

from edgemoe.config import ModelConfig
from edgemoe.core import ForwardBatch
from edgemoe.kvcache.pool import KVSpec
from edgemoe.layers.attention import FusedQKV
from edgemoe.layers.embedding import HostEmbedding
from edgemoe.layers.linear import Linear, UsesCpuDense, linear
from edgemoe.layers.moe import MoeBlock

if TYPE_CHECKING:
    from edgemoe.experts.native import DenseKernels
    from edgemoe.kvcache.pool import PagedKVPool
    from edgemoe.kvcache.state import RecurrentStatePool, StateSpec
    from edgemoe.kvcache.state_checkpoints import StateCheckpointStore

__all__ = ["ExpertTensor", "FusedExpertLayout", "MoECausalLM"]


class ExpertTensor(NamedTuple):
    """Where a checkpoint tensor of a routed expert goes in the host expert pool.

    Attributes:
        moe_layer: MoE-layer ordinal (index into ``ModelConfig.moe_layers``).
        expert: expert index within the layer; ``None`` for a fused tensor holding all ``E`` experts.
        role: ``gate_proj | up_proj | down_proj`` (per-expert release layout) or ``gate_up_proj |
            down_proj`` (fused ``[E, ...]`` layout of transformers 5 and of some releases).
        param: the tensor's parameter within its module: per expert ``weight`` or a quantized release's
            ``weight_scale_inv`` / ``weight_scale`` / ``weight_scale_2`` / ``weight_packed`` / ... (checked
            against the declared scheme by the checkpoint index); fused ``weight`` (float), or MXFP4's
            ``blocks`` / ``scales``, and ``bias`` (gpt-oss's ``gate_up_proj_blocks``, ``gate_up_proj_bias
            [E, 2I]``, ...).
    """

    moe_layer: int
    expert: int | None
    role: str
    param: str = "weight"


@dataclass(frozen=True)
class FusedExpertLayout:
    """How a fused ``[E, ...]`` expert tensor of a checkpoint stores each expert (transformers'
    ``use_experts_implementation(is_transposed=..., is_concatenated=...)``).

    Attributes:
        transposed: ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (inputs first), else
            ``[E, 2I, H]`` and ``[E, H, I]`` (outputs first, as ``nn.Linear`` weights).
        interleaved: gate output ``j`` at ``2j`` and up output ``j`` at ``2j + 1`` of ``gate_up_proj`` (and
            of its bias), else gate outputs then up outputs.

    The host pool always stores ``w13 [2I, H]`` as gate rows then up rows; the loader undoes both.
    """

    transposed: bool = False
    interleaved: bool = False


class MoECausalLM(UsesCpuDense, nn.Module):
    """A MoE causal LM over a :class:`~edgemoe.core.ForwardBatch`.

    ``forward(batch) -> logits [B, vocab] float32``, one row per sequence (its last new token).

    Args:
        cfg: the normalized config.
        decoder_prefix: checkpoint-name prefix of the decoder stack (``"model."``, or
            ``"model.language_model."`` for a multimodal layout); decoder layer ``i`` is
            ``{decoder_prefix}layers.{i}``.

    Subclasses set ``self.<first part of decoder_prefix>`` to a module holding ``embed_tokens``,
    ``layers`` and ``norm`` (see :attr:`decoder`), and build every decoder layer with a
    ``forward(x [T, H], batch) -> [T, H]``.
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[tuple[str, ...]] = ()
    supports_cuda_graphs: ClassVar[bool] = True
    skipped_prefixes: tuple[str, ...] = ()  # the class's; an instance adds its MTP layers
    float32_parameters: ClassVar[tuple[str, ...]] = ()
    expert_module: ClassVar[str] = "mlp.experts"
    fused_experts: ClassVar[FusedExpertLayout] = FusedExpertLayout()
    hf_classes: ClassVar[tuple[str, str]] = ("", "")
    presets: ClassVar[dict[str, dict]] = {}
    fixed_vocab_presets: ClassVar[frozenset[str]] = frozenset()
    synth_tokenizer: ClassVar[str] = "qwen3"

    def __init__(self, cfg: ModelConfig, decoder_prefix: str = "model."):
        super().__init__()
        self.config = cfg
        self.decoder_prefix = decoder_prefix
        self.skipped_prefixes = type(self).skipped_prefixes + tuple(
            f"{decoder_prefix}layers.{cfg.num_layers + i}." for i in range(cfg.num_mtp_layers))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        prefix = re.escape(f"{decoder_prefix}layers.")
        module = re.escape(self.expert_module)
        self._per_expert = re.compile(rf"^{prefix}(\d+)\.{module}\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
        self._fused = re.compile(rf"^{prefix}(\d+)\.{module}\.(gate_up_proj|down_proj)(?:_(blocks|scales|bias))?$")

    # ------------------------------------------------------------------ what a subclass provides
    @classmethod
    def config_from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> ModelConfig:
        """Normalize this architecture's HF config dict.

        Raises:
            ValueError: a missing or inconsistent field (the message names ``where``).
        """
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """The layers that own KV pages, in order (their index is their slot in the KV pool)."""
        raise NotImplementedError

    def kv_spec(self) -> KVSpec:
        """What one token stores per attention layer: by default grouped-query K/V of the config's
        ``num_kv_heads x head_dim``, for every layer of :meth:`attention_layers`."""
        return KVSpec.heads(len(self.attention_layers()), self.config.num_kv_heads, self.config.head_dim)

    def state_layers(self) -> list[nn.Module]:
        """The layers that own recurrent state (gated DeltaNet), in order; none by default."""
        return []

    def state_spec(self) -> StateSpec | None:
        """Per-sequence recurrent-state geometry for the runner's pool; ``None`` without state layers."""
        return None

    # ------------------------------------------------------------------ shared
    @classmethod
    def param_count(cls, cfg: ModelConfig) -> int:
        """Parameters of the checkpoint of ``cfg``: this model's own (built on the meta device) plus
        every routed expert (which live in the host pool, not in the module)."""
        with torch.device("meta"):
            model = cls(cfg)
        return sum(p.numel() for p in model.parameters()) + cfg.num_moe_layers * cfg.num_experts * cfg.expert_numel()

    @property
    def decoder(self) -> nn.Module:
        """The decoder stack (``embed_tokens``, ``layers``, ``norm``) at ``decoder_prefix``."""
        module: nn.Module = self
        for part in self.decoder_prefix.rstrip(".").split("."):
            module = module.get_submodule(part)
        return module

    def materialize(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the parameters (uninitialized) on ``device`` in ``dtype``, those matching
        ``float32_parameters`` in float32; the loaders then copy the checkpoint's values in.

        In a 16-bit dtype the attention layers' q/k/v projections are then fused
        (:meth:`fuse_projections`): their parameters become views of one matrix, so the loaders fill it
        under the checkpoint's names. float32 keeps them apart, the reference precision (as the fused
        norm kernels: ``edgemoe.layers.norm.fused_kernels``). On the CPU the fused matrix is one product
        only in a decode step's native GEMV (one dispatch to the executor's threads instead of three, the
        same result row by row); other CPU products keep the three GEMMs
        (:meth:`~edgemoe.layers.attention.FusedQKV.project_qkv`).

        A :class:`~edgemoe.layers.embedding.HostEmbedding` (:meth:`keep_embedding_on_host`) gets its table
        in (pageable) host memory instead, whatever ``device`` is; the runner pins it after filling.
        """
        self.to(dtype)
        for name, p in self.named_parameters():
            if name.endswith(self.float32_parameters):
                p.data = p.data.float()
        dec = self.decoder
        host = dec.embed_tokens if isinstance(dec.embed_tokens, HostEmbedding) else None
        if host is not None:  # kept out of the move: its table is allocated in host memory, never on `device`
            host.unpin()  # a second materialize replaces a table the runner registered
            dec.embed_tokens = None
        self.to_empty(device=device)
        if host is not None:
            dec.embed_tokens = host.to_empty(device="cpu")
        if dtype in (torch.bfloat16, torch.float16):
            self.fuse_projections()

    def keep_embedding_on_host(self) -> None:
        """Swap the token embedding (``embed_tokens``) for a :class:`~edgemoe.layers.embedding.HostEmbedding`
        of the same ``[V, H]`` and parameter name, before the weights are loaded: :meth:`materialize` then
        allocates its table in host memory, the loaders fill it as before, and each step gathers its
        ``T`` rows onto the compute device (``--token-embedding host``).

        Raises:
            ValueError: the model ties its LM head to the embedding (``tie_word_embeddings``: the LM
                head reads the whole table on the compute device every step).
            RuntimeError: the model is already materialized (its table would be lost).
        """
        if self.lm_head is None:
            raise ValueError(f"token_embedding host: {self.config.architecture} ties its LM head to the token "
                             "embedding (tie_word_embeddings), and the LM head reads the whole table on the GPU "
                             "every step, so it cannot stay in host memory; serve it with token_embedding device")
        dec = self.decoder
        if not dec.embed_tokens.weight.is_meta:
            raise RuntimeError("keep_embedding_on_host: call it before the weights are loaded (materialize)")
        with torch.device("meta"):
            dec.embed_tokens = HostEmbedding(*dec.embed_tokens.weight.shape)

    def weight_bytes(self) -> tuple[int, int]:
        """Bytes of the model's own parameters and buffers (routed experts live in the host pool, not
        here), as ``(on the compute device, in host memory)``: the host part is a
        :class:`~edgemoe.layers.embedding.HostEmbedding`'s table (:meth:`keep_embedding_on_host`), the
        device part what the GPU holds besides its caches."""
        host = {id(p) for m in self.modules() if isinstance(m, HostEmbedding) for p in m.parameters()}
        on_device = on_host = 0
        for t in (*self.parameters(), *self.buffers()):
            nbytes = t.numel() * t.element_size()
            if id(t) in host:
                on_host += nbytes
            else:
                on_device += nbytes
        return on_device, on_host

    def fuse_projections(self) -> None:
        """Fuse the q/k/v projections of every attention layer that has them
        (:class:`~edgemoe.layers.attention.FusedQKV`) into one GEMM each; values are kept (again after a
        second ``materialize``, which gives the parameters new storage)."""
        for m in self.modules():
            if isinstance(m, FusedQKV):
                m.fuse_qkv()

    def moe_blocks(self) -> list[MoeBlock]:
        """The routed-expert block of every MoE layer, in layer order."""
        return [m for m in self.decoder.layers.modules() if isinstance(m, MoeBlock)]

    def expert_target(self, name: str) -> ExpertTensor | None:
        """Map a checkpoint tensor name to its place in the expert pool; ``None`` for other tensors.

        Recognized: ``{decoder_prefix}layers.N.{expert_module}.E.{gate,up,down}_proj.PARAM`` (per
        expert; ``PARAM`` is ``weight`` or a quantized release's scale / packed tensor) and
        ``{decoder_prefix}layers.N.{expert_module}.{gate_up_proj,down_proj}`` (fused float, laid out as
        ``fused_experts`` says), with an MXFP4 suffix ``_blocks`` / ``_scales`` or a bias ``_bias`` (gpt-oss's
        fused release layouts).

        Raises:
            ValueError: an expert tensor of a layer that is not a MoE layer in this config.
        """
        m = self._per_expert.match(name)
        if m:
            layer, expert, role, param = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        else:
            m = self._fused.match(name)
            if not m:
                return None
            layer, expert, role, param = int(m.group(1)), None, m.group(2), m.group(3) or "weight"
        if layer not in self.config.moe_layers:
            raise ValueError(f"tensor {name}: layer {layer} is not a MoE layer in this config")
        return ExpertTensor(self.config.moe_ordinal(layer), expert, role, param)

    def bind(self, *, kv: PagedKVPool, experts: Any, state: RecurrentStatePool | None = None,
             checkpoints: StateCheckpointStore | None = None, dense: DenseKernels | None = None) -> None:
        """Attach the runner's per-model resources to the layers that use them (call again after any
        of them is rebuilt, e.g. an expert-cache resize).

        Args:
            kv: the paged KV pool (every attention layer).
            experts: the routed-expert executor (``edgemoe.experts.hybrid.HybridExperts``) of every
                MoE block.
            state: the recurrent-state pool (state layers; ``None`` without them).
            checkpoints: the recurrent-state checkpoint store, or ``None`` when off.
            dense: native single-call GEMVs, norms and decode attention for a CPU decode step
                (``edgemoe.experts.native.DenseKernels``: every module that uses them,
                :class:`~edgemoe.layers.linear.UsesCpuDense`: linear layers, routers, the LM head,
                RMSNorms and Qwen3-style attention), or ``None``: torch operations.
        """
        for m in self.modules():
            if isinstance(m, UsesCpuDense):
                m.cpu_dense = dense
        for attn in self.attention_layers():
            attn.kv = kv
        for layer in self.state_layers():
            layer.state, layer.checkpoints = state, checkpoints
        for blk in self.moe_blocks():
            blk.experts = experts

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        dec = self.decoder
        x = dec.embed_tokens(batch.input_ids)  # [T, H]
        for layer in dec.layers:
            x = layer(x, batch)
        x = dec.norm(x.index_select(0, batch.logits_index))  # [B, H]
        w = dec.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(x, w, None, self.cpu_dense).float()  # [B, V]

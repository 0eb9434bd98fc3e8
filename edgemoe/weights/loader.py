"""Strict loading of a Hugging Face safetensors checkpoint into a meta-built model and the expert pool.

The checkpoint is indexed and checked first (:class:`~edgemoe.weights.index.CheckpointIndex`: a
missing, unexpected or mis-shaped tensor, or a quantized tensor that does not fit the declared scheme,
is a :class:`~edgemoe.weights.index.CheckpointError` naming the file and the tensor, before a byte of
tensor data is read). Routed experts then go straight into the host pool's byte rows in their own
format (:func:`pool_layout`: FP8 / MXFP4 / NVFP4 experts stay packed; float experts take the compute
dtype), one :meth:`~edgemoe.quant.layout.ExpertLayout.pack_expert` per expert; everything else becomes
a parameter on the compute device, non-expert quantized linears dequantized
(:func:`~edgemoe.quant.weights.dequantize_linear`: float32 products, then the compute dtype).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from edgemoe.experts.pool import HostExpertPool
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.scheme import FP8_DEFAULT_BLOCK, QuantScheme, detect_scheme
from edgemoe.quant.weights import QuantizedWeight, WeightFormat
from edgemoe.weights.index import CheckpointError, CheckpointIndex, CheckpointPlan, ExpertGeometry, TensorInfo

__all__ = ["CheckpointError", "SafetensorsReader", "cast_to_layout", "deployed_layout", "dummy_layout", "init_dummy",
           "load_checkpoint", "pool_layout"]


class SafetensorsReader:
    """Open safetensors files read tensor by tensor (a :class:`~edgemoe.weights.index.TensorReader`); a context
    manager closing them.

    Raises (from its methods):
        CheckpointError: a tensor that cannot be read (file and tensor named).
    """

    def __init__(self, files: list[Path]):
        self._stack = ExitStack()
        self._handles = {f: self._stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in files}

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        try:
            return self._handles[info.file].get_tensor(info.name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{info.file}: tensor {info.name}: cannot read ({e})") from None

    def finite_tensor(self, info: TensorInfo) -> torch.Tensor:
        """:meth:`tensor`, checked to hold no NaN or infinity when it is a float tensor (one such weight in a norm,
        an embedding or an attention projection makes every output NaN). The check is one ``aminmax`` pass
        (a NaN or an infinity reaches the minimum or the maximum; on the 2-core development VM ~2.5 GB/s of
        bf16, against 0.2-0.4 GB/s for ``isfinite``); the values are counted only for the error.

        Raises:
            CheckpointError: as :meth:`tensor`, or a NaN or infinite value (file and tensor named, with the count).
        """
        t = self.tensor(info)
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                bad = int((~torch.isfinite(t)).sum())
                raise CheckpointError(f"{info.file}: tensor {info.name} holds {bad} NaN or infinite value(s) of "
                                      f"{t.numel()} (a corrupt weight: the model's output would be NaN)")
        return t

    def index(self, info: TensorInfo, i: int) -> torch.Tensor:
        try:
            return self._handles[info.file].get_slice(info.name)[i]
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{info.file}: tensor {info.name}[{i}]: cannot read ({e})") from None


def pool_layout(fmt: WeightFormat, geometry: ExpertGeometry, dtype: torch.dtype,
                scheme: QuantScheme) -> ExpertLayout:
    """The host pool's row layout for routed experts stored as ``fmt``: quantized formats are kept (packed
    rows; FP8 with the scheme's block), float experts are stored in the compute ``dtype``.

    Raises:
        LayoutError: a geometry the format cannot hold (e.g. MXFP4 with ``H`` not a multiple of 32).
    """
    if fmt.dense:
        fmt = WeightFormat.for_dtype(dtype)
    return ExpertLayout.build(fmt, geometry.hidden_size, geometry.moe_intermediate_size, has_bias=geometry.bias,
                              block_size=scheme.block_size or FP8_DEFAULT_BLOCK)


def cast_to_layout(w: QuantizedWeight, layout: ExpertLayout) -> QuantizedWeight:
    """A float weight cast to a float layout's dtype (other weights are returned as they are)."""
    if w.format.dense and layout.format.dense and w.format is not layout.format:
        return QuantizedWeight(layout.format, w.shape, w.data.to(layout.format.dtype))
    return w


def load_checkpoint(model: nn.Module, model_dir: str | Path, cfg, dtype: torch.dtype, device: torch.device,
                    progress: bool = True) -> HostExpertPool:
    """Fill ``model`` (built on the meta device) from the checkpoint in ``model_dir``; return the host expert
    pool holding its routed experts.

    Tensors under the model's ``skipped_prefixes`` (e.g. a vision tower a text-only server does not
    run) are skipped; every other tensor is loaded strictly. Experts come per expert
    (``...experts.{e}.{gate,up,down}_proj.weight`` and, quantized, its scale tensors) or fused per layer
    (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``, or transposed and gate/up
    interleaved as the model's ``fused_experts`` says, with fused biases ``..._bias``: gpt-oss's bf16
    layout; MXFP4: gpt-oss's ``experts.{gate_up,down}_proj_{blocks,scales}``; gate/up de-interleaved at pack
    time, biases into the rows' ``b13`` / ``b2`` sections).

    Args:
        model: an edgemoe model exposing ``expert_target(name)`` and ``skipped_prefixes``; its
            parameters may be on ``meta``.
        model_dir: the checkpoint directory.
        cfg: its :class:`~edgemoe.config.ModelConfig`.
        dtype: dtype of parameters and float experts after loading (the checkpoint's is cast; parameters in
            the model's ``float32_parameters`` stay float32), and the dtype quantized experts compute in.
        device: where non-expert parameters live.
        progress: a tqdm bar over tensors and experts.

    Returns:
        The :class:`~edgemoe.experts.pool.HostExpertPool` (layout :func:`pool_layout`), filled.

    Raises:
        CheckpointError: a truncated or malformed file, a missing shard, missing, unexpected or
            mis-shaped tensors, quantized tensors that do not fit the declared scheme, a scale that is NaN or
            infinite (one line naming the file and the tensor).
        QuantConfigError: a ``quantization_config`` edgemoe does not load.
    """
    geometry = ExpertGeometry.from_config(cfg)
    index = CheckpointIndex.open(model_dir)
    plan = index.check(model, geometry)
    layout = pool_layout(plan.expert_format or WeightFormat.for_dtype(dtype), geometry, dtype, plan.scheme)
    pool = HostExpertPool(geometry.num_rows, layout, dtype, cfg.expert_activation)
    model.materialize(dtype, device)
    _load_plan(model, pool, plan, index.files, progress)
    return pool


def _load_plan(model: nn.Module, pool: HostExpertPool, plan: CheckpointPlan, files: list[Path],
               progress: bool = True) -> None:
    """Copy a checked plan's tensors into ``model`` (materialized) and ``pool`` (one packed row per expert)."""
    params = dict(model.named_parameters())
    layout = pool.layout
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.params) + len(plan.quantized) + pool.num_ids, desc="loading weights",
                   unit="tensor", leave=False)
    try:
        with torch.no_grad(), SafetensorsReader(files) as reader:
            for name, info in plan.params.items():
                params[name].copy_(reader.finite_tensor(info))  # cast to the parameter's dtype
                if bar is not None:
                    bar.update(1)
            for name, q in plan.quantized.items():  # float32 products, then the parameter's dtype
                params[name].copy_(q.dequantize(plan.scheme, reader, params[name].dtype))
                if bar is not None:
                    bar.update(1)
            for fid in range(pool.num_ids):
                gate, up, down = (cast_to_layout(w, layout) for w in plan.expert_weights(fid, reader))
                b13, b2 = plan.expert_biases(fid, reader) or (None, None)
                layout.pack_expert(gate, up, down, b13=b13, b2=b2, out=pool.bank[fid])
                if bar is not None:
                    bar.update(1)
    finally:  # also on an error: its message then starts a line of its own
        if bar is not None:
            bar.close()


def dummy_layout(model: nn.Module, model_dir: str | Path, cfg, dtype: torch.dtype) -> ExpertLayout:
    """The row layout ``--load-format dummy`` fills: the format ``config.json`` declares for routed experts
    (its ``quantization_config``, unless it excludes the experts), else float rows of ``dtype``.

    Raises:
        QuantConfigError: a ``quantization_config`` edgemoe does not load.
    """
    scheme = detect_scheme(model_dir)
    layer = f"{model.decoder_prefix}layers.{cfg.moe_layers[0]}.{model.expert_module}" if cfg.moe_layers else ""
    excluded = scheme.excludes(layer) or scheme.excludes(f"{layer}.0.gate_proj")
    fmt = WeightFormat.for_dtype(dtype) if not scheme.quantized or excluded else WeightFormat.for_scheme(scheme)
    return pool_layout(fmt, ExpertGeometry.from_config(cfg), dtype, scheme)


def init_dummy(model: nn.Module, layout: ExpertLayout, cfg, dtype: torch.dtype, device: torch.device, seed: int,
               std: float = 0.02, progress: bool = True) -> HostExpertPool:
    """``--load-format dummy``: random weights of the full geometry, no disk.

    Norm weights are 1, every other parameter ``N(0, std)``; the expert pool (rows of ``layout``, e.g.
    :func:`dummy_layout`) gets distinct random rows of valid values (:meth:`HostExpertPool.fill_random`).

    Returns:
        The filled :class:`~edgemoe.experts.pool.HostExpertPool`.
    """
    model.materialize(dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * std)
    pool = HostExpertPool(ExpertGeometry.from_config(cfg).num_rows, layout, dtype, cfg.expert_activation)
    pool.fill_random(seed, std=std, progress=progress)
    return pool


def deployed_layout(model_dir: str | Path, dtype: torch.dtype, load_format: str = "auto") -> ExpertLayout:
    """The row layout the engine's host pool will hold for ``model_dir`` (what ``edgemoe profile`` measures),
    reading only metadata: an FTW directory's manifest (float rows in ``dtype``), a Hugging Face directory's
    safetensors headers checked against the model (:func:`pool_layout` of the experts' format), or for
    ``load_format="dummy"`` (or a directory without weights) ``config.json``'s declared scheme
    (:func:`dummy_layout`).

    Raises:
        CheckpointError / QuantConfigError / ValueError: as the corresponding loader would.
    """
    from edgemoe.models import load_config, model_class
    from edgemoe.weights.ftw import is_ftw, read_manifest

    d = Path(model_dir)
    cfg = load_config(d)
    if load_format != "dummy" and is_ftw(d):
        layout = read_manifest(d).expert_layout(d)
        if layout.format.dense:
            layout = ExpertLayout.build(WeightFormat.for_dtype(dtype), layout.hidden, layout.intermediate)
        return layout
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    if load_format == "dummy" or not any(d.glob("*.safetensors")):
        return dummy_layout(model, d, cfg, dtype)
    geometry = ExpertGeometry.from_config(cfg)
    plan = CheckpointIndex.open(d).check(model, geometry)
    return pool_layout(plan.expert_format or WeightFormat.for_dtype(dtype), geometry, dtype, plan.scheme)

"""Strict loading of a Hugging Face safetensors checkpoint into a meta-built model and the expert pool.

The checkpoint is indexed and checked first (:class:`~edgemoe.weights.index.CheckpointIndex`: a
missing, unexpected or mis-shaped tensor is a :class:`~edgemoe.weights.index.CheckpointError` naming
the file and the tensor, before a byte of tensor data is read). Routed experts then go straight into
the host expert pool rows (``w13`` = gate ‖ up, ``w2`` = down; expert biases into its bias banks);
everything else becomes a parameter on the compute device.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from edgemoe.experts.pool import HostExpertPool
from edgemoe.weights.index import CheckpointError, CheckpointIndex, ExpertGeometry

if TYPE_CHECKING:
    from edgemoe.models.base import FusedExpertLayout

__all__ = ["CheckpointError", "init_dummy", "load_checkpoint"]


def load_checkpoint(model: nn.Module, pool: HostExpertPool, model_dir: str | Path, dtype: torch.dtype,
                    device: torch.device, num_experts: int, progress: bool = True) -> None:
    """Fill ``model`` (built on the meta device) and ``pool`` from the checkpoint in ``model_dir``.

    Tensors under the model's ``skipped_prefixes`` (e.g. a vision tower a text-only server does not
    run) are skipped; every other tensor is loaded strictly. Experts come per expert
    (``...experts.{e}.{gate,up,down}_proj.weight``) or fused per layer (``experts.gate_up_proj
    [E, 2I, H]``, ``experts.down_proj [E, H, I]``; transposed and gate/up interleaved as the model's
    ``fused_experts`` says, with fused biases ``gate_up_proj_bias [E, 2I]`` / ``down_proj_bias [E, H]``:
    gpt-oss).

    Args:
        model: an edgemoe model exposing ``expert_target(name)``, ``skipped_prefixes`` and
            ``fused_experts``; its parameters may be on ``meta``.
        pool: host expert pool sized for the model (``w13 [N, 2I, H]``, ``w2 [N, H, I]``; bias banks when
            its activation has biases).
        model_dir: the checkpoint directory.
        dtype: dtype of parameters and experts after loading (the checkpoint's is cast; parameters in
            the model's ``float32_parameters`` stay float32).
        device: where non-expert parameters live.
        num_experts: ``E`` per MoE layer.
        progress: a tqdm bar over tensors.

    Raises:
        CheckpointError: a truncated or malformed file, a missing shard, missing, unexpected or
            mis-shaped tensors (one line naming the file and the tensor).
    """
    geometry = ExpertGeometry(pool.num_ids // num_experts, num_experts, pool.hidden, pool.intermediate,
                              pool.activation.bias)
    plan = CheckpointIndex.open(model_dir).check(model, geometry)
    layout = model.fused_experts
    model.materialize(dtype, device)
    params = dict(model.named_parameters())
    I, E = pool.intermediate, num_experts
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(plan.params) + len(plan.experts), desc="loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        for f, infos in plan.by_file().items():
            with safe_open(str(f), "pt", device="cpu") as h:
                for info in infos:
                    try:
                        t = h.get_tensor(info.name)
                    except (SafetensorError, OSError) as e:
                        raise CheckpointError(f"{f}: tensor {info.name}: cannot read ({e})") from None
                    x = plan.experts.get(info.name)
                    if x is None:
                        params[info.name].copy_(t)  # cast to the parameter's dtype
                    elif x.expert is None:  # fused [E, 2I, H] / [E, H, I], or as ``layout`` says
                        _copy_fused(pool, x.moe_layer * E, E, x.role, x.param, t, layout)
                    else:
                        row = x.moe_layer * E + x.expert
                        if x.role == "down_proj":
                            pool.w2[row].copy_(t)
                        else:
                            off = 0 if x.role == "gate_proj" else I
                            pool.w13[row, off:off + I].copy_(t)
                    if bar is not None:
                        bar.update(1)
    if bar is not None:
        bar.close()


def _copy_fused(pool: HostExpertPool, row: int, E: int, role: str, param: str, t: torch.Tensor,
                layout: FusedExpertLayout) -> None:
    """Copy one fused expert tensor of a MoE layer (``E`` experts from pool row ``row``) into the pool,
    undoing ``layout``: the transposition (``[E, H, 2I]`` -> ``[E, 2I, H]``) and the gate/up interleaving
    (gate output ``j`` at ``2j``, up at ``2j + 1`` -> gate rows then up rows), as transformers'
    ``GptOssExperts`` reads them (``gate_up[..., ::2]``, ``gate_up[..., 1::2]``)."""
    I = pool.intermediate
    if param == "bias":  # [E, 2I] or [E, H]
        if role == "down_proj":
            pool.b2[row:row + E].copy_(t)
        elif layout.interleaved:
            pool.b13[row:row + E, :I].copy_(t[:, 0::2])
            pool.b13[row:row + E, I:].copy_(t[:, 1::2])
        else:
            pool.b13[row:row + E].copy_(t)
        return
    if layout.transposed:
        t = t.transpose(1, 2)  # [E, 2I, H] / [E, H, I]
    if role == "down_proj":
        pool.w2[row:row + E].copy_(t)
    elif layout.interleaved:
        pool.w13[row:row + E, :I].copy_(t[:, 0::2])
        pool.w13[row:row + E, I:].copy_(t[:, 1::2])
    else:
        pool.w13[row:row + E].copy_(t)


def init_dummy(model: nn.Module, pool: HostExpertPool, dtype: torch.dtype, device: torch.device, seed: int,
               std: float = 0.02, progress: bool = True) -> None:
    """``--load-format dummy``: random weights of the full geometry, no disk.

    Norm weights are 1, every other parameter ``N(0, std)``; the expert pool gets distinct random rows.
    """
    model.materialize(dtype, device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * std)
    pool.fill_random(seed, std=std, progress=progress)

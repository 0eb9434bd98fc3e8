"""Strict loading of a Hugging Face safetensors checkpoint into a meta-built model and the expert pool.

Every tensor of the checkpoint must land somewhere and every parameter must be filled: a missing,
unexpected or mis-shaped tensor is a :class:`CheckpointError` naming the tensor and the file
(DESIGN.md §7). Routed experts go straight into the host expert pool rows (``w13`` = gate ‖ up,
``w2`` = down); everything else becomes a parameter on the compute device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from edgemoe.experts.pool import HostExpertPool


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names file and tensor."""


def checkpoint_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it.

    Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors`` in the directory.

    Raises:
        CheckpointError: no safetensors files, an index naming a missing file, or a tensor in two files.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    where: dict[str, Path] = {}
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        for name, fname in weight_map.items():
            f = d / fname
            if not f.exists():
                raise CheckpointError(f"{index}: tensor {name} is in {fname}, which does not exist")
            where[name] = f
        return where
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{d}: no *.safetensors files (and no model.safetensors.index.json)")
    for f in files:
        try:
            with safe_open(str(f), "pt") as h:
                for name in h.keys():
                    if name in where:
                        raise CheckpointError(f"tensor {name} appears in both {where[name].name} and {f.name}")
                    where[name] = f
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read safetensors header ({e})") from None
    return where


def _check(name: str, f: Path, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{f.name}: tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not t.is_floating_point():
        raise CheckpointError(f"{f.name}: tensor {name} has dtype {t.dtype}, expected a floating-point dtype")


def load_checkpoint(model: nn.Module, pool: HostExpertPool, model_dir: str | Path, dtype: torch.dtype,
                    device: torch.device, num_experts: int, progress: bool = True) -> None:
    """Fill ``model`` (built on the meta device) and ``pool`` from the checkpoint in ``model_dir``.

    Tensors under the model's ``skipped_prefixes`` (e.g. a vision tower a text-only server does not
    run) are skipped; every other tensor is loaded strictly.

    Args:
        model: an edgemoe model exposing ``expert_target(name)`` and ``skipped_prefixes``; its
            parameters may be on ``meta``.
        pool: host expert pool sized for the model.
        dtype: dtype of parameters and experts after loading (the checkpoint's is cast).
        device: where non-expert parameters live.
        num_experts: ``E`` per MoE layer.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped tensors (file and tensor named).
    """
    where = checkpoint_files(model_dir)
    model.to(dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    I, H = pool.intermediate, pool.hidden
    expected_experts = {(j, e, r) for j in range(pool.num_ids // num_experts) for e in range(num_experts)
                        for r in ("gate_proj", "up_proj", "down_proj")}
    seen_params: set[str] = set()
    by_file: dict[Path, list[str]] = {}
    where = {name: f for name, f in where.items() if not name.startswith(model.skipped_prefixes)}
    for name, f in where.items():
        by_file.setdefault(f, []).append(name)
    names_total = len(where)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=names_total, desc="loading weights", unit="tensor", leave=False)
    for f, names in by_file.items():
        with safe_open(str(f), "pt", device="cpu") as h:
            for name in names:
                target = model.expert_target(name)
                if target is not None:
                    j, e, role = target
                    t = h.get_tensor(name)
                    row = j * num_experts
                    if e is None:  # fused [E, ...] layout
                        shape = (num_experts, 2 * I, H) if role == "gate_up_proj" else (num_experts, H, I)
                        _check(name, f, t, shape)
                        (pool.w13 if role == "gate_up_proj" else pool.w2)[row:row + num_experts].copy_(t)
                        roles = ("gate_proj", "up_proj") if role == "gate_up_proj" else ("down_proj",)
                        for ee in range(num_experts):
                            for r in roles:
                                expected_experts.discard((j, ee, r))
                    else:
                        if e >= num_experts:
                            raise CheckpointError(f"{f.name}: tensor {name}: expert {e} >= num_experts {num_experts}")
                        if role == "down_proj":
                            _check(name, f, t, (H, I))
                            pool.w2[row + e].copy_(t)
                        else:
                            _check(name, f, t, (I, H))
                            off = 0 if role == "gate_proj" else I
                            pool.w13[row + e, off:off + I].copy_(t)
                        expected_experts.discard((j, e, role))
                elif name in params:
                    t = h.get_tensor(name)
                    _check(name, f, t, tuple(params[name].shape))
                    with torch.no_grad():
                        params[name].copy_(t.to(dtype))
                    seen_params.add(name)
                else:
                    raise CheckpointError(f"{f.name}: unexpected tensor {name} (not a parameter of "
                                          f"{type(model).__name__})")
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    missing = sorted(set(params) - seen_params)
    if missing:
        raise CheckpointError(f"{Path(model_dir)}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if expected_experts:
        j, e, r = sorted(expected_experts)[0]
        raise CheckpointError(f"{Path(model_dir)}: missing {len(expected_experts)} routed-expert tensor(s), "
                              f"first: MoE layer ordinal {j} expert {e} {r}")


def init_dummy(model: nn.Module, pool: HostExpertPool, dtype: torch.dtype, device: torch.device, seed: int,
               std: float = 0.02, progress: bool = True) -> None:
    """``--load-format dummy``: random weights of the full geometry, no disk.

    Norm weights are 1, every other parameter ``N(0, std)``; the expert pool gets distinct random rows.
    """
    model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=device, dtype=torch.float32) * std)
    pool.fill_random(seed, std=std, progress=progress)

"""The checkpoint index: what a Hugging Face checkpoint directory holds, and the strict checks against a model.

:class:`CheckpointIndex` enumerates the safetensors files of a directory (those named by
``model.safetensors.index.json``, else every ``*.safetensors``), reads each file's header (tensor
name, dtype, shape, byte range) without reading tensor data, and maps every tensor to its file.
:meth:`CheckpointIndex.check` then matches the tensors against a model built on the meta device:
every tensor must land somewhere and every parameter and routed expert must be filled, or a
:class:`CheckpointError` names the file and the tensor. The loader (:mod:`edgemoe.weights.loader`)
and the FTW converter (:mod:`edgemoe.weights.ftw.convert`) both load through the resulting
:class:`CheckpointPlan`, so both refuse the same checkpoints with the same messages.

The safetensors layout (the format's specification): an 8-byte little-endian header length ``n``,
``n`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
then the data; offsets are relative to the end of the header, and the tensors cover the data
exactly, without gaps.

The model supplies the architecture knowledge: ``model.expert_target(name)`` maps a checkpoint name
to ``(moe_layer, expert or None, role)`` for a routed expert (``None`` otherwise; ``ValueError`` for an
expert tensor of a layer that is not a MoE layer) and ``model.skipped_prefixes`` lists the prefixes a
text-only server does not load (a vision tower, a multi-token-prediction head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgemoe.weights.dtypes import dtype_from_safetensors

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointPlan",
    "ExpertGeometry",
    "ExpertTensor",
    "TensorInfo",
    "parse_safetensors_header",
    "read_safetensors_header",
]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_BIAS_PARTS = tuple(f"{p}.bias" for p in _EXPERT_PARTS)
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match the model.

    The message is one line that starts with the file (or the directory, for a missing tensor) and
    names the tensor where there is one.
    """


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header.

    Attributes:
        name: the checkpoint name. file: the file holding it.
        dtype: element dtype. shape: the tensor's shape.
        start, end: its byte range ``[start, end)`` in ``file`` (absolute offsets).
    """

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def parse_safetensors_header(head: bytes, file_size: int, path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check it against the file's size.

    Args:
        head: the file's first bytes: the 8-byte length and at least that many header bytes.
        file_size: the file's size in bytes.
        path: the file (named in errors; recorded in each :class:`TensorInfo`).

    Returns:
        ``{name: TensorInfo}`` in header order (``__metadata__`` left out).

    Raises:
        CheckpointError: a file too short for its header or its tensors (truncated: the first tensor
            past the end is named), bytes after the last tensor, a malformed header, an unknown dtype,
            or a tensor whose byte range does not fit its shape or leaves a gap.
    """
    if file_size < 8 or len(head) < 8:
        raise CheckpointError(f"{path}: not a safetensors file ({file_size} bytes; truncated?)")
    n = int.from_bytes(head[:8], "little")
    if n > _MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: not a safetensors file (header length {n} bytes)")
    if 8 + n > file_size:
        raise CheckpointError(f"{path}: truncated: {file_size} bytes, its safetensors header alone needs {8 + n}")
    try:
        header = json.loads(head[8:8 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a valid safetensors header (not a JSON object)")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtype_from_safetensors(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            b, e = (int(x) for x in entry["data_offsets"])
        except ValueError as exc:
            raise CheckpointError(f"{path}: tensor {name}: {exc}") from None
        except (KeyError, TypeError):
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {entry!r}") from None
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or not 0 <= b <= e or e - b != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: tensor {name}: data_offsets {[b, e]} do not fit shape {list(shape)} "
                                  f"{entry['dtype']}")
        out[name] = TensorInfo(name, path, dtype, shape, base + b, base + e)
    end = base
    for t in sorted(out.values(), key=lambda t: (t.start, t.end)):
        if t.end > file_size:
            raise CheckpointError(f"{path}: truncated: {file_size} bytes, tensor {t.name} needs bytes "
                                  f"[{t.start}, {t.end})")
        if t.start != end:
            raise CheckpointError(f"{path}: tensor {t.name}: bytes [{t.start}, {t.end}) leave a gap or overlap "
                                  f"(the data before it ends at byte {end})")
        end = t.end
    if end != file_size:
        raise CheckpointError(f"{path}: {file_size} bytes, but its tensors end at byte {end} (not a safetensors file)")
    return out


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Read and check the header of the safetensors file ``path`` (no tensor data is read).

    Raises:
        CheckpointError: a missing or unreadable file, or any fault :func:`parse_safetensors_header` finds.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) == 8:
                head += f.read(min(int.from_bytes(head, "little"), _MAX_HEADER_BYTES))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return parse_safetensors_header(head, size, path)


@dataclass(frozen=True)
class ExpertGeometry:
    """The routed experts of a model, as the host expert pool stores them.

    Attributes:
        num_moe_layers: MoE layers ``L``. num_experts: routed experts per layer ``E``.
        hidden_size: ``H``. moe_intermediate_size: ``I``.
        bias: every expert projection has a bias (gpt-oss), which the checkpoint must provide.
    """

    num_moe_layers: int
    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    bias: bool = False

    @classmethod
    def from_config(cls, cfg) -> ExpertGeometry:
        """From a :class:`~edgemoe.config.ModelConfig`."""
        return cls(cfg.num_moe_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                   cfg.expert_activation.bias)

    @property
    def num_rows(self) -> int:
        """``N = L * E`` experts; flat id ``moe_layer * E + expert``."""
        return self.num_moe_layers * self.num_experts

    def row_shapes(self) -> dict[str, tuple[int, int]]:
        """Shape of one expert in each pool bank: ``w13 (2I, H)`` (gate rows, then up), ``w2 (H, I)``."""
        H, I = self.hidden_size, self.moe_intermediate_size
        return {"w13": (2 * I, H), "w2": (H, I)}

    def tensor_shape(self, role: str, fused: bool, param: str = "weight", transposed: bool = False) -> tuple[int, ...]:
        """Checkpoint shape of an expert tensor: per expert ``gate_proj``/``up_proj`` ``[I, H]``,
        ``down_proj`` ``[H, I]``; fused ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``
        (``transposed``: ``[E, H, 2I]``, ``[E, I, H]``); fused biases ``gate_up_proj_bias [E, 2I]``,
        ``down_proj_bias [E, H]``."""
        H, I, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        if param == "bias":
            return (E, 2 * I) if role == "gate_up_proj" else (E, H)
        if fused:
            shape = (E, 2 * I, H) if role == "gate_up_proj" else (E, H, I)
            return (E, shape[2], shape[1]) if transposed else shape
        return (H, I) if role == "down_proj" else (I, H)


@dataclass(frozen=True)
class ExpertTensor:
    """A checkpoint tensor holding routed-expert weights.

    Attributes:
        info: the tensor. moe_layer: its MoE layer ordinal.
        expert: its expert, or ``None`` for a fused ``[E, ...]`` tensor of the whole layer.
        role: ``gate_proj | up_proj | down_proj`` per expert; ``gate_up_proj | down_proj`` fused.
        param: ``weight``, or ``bias`` (a fused expert bias, gpt-oss).
    """

    info: TensorInfo
    moe_layer: int
    expert: int | None
    role: str
    param: str = "weight"


@dataclass
class CheckpointPlan:
    """Where every checked tensor of a checkpoint goes (the result of :meth:`CheckpointIndex.check`).

    Attributes:
        params: model parameter name -> its tensor (names are the checkpoint's).
        experts: checkpoint name -> :class:`ExpertTensor`.
        parts: ``(flat id, "gate_proj" | "up_proj" | "down_proj")`` -> the expert tensor holding that
            projection of expert ``flat id = moe_layer * E + expert`` (a fused tensor holds it at
            index ``expert``); every part of every expert is present. Experts with biases also have
            ``"gate_proj.bias" | "up_proj.bias" | "down_proj.bias"`` parts.
    """

    params: dict[str, TensorInfo] = field(default_factory=dict)
    experts: dict[str, ExpertTensor] = field(default_factory=dict)
    parts: dict[tuple[int, str], ExpertTensor] = field(default_factory=dict)

    def by_file(self) -> dict[Path, list[TensorInfo]]:
        """The tensors to read, grouped by file (files sorted by path, tensors by offset)."""
        out: dict[Path, list[TensorInfo]] = {}
        for info in sorted([*self.params.values(), *(x.info for x in self.experts.values())],
                           key=lambda t: (str(t.file), t.start)):
            out.setdefault(info.file, []).append(info)
        return out

    def expert_dtypes(self) -> set[torch.dtype]:
        """The dtypes of the expert tensors."""
        return {x.info.dtype for x in self.experts.values()}


def _first(names: list[str], n: int = 5) -> str:
    return f"{names[:n]}{' ...' if len(names) > n else ''}"


class CheckpointIndex:
    """The tensors of a checkpoint: name -> :class:`TensorInfo`, from the safetensors headers.

    Build one with :meth:`open` (a checkpoint directory), or directly from tensors already parsed
    (e.g. an FTW directory's ``non_expert.safetensors`` read into memory).

    Attributes:
        source: the directory (or file) named in "missing tensor" errors.
        tensors: name -> tensor, every file's tensors.
    """

    def __init__(self, source: Path, tensors: dict[str, TensorInfo]):
        self.source = source
        self.tensors = tensors

    @property
    def files(self) -> list[Path]:
        """The safetensors files, in index order."""
        return list(dict.fromkeys(t.file for t in self.tensors.values()))

    @classmethod
    def open(cls, model_dir: str | Path) -> CheckpointIndex:
        """Index the checkpoint directory ``model_dir``.

        The files are those ``model.safetensors.index.json`` names (other ``*.safetensors`` files,
        e.g. a consolidated copy, are not read), else every ``*.safetensors`` of the directory.

        Raises:
            CheckpointError: no safetensors files; an index that is not valid JSON, names a missing
                shard or maps a tensor to a shard without it; a tensor in two shards; a truncated or
                malformed file (see :func:`parse_safetensors_header`).
        """
        d = Path(model_dir)
        index = d / INDEX_FILE
        weight_map: dict[str, str] | None = None
        if index.exists():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map is not an object of file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
            files = [d / name for name in dict.fromkeys(weight_map.values())]
            for f in files:
                if not f.is_file():
                    name = next(k for k, v in weight_map.items() if d / v == f)
                    raise CheckpointError(f"{f}: missing shard ({index.name} maps tensor {name} to it)")
        else:
            files = sorted(d.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{d}: no *.safetensors files (and no {INDEX_FILE})")
        tensors: dict[str, TensorInfo] = {}
        for f in files:
            for name, info in read_safetensors_header(f).items():
                if name in tensors:
                    raise CheckpointError(f"{f}: tensor {name} is also in {tensors[name].file.name} "
                                          f"(a tensor in two shards)")
                tensors[name] = info
        for name, fname in (weight_map or {}).items():
            if name not in tensors or tensors[name].file != d / fname:
                raise CheckpointError(f"{d / fname}: no tensor {name}, which {index.name} maps to this file")
        return cls(d, tensors)

    def check(self, model: nn.Module, experts: ExpertGeometry | None) -> CheckpointPlan:
        """Match the tensors against ``model`` (built on the meta device) strictly.

        Args:
            model: an edgemoe model: ``named_parameters()`` (the non-expert parameters, any device),
                ``expert_target(name)``, ``skipped_prefixes`` and ``fused_experts`` (the layout of fused
                expert tensors).
            experts: the routed experts the checkpoint must provide (every projection of every expert,
                per expert or fused), or ``None`` when this checkpoint must hold none (the routed
                experts come from elsewhere, e.g. FTW banks).

        Returns:
            The :class:`CheckpointPlan` (tensors under ``model.skipped_prefixes`` left out).

        Raises:
            CheckpointError: one line naming the file and the tensor: a tensor that is not
                floating-point, an unexpected tensor, a shape that differs from the parameter's or the
                expert geometry's, an expert tensor of a layer that is not a MoE layer, an expert index
                ``>= E``, two tensors giving the same expert projection, expert biases for experts
                without biases; or, naming ``source``, missing parameters or missing expert projections
                or biases.
        """
        params = {name: tuple(p.shape) for name, p in model.named_parameters()}
        model_name = type(model).__name__
        plan = CheckpointPlan()
        for name, info in self.tensors.items():
            f = info.file
            if name.startswith(model.skipped_prefixes):  # e.g. a vision tower: not loaded, not converted
                continue
            if not info.dtype.is_floating_point:
                raise CheckpointError(f"{f}: tensor {name} has dtype {info.dtype}, expected a floating-point dtype")
            try:
                target = model.expert_target(name)
            except ValueError as e:
                raise CheckpointError(f"{f}: {e}") from None
            if target is None:
                if name not in params:
                    raise CheckpointError(f"{f}: unexpected tensor {name} (not a parameter of {model_name})")
                if info.shape != params[name]:
                    raise CheckpointError(f"{f}: tensor {name} has shape {info.shape}, expected {params[name]}")
                plan.params[name] = info
                continue
            if experts is None:
                raise CheckpointError(f"{f}: unexpected tensor {name} (a routed expert, which this file must not hold)")
            j, e, role, param = target
            fused = e is None
            if param == "bias" and not experts.bias:
                raise CheckpointError(f"{f}: tensor {name}: routed-expert biases, but {model_name}'s experts "
                                      "have none in this config")
            want = experts.tensor_shape(role, fused, param, model.fused_experts.transposed)
            if not fused and e >= experts.num_experts:
                raise CheckpointError(f"{f}: tensor {name}: expert {e} >= num_experts {experts.num_experts}")
            if info.shape != want:
                raise CheckpointError(f"{f}: tensor {name} has shape {info.shape}, expected {want}")
            x = plan.experts[name] = ExpertTensor(info, j, e, role, param)
            suffix = ".bias" if param == "bias" else ""
            for ee in (range(experts.num_experts) if fused else (e,)):
                for part in (_FUSED_PARTS[role] if fused else (role,)):
                    key = (j * experts.num_experts + ee, part + suffix)
                    if key in plan.parts:
                        other = plan.parts[key].info
                        raise CheckpointError(f"{f}: tensor {name}: MoE layer ordinal {j} expert {ee} {key[1]} is also "
                                              f"given by {other.name} in {other.file.name}")
                    plan.parts[key] = x
        missing = sorted(set(params) - set(plan.params))
        if missing:
            raise CheckpointError(f"{self.source}: missing tensor(s) {_first(missing)}")
        if experts is not None:
            wanted = _EXPERT_PARTS + (_BIAS_PARTS if experts.bias else ())
            absent = [(fid, part) for fid in range(experts.num_rows) for part in wanted
                      if (fid, part) not in plan.parts]
            if absent:
                fid, part = absent[0]
                raise CheckpointError(f"{self.source}: missing {len(absent)} routed-expert tensor(s), first: MoE layer "
                                      f"ordinal {fid // experts.num_experts} expert {fid % experts.num_experts} {part}")
        return plan

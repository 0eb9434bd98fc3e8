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

Quantized releases (FP8 block-128, NVFP4 ModelOpt / compressed-tensors, gpt-oss MXFP4; the scheme
``config.json`` declares, :func:`edgemoe.quant.scheme.detect_scheme`) are checked tensor by tensor
against the scheme (:func:`edgemoe.quant.weights.validate_linear`, ``validate_mxfp4_experts``: dtype,
shape and scale shape), from the headers alone. A non-expert linear stored quantized is planned for
dequantization at load (:class:`QuantizedLinear`); routed experts keep their format
(:class:`ExpertSource`, :meth:`CheckpointPlan.expert_weights`), one format for every expert.

The model supplies the architecture knowledge: ``model.expert_target(name)`` maps a checkpoint name
to ``(moe_layer, expert or None, role)`` for a routed expert (``None`` otherwise; ``ValueError`` for an
expert tensor of a layer that is not a MoE layer) and ``model.skipped_prefixes`` lists the prefixes a
text-only server does not load (a vision tower, a multi-token-prediction head).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from edgemoe.quant.scheme import QuantMethod, QuantScheme, detect_scheme
from edgemoe.quant.weights import (
    QuantizedWeight,
    QuantTensorError,
    TensorMeta,
    WeightFormat,
    check_scale_values,
    dequantize_linear,
    gpt_oss_gate_up,
    linear_weight,
    mxfp4_expert_weight,
    validate_linear,
    validate_mxfp4_experts,
)
from edgemoe.weights.dtypes import dtype_from_safetensors

__all__ = [
    "INDEX_FILE",
    "CheckpointError",
    "CheckpointIndex",
    "CheckpointPlan",
    "ExpertGeometry",
    "ExpertSource",
    "QuantizedLinear",
    "TensorInfo",
    "TensorReader",
    "parse_safetensors_header",
    "read_safetensors_header",
]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# parameters a quantized release adds to a linear module M beside (or instead of) M.weight
QUANT_PARAMS = frozenset({"weight_scale_inv", "weight_scale", "weight_scale_2", "weight_packed", "weight_global_scale",
                          "input_scale", "input_global_scale"})


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

    def tensor_shape(self, role: str, fused: bool, transposed: bool = False) -> tuple[int, ...]:
        """Checkpoint shape of a float expert tensor: per expert ``gate_proj``/``up_proj`` ``[I, H]``,
        ``down_proj`` ``[H, I]``; fused ``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``
        (``transposed``: ``[E, H, 2I]``, ``[E, I, H]``, gpt-oss's bf16 release)."""
        H, I, E = self.hidden_size, self.moe_intermediate_size, self.num_experts
        if fused:
            shape = (E, 2 * I, H) if role == "gate_up_proj" else (E, H, I)
            return (E, shape[2], shape[1]) if transposed else shape
        return (H, I) if role == "down_proj" else (I, H)

    def bias_shape(self, role: str) -> tuple[int, int]:
        """Checkpoint shape of a fused expert bias: ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]``."""
        E = self.num_experts
        return (E, 2 * self.moe_intermediate_size) if role == "gate_up_proj" else (E, self.hidden_size)

    def projection_shape(self, role: str) -> tuple[int, int]:
        """``(out, in)`` of one expert's projection: ``gate_proj``/``up_proj`` ``(I, H)``, ``gate_up_proj``
        ``(2I, H)``, ``down_proj`` ``(H, I)``."""
        H, I = self.hidden_size, self.moe_intermediate_size
        return {"gate_proj": (I, H), "up_proj": (I, H), "gate_up_proj": (2 * I, H), "down_proj": (H, I)}[role]


class TensorReader(Protocol):
    """What :meth:`CheckpointPlan.expert_weights` reads tensors through (the loader's open safetensors files)."""

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor ``info``."""

    def index(self, info: TensorInfo, i: int) -> torch.Tensor:
        """``tensor(info)[i]``, reading only that slice (one expert of a fused ``[E, ...]`` tensor)."""


@dataclass(frozen=True)
class QuantizedLinear:
    """A non-expert linear stored quantized in the checkpoint; the loader dequantizes it into its parameter.

    Attributes:
        module: the module name (``model.layers.0.self_attn.q_proj``). shape: its ``(out, in)``.
        tensors: parameter (``weight``, ``weight_scale_inv``, ``weight_packed``, ...) -> tensor.
    """

    module: str
    shape: tuple[int, int]
    tensors: dict[str, TensorInfo]

    @property
    def file(self) -> Path:
        """The file of the module's weight (for messages)."""
        return (self.tensors.get("weight") or next(iter(self.tensors.values()))).file

    def dequantize(self, scheme: QuantScheme, reader: TensorReader, dtype: torch.dtype) -> torch.Tensor:
        """The module's weight ``[out, in]`` in ``dtype`` (:func:`~edgemoe.quant.weights.dequantize_linear`).

        Raises:
            CheckpointError: a tensor that cannot be read, or a scale that is NaN or infinite (or a
                compressed-tensors global scale of 0); the file and the tensor named.
        """
        t = {p: reader.tensor(info) for p, info in self.tensors.items()}
        try:
            return dequantize_linear(scheme, self.module, t, self.shape, str(self.file), dtype)
        except QuantTensorError as e:
            raise CheckpointError(str(e)) from None


@dataclass(frozen=True)
class ExpertSource:
    """Checkpoint tensors holding routed-expert projections: one module of one expert, or one fused tensor
    group of a whole MoE layer.

    Attributes:
        module: per expert ``...mlp.experts.7.gate_proj``; fused ``...mlp.experts``.
        moe_layer: its MoE layer ordinal. expert: its expert, ``None`` for a fused ``[E, ...]`` group.
        role: ``gate_proj | up_proj | down_proj`` per expert; ``gate_up_proj | down_proj`` fused.
        tensors: parameter -> tensor: per expert ``weight`` and the scheme's scale tensors; fused float
            ``weight``; fused MXFP4 ``blocks`` and ``scales`` (gpt-oss's ``*_blocks`` / ``*_scales``); fused
            ``bias`` (gpt-oss's ``*_bias``, ``[E, 2I]`` / ``[E, H]``).
        format: the projection's storage format (checked against the scheme).
        shape: ``(out, in)`` of one expert's projection.
        transposed: a fused float tensor stores inputs first (``[E, H, 2I]`` / ``[E, I, H]``).
        interleaved: fused ``gate_up_proj`` rows (and its bias) alternate gate and up (gpt-oss: gate row ``j``
            at ``2j``, up row ``j`` at ``2j + 1``); MXFP4 blocks always do.
    """

    module: str
    moe_layer: int
    expert: int | None
    role: str
    tensors: dict[str, TensorInfo]
    format: WeightFormat
    shape: tuple[int, int]
    transposed: bool = False
    interleaved: bool = False

    @property
    def first(self) -> TensorInfo:
        """The group's main tensor (its weight / blocks), for messages."""
        for p in ("weight", "weight_packed", "blocks"):
            if p in self.tensors:
                return self.tensors[p]
        return next(iter(self.tensors.values()))

    def read(self, expert: int, scheme: QuantScheme, reader: TensorReader) -> dict[str, QuantizedWeight]:
        """This source's projections of layer-local ``expert`` in canonical form (``{part: weight}``).

        Fused ``gate_up_proj`` is split into gate rows ``[0, I)`` and up rows ``[I, 2I)``; MXFP4's
        gate/up interleaving (gpt-oss: gate row ``j`` at ``2j``, up row ``j`` at ``2j + 1``) is undone.

        Raises:
            CheckpointError: a tensor that cannot be read, or a scale that is NaN or infinite (or a
                compressed-tensors global scale of 0); the file and the tensor named.
        """
        if self.expert is not None:
            t = {p: reader.tensor(info) for p, info in self.tensors.items()}
            try:
                return {self.role: linear_weight(scheme, self.module, t, self.shape, str(self.first.file))}
            except QuantTensorError as e:
                raise CheckpointError(str(e)) from None
        if self.format is WeightFormat.MXFP4:
            blocks, scales = reader.index(self.tensors["blocks"], expert), reader.index(self.tensors["scales"], expert)
            info = self.tensors["scales"]
            try:
                check_scale_values(scales, f"{info.name}[{expert}]", str(info.file))
            except QuantTensorError as e:
                raise CheckpointError(str(e)) from None
            if self.role == "down_proj":
                return {"down_proj": mxfp4_expert_weight(blocks, scales)}
            gate, up, _ = gpt_oss_gate_up(blocks, scales)
            return {"gate_proj": gate, "up_proj": up}
        t = reader.index(self.tensors["weight"], expert)  # [2I, H] or [H, I] (transposed: [H, 2I] or [I, H])
        if self.transposed:
            t = t.t().contiguous()
        if self.role == "down_proj":
            return {"down_proj": QuantizedWeight(self.format, self.shape, t)}
        i = self.shape[0] // 2
        gate, up = (t[0::2], t[1::2]) if self.interleaved else (t[:i], t[i:])
        return {"gate_proj": QuantizedWeight(self.format, (i, self.shape[1]), gate.contiguous()),
                "up_proj": QuantizedWeight(self.format, (i, self.shape[1]), up.contiguous())}

    def read_bias(self, expert: int, reader: TensorReader) -> torch.Tensor:
        """Layer-local ``expert``'s bias of this fused source, float32: ``gate_up_proj`` ``[2I]`` (gate's, then
        up's: the interleaving undone), ``down_proj`` ``[H]``."""
        b = reader.index(self.tensors["bias"], expert).float()
        if self.role == "gate_up_proj" and (self.interleaved or self.format is WeightFormat.MXFP4):
            b = torch.cat((b[0::2], b[1::2]))
        return b


@dataclass
class CheckpointPlan:
    """Where every checked tensor of a checkpoint goes (the result of :meth:`CheckpointIndex.check`).

    Attributes:
        scheme: the quantization the checkpoint declares.
        params: model parameter name -> its float tensor (names are the checkpoint's).
        quantized: model parameter name (``M.weight``) -> the :class:`QuantizedLinear` to dequantize into it.
        experts: expert module (per expert) or ``module.role`` (fused) -> :class:`ExpertSource`.
        parts: ``(flat id, "gate_proj" | "up_proj" | "down_proj")`` -> the source holding that projection of
            expert ``flat id = moe_layer * E + expert``; every part of every expert is present.
        num_experts: ``E``.
        expert_format: the routed experts' format (the first expert's; every expert shares it, float
            dtypes aside), ``None`` without experts.
    """

    scheme: QuantScheme = field(default_factory=lambda: QuantScheme(QuantMethod.NONE))
    params: dict[str, TensorInfo] = field(default_factory=dict)
    quantized: dict[str, QuantizedLinear] = field(default_factory=dict)
    experts: dict[str, ExpertSource] = field(default_factory=dict)
    parts: dict[tuple[int, str], ExpertSource] = field(default_factory=dict)
    num_experts: int = 0
    expert_format: WeightFormat | None = None

    def by_file(self) -> dict[Path, list[TensorInfo]]:
        """The tensors to read, grouped by file (files sorted by path, tensors by offset)."""
        out: dict[Path, list[TensorInfo]] = {}
        infos = [*self.params.values(), *(t for q in self.quantized.values() for t in q.tensors.values()),
                 *(t for x in self.experts.values() for t in x.tensors.values())]
        for info in sorted(infos, key=lambda t: (str(t.file), t.start)):
            out.setdefault(info.file, []).append(info)
        return out

    def expert_dtypes(self) -> set[torch.dtype]:
        """The dtypes of float expert tensors (empty for quantized experts)."""
        return {x.first.dtype for x in self.experts.values() if x.format.dense}

    def expert_weights(self, fid: int,
                       reader: TensorReader) -> tuple[QuantizedWeight, QuantizedWeight, QuantizedWeight]:
        """Expert ``fid``'s ``(gate [I, H], up [I, H], down [H, I])`` in canonical form (formats as stored).

        Raises:
            CheckpointError: a tensor that cannot be read (the reader names the file and the tensor), or a
                scale that is NaN or infinite (:meth:`ExpertSource.read`).
        """
        got: dict[str, QuantizedWeight] = {}
        for part in _EXPERT_PARTS:
            if part not in got:
                got.update(self.parts[(fid, part)].read(fid % self.num_experts, self.scheme, reader))
        return got["gate_proj"], got["up_proj"], got["down_proj"]

    def expert_biases(self, fid: int, reader: TensorReader) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert ``fid``'s float32 ``(b13 [2I] (gate's, then up's), b2 [H])``, or ``None`` for experts
        without biases."""
        if (fid, "down_proj.bias") not in self.parts:
            return None
        e = fid % self.num_experts
        return (self.parts[(fid, "gate_proj.bias")].read_bias(e, reader),
                self.parts[(fid, "down_proj.bias")].read_bias(e, reader))


def _first(names: list[str], n: int = 5) -> str:
    return f"{names[:n]}{' ...' if len(names) > n else ''}"


class CheckpointIndex:
    """The tensors of a checkpoint: name -> :class:`TensorInfo`, from the safetensors headers.

    Build one with :meth:`open` (a checkpoint directory), or directly from tensors already parsed
    (e.g. an FTW directory's ``non_expert.safetensors`` read into memory).

    Attributes:
        source: the directory (or file) named in "missing tensor" errors.
        tensors: name -> tensor, every file's tensors.
        scheme: the quantization the checkpoint declares (:func:`~edgemoe.quant.scheme.detect_scheme`;
            unquantized by default).
    """

    def __init__(self, source: Path, tensors: dict[str, TensorInfo], scheme: QuantScheme | None = None):
        self.source = source
        self.tensors = tensors
        self.scheme = scheme if scheme is not None else QuantScheme(QuantMethod.NONE, source=str(source))

    @property
    def files(self) -> list[Path]:
        """The safetensors files, in index order."""
        return list(dict.fromkeys(t.file for t in self.tensors.values()))

    @classmethod
    def open(cls, model_dir: str | Path) -> CheckpointIndex:
        """Index the checkpoint directory ``model_dir``.

        The files are those ``model.safetensors.index.json`` names (other ``*.safetensors`` files,
        e.g. a consolidated copy, are not read), else every ``*.safetensors`` of the directory. The
        quantization scheme is read from ``config.json`` (and ``hf_quant_config.json``) when present.

        Raises:
            QuantConfigError: a ``quantization_config`` edgemoe cannot load (file and field named).
            CheckpointError: no safetensors files; an FTW directory without its manifest (an expert bank
                beside ``non_expert.safetensors``); an index that is not valid JSON, names a missing shard or
                maps a tensor to a shard without it; a tensor in two shards; a truncated or malformed file (see
                :func:`parse_safetensors_header`).
        """
        from edgemoe.weights.ftw.spec import BANK_FILE, MANIFEST, NON_EXPERT_FILE  # the FTW package imports this one

        d = Path(model_dir)
        if (d / BANK_FILE).is_file() and (d / NON_EXPERT_FILE).is_file() and not (d / MANIFEST).exists():
            raise CheckpointError(f"{d / MANIFEST}: missing: {d} holds {BANK_FILE} and {NON_EXPERT_FILE}, an FTW "
                                  "expert bank without its manifest; copy ftw.json too, or re-run `edgemoe convert`")
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
        scheme = detect_scheme(d) if (d / "config.json").is_file() else None
        return cls(d, tensors, scheme)

    def check(self, model: nn.Module, experts: ExpertGeometry | None) -> CheckpointPlan:
        """Match the tensors against ``model`` (built on the meta device) strictly, under :attr:`scheme`.

        Args:
            model: an edgemoe model: ``named_parameters()`` (the non-expert parameters, any device),
                ``expert_target(name)`` and ``skipped_prefixes``.
            experts: the routed experts the checkpoint must provide (every projection of every expert,
                per expert or fused, float or quantized), or ``None`` when this checkpoint must hold none
                (the routed experts come from elsewhere, e.g. FTW banks).

        Returns:
            The :class:`CheckpointPlan` (tensors under ``model.skipped_prefixes`` left out).

        Raises:
            CheckpointError: one line naming the file and the tensor: a float tensor of another shape or
                a tensor that is not floating-point where the model has a float parameter, an unexpected
                tensor, quantized tensors that do not fit the declared scheme (dtype, shape, scale shape,
                missing scales, an excluded module carrying them, no ``quantization_config``), an expert
                tensor of a layer that is not a MoE layer, an expert index ``>= E``, routed-expert biases for
                experts without biases (or per expert), a bias of the wrong shape, two tensors giving the same
                expert projection, experts of two formats; or, naming ``source``, missing parameters or
                missing expert projections or biases.
        """
        params = {name: tuple(p.shape) for name, p in model.named_parameters()}
        model_name = type(model).__name__
        scheme = self.scheme
        plan = CheckpointPlan(scheme=scheme, num_experts=experts.num_experts if experts is not None else 0)
        linears: dict[str, dict[str, TensorInfo]] = {}  # non-expert module -> its quantized tensors
        groups: dict[str, tuple[object, str, dict[str, TensorInfo]]] = {}  # key -> (target, module, {param: info})
        for name, info in self.tensors.items():
            f = info.file
            if name.startswith(model.skipped_prefixes):  # e.g. a vision tower: not loaded, not converted
                continue
            try:
                target = model.expert_target(name)
            except ValueError as e:
                raise CheckpointError(f"{f}: {e}") from None
            if target is None:
                module, _, param = name.rpartition(".")
                if name in params and not (param == "weight" and info.dtype.itemsize == 1 and len(params[name]) == 2):
                    if not info.dtype.is_floating_point:
                        raise CheckpointError(f"{f}: tensor {name} has dtype {info.dtype}, expected a floating-point "
                                              "dtype")
                    if info.shape != params[name]:
                        raise CheckpointError(f"{f}: tensor {name} has shape {info.shape}, expected {params[name]}")
                    plan.params[name] = info
                elif name in params or (param in QUANT_PARAMS and len(params.get(f"{module}.weight", ())) == 2):
                    linears.setdefault(module, {})[param] = info
                else:
                    raise CheckpointError(f"{f}: unexpected tensor {name} (not a parameter of {model_name})")
                continue
            if experts is None:
                raise CheckpointError(f"{f}: unexpected tensor {name} (a routed expert, which this file must not hold)")
            if target.expert is not None and target.expert >= experts.num_experts:
                raise CheckpointError(f"{f}: tensor {name}: expert {target.expert} >= num_experts "
                                      f"{experts.num_experts}")
            if target.param == "bias" and not experts.bias:
                raise CheckpointError(f"{f}: tensor {name}: routed-expert biases, but {model_name}'s experts "
                                      "have none in this config")
            if target.param == "bias" and target.expert is not None:
                raise CheckpointError(f"{f}: tensor {name}: per-expert biases are not supported (fused "
                                      "gate_up_proj_bias / down_proj_bias are)")
            if target.expert is not None:
                module = name.rpartition(".")[0]
                key = module
            else:
                module = name[:name.rindex(f".{target.role}")]
                key = f"{module}.{target.role}"
            groups.setdefault(key, (target, module, {}))[2][target.param] = info
        for module, tensors in linears.items():
            wname = f"{module}.weight"
            if wname in plan.params:  # a float weight beside quantized tensors: the scheme decides
                tensors = {"weight": plan.params.pop(wname), **tensors}
            first = tensors.get("weight") or next(iter(tensors.values()))
            shape = params[wname]
            try:
                validate_linear(scheme, module, _metas(tensors), shape, str(first.file))
            except QuantTensorError as e:
                raise CheckpointError(str(e)) from None
            plan.quantized[wname] = QuantizedLinear(module, shape, tensors)
        for target, module, tensors in groups.values():
            src = self._expert_source(scheme, target, module, tensors, experts, model.fused_experts)
            first = plan.expert_format
            if first is None:
                plan.expert_format = src.format
            elif first.dense != src.format.dense or (not first.dense and first is not src.format):
                raise CheckpointError(f"{src.first.file}: tensor {src.first.name} is a {src.format.value} routed "
                                      f"expert, but the experts before it are {first.value}: every routed expert must "
                                      "share one format")
            plan.experts[module if target.expert is not None else f"{module}.{target.role}"] = src
            j, e = target.moe_layer, target.expert
            for ee in (range(experts.num_experts) if e is None else (e,)):
                for part in (_FUSED_PARTS[target.role] if e is None else (target.role,)):
                    key = (j * experts.num_experts + ee, part)
                    if key in plan.parts:
                        other = plan.parts[key].first
                        raise CheckpointError(f"{src.first.file}: tensor {src.first.name}: MoE layer ordinal {j} "
                                              f"expert {ee} {part} is also given by {other.name} in {other.file.name}")
                    plan.parts[key] = src
                    if "bias" in src.tensors:
                        plan.parts[(key[0], f"{part}.bias")] = src
        missing = sorted(set(params) - set(plan.params) - set(plan.quantized))
        if missing:
            raise CheckpointError(f"{self.source}: missing tensor(s) {_first(missing)}")
        if experts is not None:
            wanted = _EXPERT_PARTS + (tuple(f"{p}.bias" for p in _EXPERT_PARTS) if experts.bias else ())
            absent = [(fid, part) for fid in range(experts.num_rows) for part in wanted
                      if (fid, part) not in plan.parts]
            if absent:
                fid, part = absent[0]
                raise CheckpointError(f"{self.source}: missing {len(absent)} routed-expert tensor(s), first: MoE layer "
                                      f"ordinal {fid // experts.num_experts} expert {fid % experts.num_experts} {part}")
        return plan

    @staticmethod
    def _expert_source(scheme: QuantScheme, target, module: str, tensors: dict[str, TensorInfo],
                       experts: ExpertGeometry, fused_layout) -> ExpertSource:
        """Check one expert module's (or fused group's) tensors against the scheme (float fused tensors laid
        out as ``fused_layout``, the model's :class:`~edgemoe.models.base.FusedExpertLayout`, and their
        biases); its :class:`ExpertSource`."""
        role, fused = target.role, target.expert is None
        shape = experts.projection_shape(role)
        bias = tensors.get("bias")
        if bias is not None:
            want = experts.bias_shape(role)
            if not bias.dtype.is_floating_point:
                raise CheckpointError(f"{bias.file}: tensor {bias.name} has dtype {bias.dtype}, expected a "
                                      "floating-point dtype")
            if bias.shape != want:
                raise CheckpointError(f"{bias.file}: tensor {bias.name} has shape {bias.shape}, expected {want}")
            if len(tensors) == 1:
                raise CheckpointError(f"{bias.file}: tensor {bias.name}: a bias without its {role} weights")
        weights = {p: t for p, t in tensors.items() if p != "bias"}
        first = weights.get("weight") or weights.get("blocks") or next(iter(weights.values()))
        f = first.file
        transposed = False
        try:
            if fused and set(weights) == {"weight"}:  # float [E, 2I, H] / [E, H, I], or as fused_layout says
                if first.dtype not in _DENSE_DTYPES:
                    raise CheckpointError(f"{f}: tensor {first.name} has dtype {first.dtype}, expected a float "
                                          "dtype (a fused quantized expert tensor is MXFP4's *_blocks / *_scales)")
                transposed = fused_layout.transposed
                want = experts.tensor_shape(role, True, transposed)
                if first.shape != want:
                    raise CheckpointError(f"{f}: tensor {first.name} has shape {first.shape}, expected {want}")
                fmt = WeightFormat.for_dtype(first.dtype)
            elif fused:
                if "weight" in weights:
                    raise CheckpointError(f"{f}: tensor {weights['weight'].name} beside MXFP4 blocks of the same "
                                          "projection")
                validate_mxfp4_experts(scheme, module, role, _metas(weights), experts.num_experts, shape, str(f))
                fmt = WeightFormat.MXFP4
            else:
                fmt = validate_linear(scheme, module, _metas(weights), shape, str(f))
        except QuantTensorError as e:
            raise CheckpointError(str(e)) from None
        interleaved = fused and fused_layout.interleaved
        return ExpertSource(module, target.moe_layer, target.expert, role, tensors, fmt, shape, transposed, interleaved)


def _metas(tensors: dict[str, TensorInfo]) -> dict[str, TensorMeta]:
    return {p: TensorMeta(t.dtype, t.shape) for p, t in tensors.items()}

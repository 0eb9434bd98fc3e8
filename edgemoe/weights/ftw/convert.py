"""``edgemoe convert``: a Hugging Face checkpoint directory to an FTW directory."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import torch

from edgemoe.quant.weights import WeightFormat
from edgemoe.weights.dtypes import WEIGHT_DTYPES, checkpoint_dtype, dtype_name, parse_dtype
from edgemoe.weights.ftw.spec import MANIFEST, is_ftw
from edgemoe.weights.ftw.writer import DEFAULT_CHUNK_BYTES, FTWWriter, check_target
from edgemoe.weights.index import CheckpointIndex, ExpertGeometry
from edgemoe.weights.loader import SafetensorsReader, cast_to_layout, pool_layout

__all__ = ["convert", "source_fingerprint"]


def source_fingerprint(hf_dir: Path, files: list[Path]) -> dict:
    """``sha256`` over config.json and each weight file's name, size and safetensors header (cheap:
    no tensor data is read)."""
    h = hashlib.sha256()
    h.update((hf_dir / "config.json").read_bytes())
    listing = []
    for f in sorted(files):
        size = f.stat().st_size
        h.update(f.name.encode() + b"\0" + str(size).encode() + b"\0")
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(fh.read(min(n, 100 << 20)))
        listing.append({"name": f.name, "bytes": size})
    return {"path": str(hf_dir.absolute()), "fingerprint": "sha256:" + h.hexdigest(), "files": listing}


def convert(hf_dir: str | Path, out_dir: str | Path, progress: bool = True, *, dtype: str | torch.dtype | None = None,
            overwrite: bool = False, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Path:
    """Convert the Hugging Face checkpoint ``hf_dir`` into the FTW directory ``out_dir`` (atomically).

    The checkpoint is indexed and checked first (:meth:`~edgemoe.weights.index.CheckpointIndex.check`:
    the loader's strict rules and messages, quantized tensors against the declared scheme) and nothing
    is written until the whole checkpoint matches ``config.json``. Experts are then packed one row each
    (:meth:`~edgemoe.quant.layout.ExpertLayout.pack_expert`: quantized experts keep their format and
    scales, gpt-oss's MXFP4 gate/up de-interleaved) and streamed in flat-id order into the bank (crc32
    computed while writing); the non-expert tensors go to ``non_expert.safetensors`` (quantized
    non-expert linears dequantized), config/tokenizer/generation files are copied, and the manifest is
    written last before the directory is renamed into place. Tensors under the model's
    ``skipped_prefixes`` are not converted.

    Args:
        hf_dir: HF checkpoint directory (config.json + safetensors, per-expert or fused expert layout,
            float or quantized: FP8 block, MXFP4, NVFP4 ModelOpt / compressed-tensors).
        out_dir: the FTW directory to create.
        progress: tqdm bar over bytes written.
        dtype: dtype of float expert rows and of the non-expert tensors (``"bfloat16"``, ...); ``None``
            keeps the checkpoint's (``config.json``'s when the float expert tensors mix dtypes or have none
            of the weight dtypes, and for dequantized non-expert linears). Quantized experts keep their
            format whatever ``dtype`` is.
        overwrite: replace an existing non-empty ``out_dir``.
        chunk_bytes: target bytes per checksum chunk (default 16 MiB).

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: no config.json. ValueError: unsupported architecture or quantization config, or
        ``hf_dir`` is already FTW, or a config.json that is not valid JSON (the file named), or whose dtype,
        needed without ``dtype``, is not a weight dtype.
        CheckpointError: a checkpoint that does not match its config, or a scale that is NaN or infinite
        (one line naming the file and the tensor).
        FileExistsError: ``out_dir`` exists and is not empty, without ``overwrite``.
    """
    from edgemoe.models import load_config, model_class

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if is_ftw(hf_dir):
        raise ValueError(f"{hf_dir} is already an FTW directory ({MANIFEST} present)")
    cfg = load_config(hf_dir)
    geometry = ExpertGeometry.from_config(cfg)
    check_target(out.absolute(), overwrite)
    index = CheckpointIndex.open(hf_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    plan = index.check(model, geometry)
    found = plan.expert_dtypes()
    if dtype is not None:
        float_dtype = parse_dtype(dtype)
    elif len(found) == 1 and dtype_name(next(iter(found))) in WEIGHT_DTYPES:
        float_dtype = found.pop()
    else:
        float_dtype = checkpoint_dtype(cfg.torch_dtype, hf_dir)
    fmt = plan.expert_format or WeightFormat.for_dtype(float_dtype)
    layout = pool_layout(fmt, geometry, float_dtype, plan.scheme)
    row = layout.new_bank(1)  # [1, row_bytes]

    with SafetensorsReader(index.files) as reader:
        source = source_fingerprint(hf_dir, index.files)
        with FTWWriter(out, cfg, layout, source=source, overwrite=overwrite, chunk_bytes=chunk_bytes) as w:
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=w.bank_bytes, desc=f"convert {hf_dir.name}", unit="B", unit_scale=True)
            try:
                for fid in range(geometry.num_rows):
                    gate, up, down = (cast_to_layout(x, layout) for x in plan.expert_weights(fid, reader))
                    b13, b2 = plan.expert_biases(fid, reader) or (None, None)
                    layout.pack_expert(gate, up, down, b13=b13, b2=b2, out=row[0])
                    nb = w.write_rows(row)
                    if bar is not None:
                        bar.update(nb)
                tensors = {}
                for name, info in plan.params.items():
                    t = reader.finite_tensor(info)
                    keep = dtype is None or name.endswith(model.float32_parameters)
                    tensors[name] = t if keep else t.to(float_dtype)
                for name, q in plan.quantized.items():
                    tensors[name] = q.dequantize(plan.scheme, reader, float_dtype)
                w.write_non_expert(tensors)
                del tensors
                w.copy_files(hf_dir)
                return w.finish()
            finally:
                if bar is not None:
                    bar.close()

"""``edgemoe convert``: a Hugging Face checkpoint directory to an FTW directory."""

from __future__ import annotations

import hashlib
import struct
from contextlib import ExitStack
from pathlib import Path

import torch

from edgemoe.weights.dtypes import WEIGHT_DTYPES, dtype_name, parse_dtype
from edgemoe.weights.ftw.spec import FORMAT_VERSION, MANIFEST, is_ftw
from edgemoe.weights.ftw.writer import DEFAULT_CHUNK_BYTES, FTWWriter, check_target
from edgemoe.weights.index import CheckpointIndex, ExpertGeometry

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
    the loader's strict rules and messages) and nothing is written until the whole checkpoint
    matches ``config.json``. Experts are then streamed in flat-id order into the banks (crc32
    computed while writing), the non-expert tensors go to ``non_expert.safetensors``,
    config/tokenizer/generation files are copied, and the manifest is written last before the
    directory is renamed into place. Tensors under the model's ``skipped_prefixes`` are not converted.

    Args:
        hf_dir: HF checkpoint directory (config.json + safetensors, per-expert or fused expert layout).
        out_dir: the FTW directory to create.
        progress: tqdm bar over bytes written.
        dtype: bank and non-expert dtype (``"bfloat16"``, ...); ``None`` keeps the checkpoint's
            (``config.json``'s when the expert tensors mix dtypes or have none of the weight dtypes).
        overwrite: replace an existing non-empty ``out_dir``.
        chunk_bytes: target bytes per checksum chunk (default 16 MiB).

    Returns:
        ``Path(out_dir)``.

    Raises:
        FileNotFoundError: no config.json. ValueError: unsupported architecture, routed experts with
        biases (gpt-oss: version 1 banks hold weights only), ``hf_dir`` is already FTW, or a
        config.json that is not valid JSON (the file named). CheckpointError: a
        checkpoint that does not match its config (one line naming the file and the tensor).
        FileExistsError: ``out_dir`` exists and is not empty, without ``overwrite``.
    """
    from safetensors import safe_open

    from edgemoe.models import load_config, model_class

    hf_dir, out = Path(hf_dir), Path(out_dir)
    if is_ftw(hf_dir):
        raise ValueError(f"{hf_dir} is already an FTW directory ({MANIFEST} present)")
    cfg = load_config(hf_dir)
    geometry = ExpertGeometry.from_config(cfg)
    if geometry.bias:
        raise ValueError(f"{hf_dir}: {cfg.architecture} has routed-expert biases, which FTW version "
                         f"{FORMAT_VERSION} does not store; serve the Hugging Face directory itself")
    check_target(out.absolute(), overwrite)
    index = CheckpointIndex.open(hf_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    plan = index.check(model, geometry)
    E, I = geometry.num_experts, geometry.moe_intermediate_size
    found = plan.expert_dtypes()
    if dtype is not None:
        bank_dtype = parse_dtype(dtype)
    elif len(found) == 1 and dtype_name(next(iter(found))) in WEIGHT_DTYPES:
        bank_dtype = found.pop()
    else:
        bank_dtype = parse_dtype(cfg.torch_dtype)

    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), "pt", device="cpu")) for f in index.files}

        def fetch(fid: int, part: str) -> torch.Tensor:
            x = plan.parts[(fid, part)]
            h = handles[x.info.file]
            if x.expert is not None:
                return h.get_tensor(x.info.name)
            t = h.get_slice(x.info.name)[fid % E]  # [2I, H] or [H, I]
            if part == "gate_proj":
                return t[:I]
            if part == "up_proj":
                return t[I:]
            return t

        source = source_fingerprint(hf_dir, index.files)
        with FTWWriter(out, cfg, bank_dtype, source=source, overwrite=overwrite, chunk_bytes=chunk_bytes) as w:
            bar = None
            if progress:
                from tqdm import tqdm

                bar = tqdm(total=w.bank_bytes, desc=f"convert {hf_dir.name}", unit="B", unit_scale=True)
            try:
                for fid in range(geometry.num_rows):
                    g = plan.parts[(fid, "gate_proj")]
                    if g.role == "gate_up_proj":  # fused [E, 2I, H]: the row as stored
                        row13 = handles[g.info.file].get_slice(g.info.name)[fid % E]  # [2I, H]
                    else:
                        row13 = torch.cat([fetch(fid, "gate_proj"), fetch(fid, "up_proj")], 0)  # [2I, H]
                    nb = w.write_rows("w13", row13[None])
                    nb += w.write_rows("w2", fetch(fid, "down_proj")[None])  # [1, H, I]
                    if bar is not None:
                        bar.update(nb)
                tensors = {}
                for name, info in plan.params.items():
                    t = handles[info.file].get_tensor(name)
                    keep = dtype is None or name.endswith(model.float32_parameters)
                    tensors[name] = t if keep else t.to(bank_dtype)
                w.write_non_expert(tensors)
                del tensors
                w.copy_files(hf_dir)
                return w.finish()
            finally:
                if bar is not None:
                    bar.close()

"""The checkpoint pair both engines load: one set of random bf16 tensors, written as a Hugging Face
checkpoint (edgemoe) and as a GGUF (llama.cpp).

Geometry: Qwen3-30B-A3B's layers (hidden 2048, 128 experts, top-8, expert intermediate 768, 32 query /
4 KV heads of 128, vocab 151936) with ``--layers`` N decoder layers (default 16: 19.3 GB of experts).

``write_hf`` writes the release layout of ``Qwen3MoeForCausalLM`` (per-expert
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``), one safetensors shard per decoder layer
plus one for the embeddings and one for the final norm and LM head, and ``model.safetensors.index.json``;
config, generation config and tokenizer come from ``edgemoe.synth.write_config_only``.
Values: normal with the config's ``initializer_range`` (0.02), RMSNorm weights 1 (as transformers'
init), drawn layer by layer on the GPU when there is one (seeded ``torch.Generator``).

Random weights route degenerately: the attention output (an average over the context) dominates the
residual stream, so every token of a sequence picks nearly the same experts (hit rate 0.97 at a 12.5 %
cache). ``token_routing`` draws ``o_proj`` with std 2e-4 instead, so each layer routes by the current
token: random tokens then give no routing locality in either engine.

``write_gguf`` writes the GGUF that llama.cpp's ``convert_hf_to_gguf.py --outtype bf16`` writes from that
checkpoint, without its per-tensor Python work (~100 MB/s): the converter's own model class (from the
vendored llama.cpp tree) is run lazily to get the metadata, tensor names, shapes, dtypes and order, and
the tensor bytes are copied from the safetensors shards in the kernel (``os.copy_file_range``: bf16
tensors are the same bytes in both formats; an expert bank is its experts' tensors back to back); the
few float32 tensors (norms, router) are converted with torch, as the converter does.
``tests/test_peers_gguf.py`` checks the result against the converter's file.

    python benchmarks/peers/checkpoint.py --out .peers/ckpt --layers 16 --token-routing \\
        --tokenizer .peers/carry/tokenizer --llama-cpp .peers/llama.cpp
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.synth import write_config_only

TOKEN_ROUTING_O_PROJ_STD = 2e-4
MARKER = "peers_checkpoint.json"



def hf_tensor_specs(cfg: dict) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Tensor names, shapes and init kinds of a Qwen3-MoE checkpoint, grouped by shard.

    Args:
        cfg: the checkpoint's ``config.json`` (every layer sparse, no biases, untied LM head).

    Returns:
        Shards in order: ``[embed_tokens]``, one list per decoder layer, ``[norm, lm_head]``; each entry is
        ``(name, shape, kind)`` with kind ``"normal"``, ``"o_proj"`` or ``"ones"``.

    Raises:
        ValueError: a config this layout does not cover (dense MLP layers, tied embeddings, biases).
    """
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json: every layer must be a MoE layer (mlp_only_layers empty, decoder_sparse_step 1)")
    if cfg.get("tie_word_embeddings") or cfg.get("attention_bias"):
        raise ValueError("config.json: tie_word_embeddings and attention_bias must be false")
    h, v, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    e, i = cfg.get("num_experts", cfg.get("num_local_experts")), cfg["moe_intermediate_size"]
    shards = [[("model.embed_tokens.weight", (v, h), "normal")]]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        layer = [
            (p + "input_layernorm.weight", (h,), "ones"),
            (p + "self_attn.q_proj.weight", (nh * hd, h), "normal"),
            (p + "self_attn.k_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.v_proj.weight", (nkv * hd, h), "normal"),
            (p + "self_attn.o_proj.weight", (h, nh * hd), "o_proj"),
            (p + "self_attn.q_norm.weight", (hd,), "ones"),
            (p + "self_attn.k_norm.weight", (hd,), "ones"),
            (p + "post_attention_layernorm.weight", (h,), "ones"),
            (p + "mlp.gate.weight", (e, h), "normal"),
        ]
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            layer += [(q + "gate_proj.weight", (i, h), "normal"), (q + "up_proj.weight", (i, h), "normal"),
                      (q + "down_proj.weight", (h, i), "normal")]
        shards.append(layer)
    shards.append([("model.norm.weight", (h,), "ones"), ("lm_head.weight", (v, h), "normal")])
    return shards


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def write_hf(out: str | Path, layers: int, tokenizer: str | Path | None, *, token_routing: bool = True,
             seed: int = 0, device: str = "auto", overrides: dict | None = None) -> Path:
    """Write the Hugging Face checkpoint (see the module docstring) into ``out``.

    Args:
        out: output directory (created).
        layers: decoder layers.
        tokenizer: directory with the tokenizer files to copy (a real Qwen3 tokenizer, so that llama.cpp's
            converter recognises its pre-tokenizer); None builds make_model's own small tokenizer.
        token_routing: draw ``o_proj`` with std 2e-4 (each layer routes by the current token).
        seed: seed of the generator.
        device: where values are drawn (``auto``: CUDA when present); the bytes differ between devices.
        overrides: HF config kwargs over the ``qwen3-30b-a3b`` preset (e.g. a small geometry for tests).

    Returns:
        ``Path(out)``.
    """
    from safetensors.torch import save_file

    out = Path(out)
    write_config_only(out, "qwen3_moe", "qwen3-30b-a3b", tokenizer,
                      overrides={"num_hidden_layers": layers, **(overrides or {})})
    cfg = json.loads((out / "config.json").read_text())
    std = float(cfg["initializer_range"])
    dev = _device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    shards = hf_tensor_specs(cfg)
    n = len(shards)
    weight_map, total = {}, 0
    for k, specs in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        tensors = {}
        for name, shape, kind in specs:
            if kind == "ones":
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                s = TOKEN_ROUTING_O_PROJ_STD if kind == "o_proj" and token_routing else std
                t = torch.empty(shape, dtype=torch.bfloat16, device=dev).normal_(0.0, s, generator=g).cpu()
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    marker = {"layers": layers, "token_routing": token_routing, "overrides": overrides or {}, "seed": seed,
              "device": dev.type, "bytes": total}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def _safetensors_offsets(path: Path) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype, absolute byte offset, nbytes) from a safetensors header (8-byte little-endian
    length, then that many bytes of JSON, then the data)."""
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
    base = 8 + hlen
    return {k: (v["dtype"], base + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    """Copy ``n`` bytes between files in the kernel (copy_file_range, else sendfile, else read/write)."""
    while n > 0:
        try:
            done = os.copy_file_range(src, dst, n, src_off, dst_off)
        except OSError:
            os.lseek(dst, dst_off, os.SEEK_SET)
            try:
                done = os.sendfile(dst, src, src_off, n)
            except OSError:
                done = os.pwrite(dst, os.pread(src, min(n, 1 << 26), src_off), dst_off)
        if done <= 0:
            raise OSError(f"copy of {n} bytes at {src_off} made no progress")
        n, src_off, dst_off = n - done, src_off + done, dst_off + done


def converter_model(hf_dir: Path, out_path: Path, llama_cpp: Path):
    """The vendored ``convert_hf_to_gguf.py`` model object for ``hf_dir``, with ``--outtype bf16``, after
    its (lazy) ``prepare_tensors`` and ``prepare_metadata``: ``model.gguf_writer`` holds the metadata and
    the tensor infos in the converter's order; no tensor data has been read."""
    for p in (str(llama_cpp / "gguf-py"), str(llama_cpp)):
        if p not in sys.path:
            sys.path.insert(0, p)
    import gguf
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    hparams = ModelBase.load_hparams(hf_dir, False)
    cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
    model = cls(hf_dir, gguf.LlamaFileType.MOSTLY_BF16, out_path)
    model.prepare_tensors()
    model.prepare_metadata(vocab_only=False)
    return model


def write_gguf(hf_dir: str | Path, out_path: str | Path, llama_cpp: str | Path) -> Path:
    """Write ``out_path``: the GGUF that ``convert_hf_to_gguf.py --outtype bf16`` writes from ``hf_dir``.

    Args:
        hf_dir: a checkpoint written by ``write_hf`` (bf16 safetensors shards + index).
        out_path: the .gguf file to write (replaced).
        llama_cpp: the vendored llama.cpp tree (``convert_hf_to_gguf.py``'s ``conversion`` and ``gguf-py``).

    Returns:
        ``Path(out_path)``.

    Raises:
        ValueError: a tensor the converter writes that this copy cannot produce (another dtype, a tensor
            with no source in the shards, a size mismatch).
    """
    hf_dir, out_path, llama_cpp = Path(hf_dir), Path(out_path), Path(llama_cpp)
    part = out_path.with_name(out_path.name + ".part")  # renamed when complete: a stopped run leaves no .gguf
    model = converter_model(hf_dir, part, llama_cpp)
    import gguf  # the vendored gguf-py, put on sys.path by converter_model
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    offsets = {}
    for shard in sorted(set(index.values())):
        for name, (dt, off, nb) in _safetensors_offsets(hf_dir / shard).items():
            offsets[name] = (shard, dt, off, nb)
    # GGUF name -> the HF tensors whose bytes it is, in order
    sources: dict[str, list[str]] = {}
    n_experts = model.find_hparam(["num_local_experts", "num_experts"])
    for name in index:
        parts = name.split(".")
        if ".mlp.experts." in name:
            bid, w = int(parts[2]), parts[-2]
            merged = model.map_tensor_name(f"model.layers.{bid}.mlp.experts.{w}.weight")
            sources[merged] = [f"model.layers.{bid}.mlp.experts.{x}.{w}.weight" for x in range(n_experts)]
        else:
            sources[model.map_tensor_name(name)] = [name]

    writer = model.gguf_writer
    infos = dict(writer.tensors[0])
    if len(writer.tensors) != 1:
        raise ValueError("split GGUF output is not supported")
    if set(infos) != set(sources):
        raise ValueError(f"tensor sets differ: converter only {sorted(set(infos) - set(sources))[:5]}, "
                         f"shards only {sorted(set(sources) - set(infos))[:5]}")
    writer.write_header_to_file(path=part)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    fout.flush()
    pos = fout.tell()
    dst = fout.fileno()
    fds: dict[str, int] = {}
    try:
        for gname, ti in infos.items():
            pos += -pos % writer.data_alignment
            srcs = sources[gname]
            if ti.dtype == gguf.GGMLQuantizationType.BF16:
                written = 0
                for s in srcs:
                    shard, dt, off, nb = offsets[s]
                    if dt != "BF16":
                        raise ValueError(f"{s}: {dt} in {shard}, expected BF16")
                    if shard not in fds:
                        fds[shard] = os.open(hf_dir / shard, os.O_RDONLY)
                    _copy_range(fds[shard], dst, nb, off, pos + written)
                    written += nb
            elif ti.dtype == gguf.GGMLQuantizationType.F32 and len(srcs) == 1:
                from safetensors import safe_open

                shard = offsets[srcs[0]][0]
                with safe_open(str(hf_dir / shard), framework="pt") as f:
                    data = f.get_tensor(srcs[0]).float().numpy().tobytes()
                written = os.pwrite(dst, data, pos)
            else:
                raise ValueError(f"{gname}: converter writes {ti.dtype.name}, which this copy does not produce")
            if written != ti.nbytes:
                raise ValueError(f"{gname}: wrote {written} bytes, converter expects {ti.nbytes}")
            pos += written
        os.ftruncate(dst, pos + (-pos % writer.data_alignment))
    finally:
        for fd in fds.values():
            os.close(fd)
        writer.close()
    os.replace(part, out_path)
    return out_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder: hf/ (the HF checkpoint) and model-bf16.gguf go here")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--tokenizer", help="tokenizer folder to copy (default: make_model's own tokenizer)")
    ap.add_argument("--token-routing", action="store_true", help="o_proj with std 2e-4: routing by the current token")
    ap.add_argument("--config-overrides", default="{}", help="JSON of HF config kwargs over the qwen3-30b-a3b preset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="where values are drawn: auto, cpu, cuda")
    ap.add_argument("--llama-cpp", default=str(Path(__file__).resolve().parents[2] / ".peers" / "llama.cpp"))
    ap.add_argument("--skip-hf", action="store_true", help="keep an existing hf/ (resume)")
    ap.add_argument("--skip-gguf", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    hf = out / "hf"
    if not a.skip_hf:
        t0 = time.perf_counter()
        write_hf(hf, a.layers, a.tokenizer, token_routing=a.token_routing, seed=a.seed, device=a.device,
                 overrides=json.loads(a.config_overrides))
        gb = json.loads((hf / MARKER).read_text())["bytes"] / 1e9
        dt = time.perf_counter() - t0
        print(f"hf: {gb:.2f} GB in {dt:.1f} s ({gb / dt:.2f} GB/s) -> {hf}", flush=True)
    if not a.skip_gguf:
        t0 = time.perf_counter()
        path = write_gguf(hf, out / "model-bf16.gguf", a.llama_cpp)
        gb = path.stat().st_size / 1e9
        dt = time.perf_counter() - t0
        print(f"gguf: {gb:.2f} GB in {dt:.1f} s ({gb / dt:.2f} GB/s) -> {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bootstrap benchmark: FTW read throughput vs the disk's own direct-I/O bandwidth, pinning order, and
time from process start to first token.

Steps (each result goes into the table and the JSON written to ``--out``):

1. **Model.** ``--source direct`` (default) writes an FTW directory straight from dummy data with
   :class:`edgemoe.weights.ftw.FTWWriter`: config and tokenizer from ``write_config_only(preset,
   overrides={"num_hidden_layers": L})``, expert banks filled with random rows, random non-expert
   tensors. ``--source hf`` instead writes a Hugging Face checkpoint with ``make_model`` (same
   geometry) and times ``edgemoe convert`` on it (twice the disk, much slower to build). The default
   geometry is Qwen3-30B-A3B's (``--preset qwen3-30b-a3b``) with ``L`` chosen to give
   ``--experts-gb`` of experts (20 GB -> 17 layers of 1.21 GB). No network is needed.
2. **Disk.** ``dd if=BANK of=/dev/null bs=16M iflag=direct`` over the bank file: the sequential
   direct-I/O bandwidth of the disk holding the model, measured in the same run.
3. **Read routes** into a fresh page-aligned host pool, page cache dropped for the files first
   (``posix_fadvise(DONTNEED)``): direct zero-copy with crc32 (the engine's route), the same without
   verification, direct into staging buffers then copied, buffered (page cache) zero-copy.
4. **Pinning** (CUDA only; skipped otherwise): pin after fill (the engine's order: read, then
   ``cudaHostRegister``), pin first (register the empty pool, then read), and ``cudaHostAlloc``
   (``torch.empty(pin_memory=True)``, then read).
5. **Start to first token**: a fresh ``python`` process builds a :class:`ModelRunner` on the FTW
   directory (and, with ``--source hf`` or ``--hf-ttft``, on the HF directory) and runs one prefill;
   the time from spawning it to its first token is reported with the child's phases.

    python benchmarks/bootstrap.py --workdir /nvme/bench --out results/bootstrap.json
    python benchmarks/bootstrap.py --preset tiny --source hf --out results/bootstrap-tiny.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GB = 1e9


# ----------------------------------------------------------------------------- child: start -> first token


def child_ttft(model_dir: str, device: str, prompt_tokens: int) -> None:
    """Runs in a fresh process: import, build the runner, prefill, print one JSON line."""
    t_start = time.time()

    from edgemoe.config import EngineConfig
    from edgemoe.core import Phase
    from edgemoe.engine.model_runner import ModelRunner, StepInput

    t_imported = time.time()
    runner = ModelRunner(model_dir, EngineConfig(device=device), progress=False)
    t_runner = time.time()
    vocab = runner.model_config.vocab_size
    prompt = [(17 * i + 3) % min(vocab, 256) for i in range(prompt_tokens)]
    logits = runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)
    token = int(logits[0].argmax())  # syncs the device
    t_first = time.time()
    out = {"t_start": t_start, "t_imported": t_imported, "t_runner": t_runner, "t_first_token": t_first,
           "token": token, "load_seconds": runner.load_seconds, "format": runner.weights_format,
           "pinned": runner.pinned, "pin_s": runner.pin_outcome.seconds, "device": str(runner.device),
           "load_stats": runner.load_stats.as_dict() if runner.load_stats else None,
           "summary": runner.summary()}
    print("TTFT_JSON " + json.dumps(out), flush=True)


def measure_ttft(model_dir: Path, device: str, prompt_tokens: int, files: list[Path]) -> dict:
    """Spawn :func:`child_ttft` with ``files`` evicted from the page cache; times from spawn."""
    drop_cache(files)
    t0 = time.time()
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child-ttft", str(model_dir),
                        "--device", device, "--prompt-tokens", str(prompt_tokens)],
                       capture_output=True, text=True, cwd=str(ROOT))
    if p.returncode != 0:
        raise RuntimeError(f"TTFT child failed ({p.returncode}):\n{p.stderr[-4000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("TTFT_JSON "))
    r = json.loads(line[len("TTFT_JSON "):])
    r.update({
        "start_to_first_token_s": r["t_first_token"] - t0,
        "interpreter_start_s": r["t_start"] - t0,
        "imports_s": r["t_imported"] - r["t_start"],
        "runner_init_s": r["t_runner"] - r["t_imported"],
        "first_prefill_s": r["t_first_token"] - r["t_runner"],
    })
    return r


# ----------------------------------------------------------------------------- building the model


def experts_per_layer_bytes(cfg_kwargs: dict, elsize: int) -> int:
    return cfg_kwargs["num_experts"] * 3 * cfg_kwargs["hidden_size"] * cfg_kwargs["moe_intermediate_size"] * elsize


def choose_layers(preset: str, experts_gb: float | None, layers: int | None) -> dict:
    from edgemoe.synth import PRESETS

    base = PRESETS["qwen3_moe"][preset]
    if layers is None and experts_gb is None:
        return {}
    if layers is None:
        moe_share = 1.0  # presets with mlp_only_layers lose a layer or so; good enough for sizing
        layers = max(1, round(experts_gb * GB / (experts_per_layer_bytes(base, 2) * moe_share)))
    ov = {"num_hidden_layers": int(layers)}
    if base.get("mlp_only_layers"):
        ov["mlp_only_layers"] = [i for i in base["mlp_only_layers"] if i < layers]
    return ov


def build_direct(out: Path, preset: str, overrides: dict, dtype: str, seed: int) -> dict:
    """FTW straight from dummy data (no HF checkpoint): returns timings."""
    import torch

    from edgemoe.config import parse_dtype
    from edgemoe.experts.pool import HostExpertPool
    from edgemoe.models import load_config, model_class
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat
    from edgemoe.synth import write_config_only
    from edgemoe.weights.ftw import FTWWriter

    t0 = time.perf_counter()
    cfg_dir = out.parent / (out.name + ".config")
    shutil.rmtree(cfg_dir, ignore_errors=True)
    write_config_only(cfg_dir, "qwen3_moe", preset, dtype=dtype, overrides=overrides)
    cfg = load_config(cfg_dir)
    dt = parse_dtype(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg)
    E = cfg.num_experts
    layout = ExpertLayout.build(WeightFormat.for_dtype(dt), cfg.hidden_size, cfg.moe_intermediate_size)
    layer_pool = HostExpertPool(E, layout)  # one MoE layer of random rows, refilled per layer
    with FTWWriter(out, cfg, layout, source={"path": "synthetic (benchmarks/bootstrap.py --source direct)",
                                             "fingerprint": f"seed:{seed}", "files": []}, overwrite=True) as w:
        for layer in range(cfg.num_moe_layers):
            layer_pool.fill_random(seed + layer)
            w.write_rows(layer_pool.bank)
        tensors = {}
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                tensors[pname] = torch.ones(p.shape, dtype=dt)
            else:
                tensors[pname] = (torch.randn(p.shape, generator=g) * 0.02).to(dt)
        w.write_non_expert(tensors)
        del tensors
        w.copy_files(cfg_dir)
        w.finish()
    shutil.rmtree(cfg_dir, ignore_errors=True)
    return {"build_s": time.perf_counter() - t0}


def build_hf(hf: Path, out: Path, preset: str, overrides: dict, dtype: str, seed: int) -> dict:
    from edgemoe.synth import make_model
    from edgemoe.weights.ftw import convert

    t0 = time.perf_counter()
    shutil.rmtree(hf, ignore_errors=True)
    make_model(hf, "qwen3_moe", preset, seed=seed, dtype=dtype, overrides=overrides)
    t1 = time.perf_counter()
    convert(hf, out, progress=True, overwrite=True)
    return {"build_s": t1 - t0, "convert_s": time.perf_counter() - t1}


# ----------------------------------------------------------------------------- measurements


def drop_cache(files: list[Path]) -> None:
    """Evict ``files`` from the page cache (clean pages; no root needed)."""
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure_dd(files: list[Path]) -> dict:
    """``dd if=F of=/dev/null bs=16M iflag=direct`` over each file; GB/s over all of them."""
    total, secs, cmds = 0, 0.0, []
    for f in files:
        cmd = ["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"]
        cmds.append(" ".join(cmd))
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        if p.returncode != 0:
            return {"error": p.stderr.strip()[-500:], "commands": cmds}
        m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", p.stderr, re.M)
        if m:
            total += int(m.group(1))
            secs += float(m.group(2))
        else:
            total += f.stat().st_size
            secs += dt
    return {"bytes": total, "seconds": secs, "gbps": total / secs / GB if secs else 0.0, "commands": cmds}


def filesystem_of(path: Path) -> str:
    best, fs = "", "?"
    p = str(path.resolve())
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, typ = line.split()[:3]
            if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fs = mnt, f"{typ} ({dev} on {mnt})"
    except OSError:
        pass
    return fs


def read_route(model_dir: Path, label: str, *, direct: bool, verify: bool, staging: bool, workers: int | None,
               pin: str | None = None, huge_pages: bool = False) -> dict:
    """Read the expert bank into a fresh destination; ``pin``: None, "first", "after" or "cuda_alloc";
    ``huge_pages``: destination advised ``MADV_HUGEPAGE`` (instead of the pool's default)."""
    import torch

    from edgemoe.experts.pool import HostExpertPool, host_empty
    from edgemoe.weights.ftw import bank_source, read_manifest
    from edgemoe.weights.ftw.direct_io import read_banks

    man = read_manifest(model_dir)
    src = bank_source(man, model_dir)
    drop_cache([src.path])
    gc.collect()
    res = {"route": label, "direct": direct, "verify": verify, "staging": staging}
    t0 = time.perf_counter()
    pin_s = 0.0
    if pin == "cuda_alloc":
        dest = torch.empty((src.rows, src.row_bytes), dtype=torch.uint8, pin_memory=True)
        pool = None
        pin_s = time.perf_counter() - t0
    elif huge_pages:
        pool = None
        dest = host_empty((src.rows, src.row_bytes), torch.uint8, huge_pages=True)
    else:
        pool = HostExpertPool(src.rows, src.layout)
        if pin == "first":
            t1 = time.perf_counter()
            if not pool.pin():
                res["error"] = "pin refused"
                return res
            pin_s = time.perf_counter() - t1
        dest = pool.bank
    stats = read_banks([(src, dest)], workers=workers, direct=direct, verify=verify, staging=staging)
    if pin == "after":
        t1 = time.perf_counter()
        if not pool.pin():
            res["error"] = "pin refused"
        pin_s = time.perf_counter() - t1
    total = time.perf_counter() - t0
    res.update({"bytes": stats.bytes, "read_s": stats.seconds, "read_gbps": stats.gbps, "pin_s": pin_s,
                "total_s": total, "total_gbps": stats.bytes / total / GB, "zero_copy": stats.zero_copy,
                "direct_effective": stats.direct, "workers": stats.workers, "fallbacks": stats.fallbacks})
    if pool is not None:
        pool.unpin()
    del pool, dest
    gc.collect()
    if pin == "cuda_alloc" and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give the cached pinned blocks back before the next measurement
    return res


# ----------------------------------------------------------------------------- main


def fmt_table(rows: list[tuple], header: tuple) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=("tiny", "small", "qwen3-30b-a3b"))
    ap.add_argument("--experts-gb", type=float, default=None,
                    help="size the layer count for this many GB of experts (default 20 for qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers override (wins over --experts-gb)")
    ap.add_argument("--source", choices=("direct", "hf"), default="direct",
                    help="direct: FTW from dummy data; hf: make_model checkpoint + edgemoe convert")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--workdir", default=None, help="where the model is written (default: $TMPDIR/edgemoe-bootstrap)")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing FTW (and HF) directory in --workdir")
    ap.add_argument("--keep", action="store_true", help="keep the written model (default: delete at the end)")
    ap.add_argument("--workers", default="", help="comma list of reader-thread counts to sweep (default: engine's)")
    ap.add_argument("--device", default="auto", help="device of the start-to-first-token run")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--hf-ttft", action="store_true", help="also time start-to-first-token from the HF directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file (or directory) for the results")
    ap.add_argument("--child-ttft", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_ttft:
        child_ttft(args.child_ttft, args.device, args.prompt_tokens)
        return 0

    import torch

    from edgemoe.weights.ftw import BANK_FILE, is_ftw, read_manifest
    from edgemoe.weights.ftw.direct_io import default_workers

    if args.experts_gb is None and args.layers is None and args.preset == "qwen3-30b-a3b":
        args.experts_gb = 20.0
    overrides = choose_layers(args.preset, args.experts_gb, args.layers)
    work = Path(args.workdir or Path(tempfile.gettempdir()) / "edgemoe-bootstrap")
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{args.preset}-L{overrides.get('num_hidden_layers', 'preset')}-{args.dtype}"
    ftw_dir, hf_dir = work / f"{tag}.ftw", work / f"{tag}.hf"
    result: dict = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                "torch": torch.__version__, "filesystem": filesystem_of(work)},
                    "model": {"preset": args.preset, "overrides": overrides, "dtype": args.dtype, "source": args.source,
                              "dir": str(ftw_dir)}}
    print(f"workdir {work} on {result['machine']['filesystem']}", flush=True)

    if not (args.reuse and is_ftw(ftw_dir) and (args.source == "direct" or (hf_dir / "config.json").exists())):
        print(f"building {ftw_dir} ({args.source}) ...", flush=True)
        result["build"] = (build_direct(ftw_dir, args.preset, overrides, args.dtype, args.seed)
                           if args.source == "direct"
                           else build_hf(hf_dir, ftw_dir, args.preset, overrides, args.dtype, args.seed))
    man = read_manifest(ftw_dir)
    banks = [ftw_dir / BANK_FILE]
    bank_bytes = man.bank.nbytes
    result["model"].update({"expert_bytes": bank_bytes, "non_expert_bytes": man.non_expert.nbytes,
                            "experts": man.experts.num_rows})
    print(f"model: {man.experts.num_rows} experts, {bank_bytes / GB:.2f} GB of banks, "
          f"{man.non_expert.nbytes / GB:.2f} GB non-expert", flush=True)

    os.sync()
    dd = measure_dd(banks)
    result["dd"] = dd
    print(f"dd iflag=direct bs=16M: {dd.get('gbps', 0):.2f} GB/s", flush=True)

    workers = [int(w) for w in args.workers.split(",") if w] or [default_workers()]
    routes = []
    for nw in workers:
        routes.append(read_route(ftw_dir, "direct, zero-copy, crc32 (engine)", direct=True, verify=True, staging=False,
                                 workers=nw))
    nw = workers[-1]
    routes.append(read_route(ftw_dir, "direct, zero-copy, no verify", direct=True, verify=False, staging=False,
                             workers=nw))
    routes.append(read_route(ftw_dir, "direct, staged + copy, crc32", direct=True, verify=True, staging=True,
                             workers=nw))
    routes.append(read_route(ftw_dir, "buffered, zero-copy, crc32", direct=False, verify=True, staging=False,
                             workers=nw))
    routes.append(read_route(ftw_dir, "direct, zero-copy, crc32, THP pool", direct=True, verify=True, staging=False,
                             workers=nw, huge_pages=True))
    if torch.cuda.is_available():
        routes.append(read_route(ftw_dir, "pin after fill (engine)", direct=True, verify=True, staging=False,
                                 workers=nw, pin="after"))
        routes.append(read_route(ftw_dir, "pin first, then fill", direct=True, verify=True, staging=False,
                                 workers=nw, pin="first"))
        routes.append(read_route(ftw_dir, "cudaHostAlloc, then fill", direct=True, verify=True, staging=False,
                                 workers=nw, pin="cuda_alloc"))
    else:
        result["pin_note"] = "no CUDA: pin-first vs pin-after-fill skipped"
    result["routes"] = routes
    for r in routes:
        if "read_gbps" in r:
            r["pct_of_dd"] = 100 * r["read_gbps"] / dd["gbps"] if dd.get("gbps") else None

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    ttft = {"ftw": measure_ttft(ftw_dir, device, args.prompt_tokens, banks + [ftw_dir / "non_expert.safetensors"])}
    if (args.source == "hf" or args.hf_ttft) and (hf_dir / "config.json").exists():
        ttft["hf"] = measure_ttft(hf_dir, device, args.prompt_tokens, sorted(hf_dir.glob("*.safetensors")))
    result["ttft"] = ttft

    rows = [(r["route"], r["workers"], f"{r['read_gbps']:.2f}", f"{r['pct_of_dd']:.0f}%" if r.get("pct_of_dd") else "-",
             f"{r['pin_s']:.2f}", f"{r['total_s']:.2f}", "yes" if r["zero_copy"] else "no",
             "yes" if r["direct_effective"] else "no")
            for r in routes if "read_gbps" in r]
    print()
    print(f"experts {bank_bytes / GB:.2f} GB; dd iflag=direct bs=16M {dd.get('gbps', 0):.2f} GB/s "
          f"({result['machine']['filesystem']})")
    print(fmt_table(rows, ("route", "readers", "read GB/s", "% of dd", "pin s", "total s", "zero-copy", "O_DIRECT")))
    print()
    trows = [(k, v["format"], v["device"], f"{v['start_to_first_token_s']:.2f}",
              f"{v['interpreter_start_s'] + v['imports_s']:.2f}",
              f"{v['runner_init_s']:.2f}", f"{v['load_stats']['total_s']:.2f}" if v.get("load_stats") else "-",
              f"{v['load_stats']['read_gbps']:.2f}" if v.get("load_stats") else "-",
              f"{v['pin_s']:.2f}", f"{v['first_prefill_s']:.2f}") for k, v in ttft.items()]
    print(fmt_table(trows, ("dir", "format", "device", "start->1st token s", "python+imports s", "runner init s",
                            "FTW load s", "FTW read GB/s", "pin s", "1st prefill s")))
    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out = out / f"bootstrap-{tag}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")
    if not args.keep and not args.reuse:
        shutil.rmtree(ftw_dir, ignore_errors=True)
        shutil.rmtree(hf_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FTW format: HF -> FTW round trip (tensors and greedy tokens), corruption errors, direct-I/O fallback,
atomic convert, and the pinning-refused fallback (exercised without CUDA)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgemoe.cli import main
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.pool import HostExpertPool
from edgemoe.models import load_config
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat
from edgemoe.synth import make_model
from edgemoe.weights import ftw
from edgemoe.weights.bootstrap import PinOutcome, pin_or_fallback
from edgemoe.weights.ftw import (
    MANIFEST,
    FTWChecksumError,
    FTWConfigError,
    FTWTruncatedError,
    FTWVersionError,
    convert,
    direct_io,
    is_ftw,
    read_manifest,
)
from edgemoe.weights.ftw.direct_io import read_banks
from edgemoe.weights.index import CheckpointError

ROOT = Path(__file__).resolve().parents[1]
CFG = EngineConfig(device="cpu", dtype="float32", expert_policy="cpu-all")
PROMPT = [5, 17, 230, 41, 99, 7, 12]


@pytest.fixture(scope="module")
def hf(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def ftw_dir(hf, tmp_path_factory) -> Path:
    return convert(hf, tmp_path_factory.mktemp("ftw") / "tiny.ftw", progress=False)


@pytest.fixture(scope="module")
def hf_runner(hf) -> ModelRunner:
    return ModelRunner(hf, CFG, progress=False)


def greedy(runner: ModelRunner, n: int = 12, seq: int = 0) -> list[int]:
    logits = runner.execute([StepInput(seq, PROMPT, 0)], Phase.PREFILL)
    toks, pos = [int(logits[0].argmax())], len(PROMPT)
    for _ in range(n - 1):
        logits = runner.execute([StepInput(seq, [toks[-1]], pos)], Phase.DECODE)
        toks.append(int(logits[0].argmax()))
        pos += 1
    runner.free(seq)
    return toks


def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / "copy.ftw"
    shutil.copytree(src, d)
    return d


# ------------------------------------------------------------------------------------ round trip


def test_round_trip_identical_tensors_and_tokens(hf_runner, ftw_dir):
    r = ModelRunner(ftw_dir, CFG, progress=False)
    assert r.weights_format == "FTW" and hf_runner.weights_format == "HF safetensors"
    assert r.pool.layout == hf_runner.pool.layout and torch.equal(r.pool.bank, hf_runner.pool.bank)
    a, b = dict(hf_runner.model.named_parameters()), dict(r.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert greedy(r) == greedy(hf_runner)
    st = r.load_stats
    assert st.read.verified and st.read.zero_copy and st.expert_bytes == r.pool.nbytes
    assert st.read.bytes == r.pool.nbytes + (ftw_dir / "non_expert.safetensors").stat().st_size
    assert r.pool.bank.data_ptr() % 4096 == 0
    assert "(FTW, fp32 experts)" in r.summary()


def test_manifest_layout_and_self_contained(hf, ftw_dir):
    man = read_manifest(ftw_dir)
    cfg = load_config(hf)
    n = cfg.num_moe_layers * cfg.num_experts
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert man.format == "edgemoe-ftw" and man.format_version == ftw.FORMAT_VERSION == 2
    layout = ExpertLayout.from_json(man.layout)
    assert layout == ExpertLayout.build(WeightFormat.FP32, H, I)
    b = man.bank
    assert b.file == "experts.bin" and b.rows == n and b.row_bytes == layout.row_bytes and b.row_bytes % 4096 == 0
    assert (ftw_dir / b.file).stat().st_size == b.nbytes == n * b.row_bytes
    assert len(b.checksum.chunks) == -(-b.nbytes // b.checksum.chunk_bytes)
    assert man.source.fingerprint.startswith("sha256:")
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert name in man.files and (ftw_dir / name).read_bytes() == (hf / name).read_bytes()
    raw = json.loads((ftw_dir / MANIFEST).read_text())  # the schema round-trips the file as written
    assert ftw.Manifest.model_validate(raw).model_dump(mode="json") == raw
    assert not list(ftw_dir.glob("model*.safetensors"))
    # experts row i = moe_layer * E + expert: spot-check one row against the HF tensors
    sd = load_file(hf / "model.safetensors")
    j, e = 2, 5
    layer = cfg.moe_layers[j]
    bank = torch.from_file(str(ftw_dir / "experts.bin"), size=b.nbytes, dtype=torch.uint8).view(n, b.row_bytes)
    row = layout.view(bank, "w13")[j * cfg.num_experts + e]
    assert torch.equal(row[:I], sd[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"])
    assert torch.equal(row[I:], sd[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"])
    assert torch.equal(layout.view(bank, "w2")[j * cfg.num_experts + e],
                       sd[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"])


def test_fused_hf_layout_converts_identically(hf, ftw_dir, tmp_path):
    cfg = load_config(hf)
    d = tmp_path / "fused"
    shutil.copytree(hf, d)
    sd = load_file(d / "model.safetensors")
    for layer in cfg.moe_layers:
        pre = f"model.layers.{layer}.mlp.experts"
        gu = [torch.cat([sd.pop(f"{pre}.{e}.gate_proj.weight"), sd.pop(f"{pre}.{e}.up_proj.weight")])
              for e in range(cfg.num_experts)]
        dn = [sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(cfg.num_experts)]
        sd[f"{pre}.gate_up_proj"], sd[f"{pre}.down_proj"] = torch.stack(gu), torch.stack(dn)
    save_file(sd, d / "model.safetensors")
    out = convert(d, tmp_path / "fused.ftw", progress=False)
    assert (out / "experts.bin").read_bytes() == (ftw_dir / "experts.bin").read_bytes()


def test_padded_sections_and_dtype_cast_use_the_staging_route(tmp_path):
    # I = 40, H = 64: w13 is 20480 bytes in fp32, w2 10240: the row (30720 bytes) is padded to 32768.
    hf = make_model(tmp_path / "odd", "qwen3_moe", "tiny", dtype="float32", overrides={"moe_intermediate_size": 40})
    out = convert(hf, tmp_path / "odd.ftw", progress=False)
    assert read_manifest(out).bank.row_bytes == 32768
    a, b = ModelRunner(hf, CFG, progress=False), ModelRunner(out, CFG, progress=False)
    assert b.load_stats.read.zero_copy and torch.equal(a.pool.bank, b.pool.bank)
    cfg = EngineConfig(device="cpu", dtype="bfloat16", expert_policy="cpu-all")  # fp32 rows read into bf16 rows
    a, b = ModelRunner(hf, cfg, progress=False), ModelRunner(out, cfg, progress=False)
    assert not b.load_stats.read.zero_copy and b.load_stats.read.verified
    assert b.pool.format is WeightFormat.BF16 and torch.equal(a.pool.bank, b.pool.bank)
    assert greedy(a, 6) == greedy(b, 6)


def test_convert_to_bf16(hf, hf_runner, tmp_path):
    out = convert(hf, tmp_path / "bf16.ftw", progress=False, dtype="bfloat16")
    assert read_manifest(out).layout["format"] == "bf16"
    r = ModelRunner(out, CFG, progress=False)  # fp32 engine over bf16 rows: staged cast
    for name in ("w13", "w2"):
        torch.testing.assert_close(r.pool.view(name), hf_runner.pool.view(name).bfloat16().float(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------ bad input


def _corrupt_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _no_reader_threads() -> bool:
    return not [t for t in threading.enumerate() if t.name.startswith(("ftw-read", "ftw-banks"))]


def test_truncated_bank(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    bank = d / "experts.bin"
    os.truncate(bank, bank.stat().st_size - 4096)
    with pytest.raises(FTWTruncatedError, match=r"experts\.bin: bank file is truncated"):
        ModelRunner(d, CFG, progress=False)


def test_missing_bank(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    (d / "experts.bin").unlink()
    with pytest.raises(FTWTruncatedError, match=r"experts\.bin: expert bank file is missing"):
        ModelRunner(d, CFG, progress=False)


def test_checksum_mismatch_in_a_bank_names_file_and_rows(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    row = read_manifest(d).bank.row_bytes
    _corrupt_byte(d / "experts.bin", 37 * row + 100)  # row 37 = MoE layer 2, expert 5
    with pytest.raises(FTWChecksumError, match=r"experts\.bin: checksum mismatch .*rows 0-47 \(MoE layers 0-2\)"):
        ModelRunner(d, CFG, progress=False)
    assert _no_reader_threads()


def test_checksum_chunks_localize_the_damage(hf, tmp_path):
    d = convert(hf, tmp_path / "small-chunks.ftw", progress=False, chunk_bytes=96 << 10)  # 2 rows per chunk
    b = read_manifest(d).bank
    assert b.checksum.chunk_bytes == 2 * b.row_bytes and len(b.checksum.chunks) == 24
    ModelRunner(d, CFG, progress=False)  # intact: every chunk verifies
    _corrupt_byte(d / "experts.bin", 37 * b.row_bytes + 100)
    with pytest.raises(FTWChecksumError, match=r"\(chunk 18, rows 36-37 \(MoE layers 2-2\)\)"):
        ModelRunner(d, CFG, progress=False)


def test_checksum_mismatch_in_non_expert_file(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    f = d / "non_expert.safetensors"
    _corrupt_byte(f, f.stat().st_size - 10)
    with pytest.raises(FTWChecksumError, match=r"non_expert\.safetensors: checksum mismatch"):
        ModelRunner(d, CFG, progress=False)
    assert _no_reader_threads()


def test_truncated_non_expert_file(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    f = d / "non_expert.safetensors"
    os.truncate(f, f.stat().st_size - 1)
    with pytest.raises(FTWTruncatedError,
                       match=r"non_expert\.safetensors: \d+ bytes, manifest says \d+ \(truncated\?\)"):
        ModelRunner(d, CFG, progress=False)


def test_malformed_non_expert_header(ftw_dir, tmp_path, monkeypatch):
    d = _copy(ftw_dir, tmp_path)
    with open(d / "non_expert.safetensors", "r+b") as f:
        f.write((10**12).to_bytes(8, "little"))
    monkeypatch.setenv("EDGEMOE_FTW_VERIFY", "0")  # past the checksum, to the parser
    with pytest.raises(CheckpointError, match=r"non_expert\.safetensors: not a safetensors file \(header length"):
        ModelRunner(d, CFG, progress=False)


def test_verification_can_be_skipped(ftw_dir, tmp_path, monkeypatch):
    d = _copy(ftw_dir, tmp_path)
    _corrupt_byte(d / "experts.bin", 10)
    monkeypatch.setenv("EDGEMOE_FTW_VERIFY", "0")
    r = ModelRunner(d, CFG, progress=False)  # corrupt data loads: the user opted out of checking
    assert not r.load_stats.read.verified


@pytest.mark.parametrize("version", [0, 3, "2"])
def test_manifest_of_another_version(ftw_dir, tmp_path, version):
    d = _copy(ftw_dir, tmp_path)
    man = json.loads((d / MANIFEST).read_text())
    man["format_version"] = version
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(FTWVersionError,
                       match=rf"ftw\.json: FTW format version {version!r}; this edgemoe reads version 2"):
        ModelRunner(d, CFG, progress=False)


def test_version_1_manifest_is_refused_with_a_reason(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    man = json.loads((d / MANIFEST).read_text())
    man["format_version"] = 1
    (d / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(FTWVersionError, match=r"FTW format version 1 \(two float banks .*this edgemoe reads version 2 "
                                              r"\(one bank of packed expert rows, any format\): re-run "
                                              r"`edgemoe convert`"):
        ModelRunner(d, CFG, progress=False)


def test_not_an_ftw_manifest(ftw_dir, tmp_path):
    d = _copy(ftw_dir, tmp_path)
    (d / MANIFEST).write_text("{not json")
    with pytest.raises(ftw.FTWError, match=r"ftw\.json: not valid JSON"):
        ModelRunner(d, CFG, progress=False)


@pytest.mark.parametrize("field,value,what", [
    ("num_experts", 8, "num_experts 8 in config.json, 16 in the banks"),
    ("moe_intermediate_size", 32, "moe_intermediate_size 32 in config.json, 64 in the banks"),
    ("num_hidden_layers", 3, "num_moe_layers 2 in config.json, 3 in the banks"),
])
def test_config_disagreeing_with_banks(ftw_dir, tmp_path, field, value, what):
    d = _copy(ftw_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    if field == "num_experts":
        cfg["num_local_experts"] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FTWConfigError, match=r"config\.json disagrees with .*ftw\.json: " + what):
        ModelRunner(d, CFG, progress=False)


def test_errors_are_checkpoint_errors():
    for cls in (FTWChecksumError, FTWConfigError, FTWTruncatedError, FTWVersionError):
        assert issubclass(cls, CheckpointError)


def test_convert_rejects_a_bad_checkpoint_before_writing(hf, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(hf, d)
    sd = load_file(d / "model.safetensors")
    sd.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    save_file(sd, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"first: MoE layer ordinal 1 expert 5 up_proj"):
        convert(d, tmp_path / "bad.ftw", progress=False)
    assert not list(tmp_path.glob("bad.ftw*"))


# ------------------------------------------------------------------------------------ atomic convert


def test_killed_convert_leaves_nothing_that_looks_complete(hf, tmp_path):
    out = tmp_path / "killed.ftw"
    code = (f"import os, sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from edgemoe.weights import ftw\n"
            "ftw.FTWWriter.finish = lambda self: os._exit(9)  # killed before the manifest\n"
            f"ftw.convert({str(hf)!r}, {str(out)!r}, progress=False)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 9, p.stderr
    partial = list(tmp_path.glob("killed.ftw.partial-*"))
    assert not out.exists() and len(partial) == 1 and not is_ftw(partial[0])
    assert (partial[0] / "experts.bin").exists()
    with pytest.raises(CheckpointError):  # without a manifest it is not FTW, and not a valid HF checkpoint
        ModelRunner(partial[0], CFG, progress=False)
    convert(hf, out, progress=False)  # the next convert succeeds and sweeps the dead process's leftovers
    assert is_ftw(out) and not list(tmp_path.glob("killed.ftw.partial-*"))


def test_failed_convert_cleans_up(hf, tmp_path, monkeypatch):
    def boom(self, tensors):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ftw.FTWWriter, "write_non_expert", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        convert(hf, tmp_path / "x.ftw", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_every_converted_file_has_the_same_mode(ftw_dir):
    """safetensors writes its files 0600: the non-expert file would be the one file of the directory that another
    user allowed to read the bank could not read. Every file gets the mode the bank got from open() and the umask."""
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ftw_dir.iterdir() if p.is_file()}
    assert len(set(modes.values())) == 1, modes


def test_existing_output_needs_overwrite(hf, ftw_dir, tmp_path):
    out = tmp_path / "exists.ftw"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        convert(hf, out, progress=False)
    convert(hf, out, progress=False, overwrite=True)
    assert is_ftw(out) and not (out / "keep.txt").exists()
    assert (out / "experts.bin").read_bytes() == (ftw_dir / "experts.bin").read_bytes()


def test_convert_command(hf, tmp_path, capsys):
    argv = ["convert", str(hf), str(tmp_path / "cli.ftw"), "--no-progress", "--dtype", "bfloat16"]
    assert main(argv) == 0
    assert "FTW v2, 48 bf16 experts" in capsys.readouterr().out
    assert read_manifest(tmp_path / "cli.ftw").layout["format"] == "bf16"
    assert main(argv) == 2  # exists now, without --overwrite
    assert "exists and is not empty" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ direct I/O fallback


def _sources(d: Path):
    src = ftw.bank_source(read_manifest(d), d)
    pool = HostExpertPool(src.rows, src.layout)
    return [(src, pool.bank)], pool


def test_o_direct_refused_at_open_falls_back_to_buffered(ftw_dir, hf_runner, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_io.os, "open", no_direct)
    jobs, pool = _sources(ftw_dir)
    st = read_banks(jobs, workers=3)
    assert not st.direct and st.verified and len(st.fallbacks) == 1 and "refused at open" in st.fallbacks[0]
    assert torch.equal(pool.bank, hf_runner.pool.bank)


def test_o_direct_refused_at_read_falls_back_to_buffered(ftw_dir, hf_runner, monkeypatch):
    real_preadv = os.preadv
    direct_fds: set[int] = set()
    real_open = os.open

    def track_open(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def preadv(fd, bufs, off):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(direct_io.os, "open", track_open)
    monkeypatch.setattr(direct_io.os, "preadv", preadv)
    jobs, pool = _sources(ftw_dir)
    st = read_banks(jobs, workers=2)
    assert not st.direct and any("read refused" in f for f in st.fallbacks)
    assert torch.equal(pool.bank, hf_runner.pool.bank)


# ------------------------------------------------------------------------------------ pinning refused


def test_pin_decision_without_cuda(monkeypatch, caplog):
    pool = HostExpertPool.dense(4, 8, 8, torch.float32)
    calls = []
    monkeypatch.setattr(HostExpertPool, "pin", lambda self: calls.append(1) or False)
    assert pin_or_fallback(pool, torch.device("cpu")) == PinOutcome(False, False)
    assert not calls  # nothing to pin for a CPU engine
    with caplog.at_level(logging.WARNING, logger="edgemoe.weights.bootstrap"):
        out = pin_or_fallback(pool, torch.device("cuda"))  # a CUDA engine whose pinning is refused
    assert calls and out.fallback and not out.pinned
    assert "refused" in caplog.text and "cpu-all" in caplog.text and "pageable" in caplog.text
    monkeypatch.setattr(HostExpertPool, "pin", lambda self: True)
    ok = pin_or_fallback(pool, torch.device("cuda"))
    assert ok.pinned and not ok.fallback and ok.message == ""


def test_runner_serves_with_cpu_all_when_pinning_is_refused(ftw_dir, hf_runner, monkeypatch):
    import edgemoe.engine.model_runner as mr

    monkeypatch.setattr(mr, "pin_or_fallback", lambda pool, device: PinOutcome(False, True, 0.0, "refused"))
    cfg = EngineConfig(device="cpu", dtype="float32", expert_policy="fill-all", expert_cache_slots=16)
    r = ModelRunner(ftw_dir, cfg, progress=False)
    assert r.experts.policy.name == "cpu-all" and r.experts.cache.num_slots == 0 and not r.pinned
    assert "pinning refused, so policy cpu-all" in r.summary()
    assert greedy(r) == greedy(hf_runner)

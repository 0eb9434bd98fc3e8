"""``edgemoe profile`` on quantized checkpoints: B_P and B_H are measured on the deployed layout (packed rows), the
saved profile's file name and match key carry the format, and the engine uses only the profile of its format."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from quant_reference import quantized_checkpoint

from edgemoe.bench.profile import run_profile
from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.experts import native
from edgemoe.experts.bandwidth import PROFILE_VERSION, default_profile_path
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.weights import WeightFormat
from edgemoe.synth import make_model

ROTATE = 4 << 20  # bytes rotated over in these tests (the real profile rotates over 2 GB)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from edgemoe.experts import native

    native.build()  # once per process, from the real cache: the tests point EDGEMOE_CACHE (profiles) elsewhere
    root = tmp_path_factory.mktemp("profile")
    return {"bf16": make_model(root / "bf16", "qwen3_moe", "tiny", seed=7, dtype="bfloat16"),
            "nvfp4-ct": quantized_checkpoint(root / "nvfp4", "nvfp4-ct"),
            "fp8": quantized_checkpoint(root / "fp8", "fp8")}


def test_profile_is_measured_and_saved_per_format(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    # tiny 64x64 experts move far less than a real machine's GB/s: this test is
    # about keys and paths, the plausibility check has its own tests
    monkeypatch.setattr("edgemoe.bench.profile.implausible", lambda prof: None)
    cfg = EngineConfig(device="cpu")
    prof = run_profile(checkpoints["nvfp4-ct"], cfg, seconds=0.02, rotate_bytes=ROTATE)
    layout = ExpertLayout.build(WeightFormat.NVFP4, 64, 64)
    assert prof["path"] == str(tmp_path / "profile-64x64-nvfp4-cpu.json")
    assert prof["path"] == str(default_profile_path(layout, torch.device("cpu")))
    e = prof["expert"]
    assert (e["format"], e["hidden"], e["intermediate"], e["row_bytes"]) == ("nvfp4", 64, 64, layout.row_bytes)
    assert e["compute_dtype"] == "bfloat16" and prof["version"] == PROFILE_VERSION
    assert prof["fill_path"] == "memcpy"  # no CUDA: the "device cache" is host memory
    # the native kernels read NVFP4 rows where the extension builds; the torch executor is measured otherwise
    assert prof["cpu_executor"].startswith("native-") or not native.available()
    assert e["rotated_bytes"] >= ROTATE and prof["isolated"]["b_p_gbps"] > 0 and prof["isolated"]["b_h_gbps"] > 0
    bf16 = run_profile(checkpoints["bf16"], cfg, seconds=0.02, rotate_bytes=ROTATE)
    assert bf16["path"] == str(tmp_path / "profile-64x64-bf16-cpu.json")
    assert bf16["expert"]["row_bytes"] > e["row_bytes"]


def test_engine_uses_the_profile_of_its_format(checkpoints, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    monkeypatch.setattr("edgemoe.bench.profile.implausible", lambda prof: None)
    monkeypatch.setattr("edgemoe.experts.bandwidth.implausible", lambda prof: None)
    cfg = EngineConfig(device="cpu", expert_policy="qstar", expert_cache_slots=5)
    for name, (bp, bh) in (("fp8", (3.0, 4.0)), ("bf16", (5.0, 6.0))):  # the same expert shape, two formats
        prof = run_profile(checkpoints[name], cfg, seconds=0.01, rotate_bytes=ROTATE)
        saved = json.loads(open(prof["path"]).read())
        saved["concurrent"] = {"b_p_gbps": bp, "b_h_gbps": bh}  # recognizable numbers
        open(prof["path"], "w").write(json.dumps(saved))
    for name, fmt, pair in (("fp8", WeightFormat.FP8_BLOCK, (3.0, 7.0)), ("bf16", WeightFormat.BF16, (5.0, 11.0))):
        runner = ModelRunner(checkpoints[name], cfg, progress=False)
        bw = runner.experts.bandwidths
        assert runner.pool.format is fmt and (bw.pcie, bw.cpu) == pair
        assert f"profile-64x64-{fmt.value}-cpu.json" in bw.source
    # a profile saved by an older edgemoe (another version) is not used, and the log says so
    old = tmp_path / "profile-64x64-bf16-cpu.json"
    saved = json.loads(old.read_text())
    old.write_text(json.dumps({**saved, "version": PROFILE_VERSION - 1}))
    with caplog.at_level(logging.WARNING, logger="edgemoe.experts.bandwidth"):
        bw = ModelRunner(checkpoints["bf16"], cfg, progress=False).experts.bandwidths
    assert "profile-64x64-bf16-cpu.json" not in bw.source
    assert any(f"profile version {PROFILE_VERSION - 1}" in r.getMessage() and "measuring again" in r.getMessage()
               for r in caplog.records)
    prof = json.loads((tmp_path / "profile-64x64-fp8_block-cpu.json").read_text())
    prof["path"] = str(tmp_path / "profile-64x64-fp8_block-cpu.json")
    with pytest.raises(ValueError, match=r"profile is for another expert format.*this engine deploys bf16 experts"):
        ModelRunner(checkpoints["bf16"], EngineConfig(device="cpu", expert_policy="qstar", expert_cache_slots=5,
                                                      profile_path=prof["path"]), progress=False)


def test_the_fill_kernels_rate_needs_a_page_locked_pool_on_cuda():
    """B_P through the decode step's gather kernel applies to a page-locked pool on CUDA only; elsewhere the profile
    measures the copy (``fill_meter``), and ``measure_fill`` refuses with a reason."""
    from edgemoe.experts.bandwidth import fill_meter, measure_copy, measure_fill
    from edgemoe.experts.pool import HostExpertPool

    pool = HostExpertPool.dense(4, 64, 64, torch.bfloat16)
    assert fill_meter(pool, torch.device("cpu")) is measure_copy
    with pytest.raises(ValueError, match="page-locked pool and a CUDA device"):
        measure_fill(pool, torch.device("cpu"), 0.01)

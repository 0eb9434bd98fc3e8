"""A new user's first start: options are never silently ignored, bad ones fail at once in one line,
start-up says what it does, and counters survive a cache resize."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from edgemoe.cli import main
from edgemoe.config import EngineConfig
from edgemoe.engine.llm import LLM
from edgemoe.engine.sampling import SamplingParams
from edgemoe.experts import bandwidth, native
from edgemoe.experts.bandwidth import ImplausibleMeasurement, implausible

from conftest import ROOT

CPU = dict(device="cpu", dtype="float32", cpu_executor="torch", max_model_len=256)


def _stderr_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- make-model


def test_make_model_refuses_an_existing_model_without_overwrite(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--dtype", "float32",
                 "--config-only"]) == 0
    stale = out / "model-00002-of-00002.safetensors"
    stale.write_bytes(b"left over from a larger model")
    capsys.readouterr()
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and "exists and is not empty" in err[0] and "--overwrite" in err[0]
    assert stale.exists()  # nothing touched
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--overwrite"]) == 0
    assert not stale.exists() and (out / "model.safetensors").is_file()

    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    assert main(["make-model", "--preset", "tiny", "--out", str(other), "--overwrite"]) == 2
    assert "not a model directory" in capsys.readouterr().err and (other / "todo.txt").exists()


def test_make_model_help_lists_each_preset_once(capsys):
    """``make-model --help`` listed ``tiny`` four times (once per architecture that has one)."""
    with pytest.raises(SystemExit):
        main(["make-model", "--help"])
    usage = capsys.readouterr().out.split("--preset {", 1)[1].split("}", 1)[0].split(",")
    assert len(usage) == len(set(usage)) and "tiny" in usage and "gpt-oss-20b" in usage


# ---------------------------------------------------------------- options that used to be ignored


def test_missing_profile_is_an_error(tiny_model_dir, tmp_path, capsys):
    missing = tmp_path / "missing.json"
    with pytest.raises(ValueError, match="no such file"):
        EngineConfig(profile_path=str(missing))
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu", "--profile",
                 str(missing)]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and str(missing) in err[0] and "edgemoe profile" in err[0]


@pytest.mark.parametrize("flags, named", [(["--gpu-headroom-gb", "5"], "gpu_headroom_gb 5.0"),
                                          (["--doorbell-wait", "stream-op"], "doorbell_wait stream-op"),
                                          (["--doorbell-wait", "kernel"], "doorbell_wait kernel"),
                                          (["--join-lateness", "graded"], "join_lateness graded"),
                                          (["--enforce-eager"], "enforce_eager True")])
def test_cuda_options_on_a_cpu_device_are_refused(tiny_model_dir, capsys, flags, named):
    """Options of the CUDA decode path were silently ignored on ``--device cpu`` (as ``--gpu-budget`` and
    ``--expert-cache-gb`` are not; ``POST /admin/memory`` refuses ``headroom_gb`` there too)."""
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu", *flags]) == 1
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith(f"edgemoe: error: {named} (") and "is a CUDA option" in err[0], err
    assert "the device is cpu" in err[0]


def test_expert_cache_slots_and_gb_together_are_refused(tiny_model_dir, capsys):
    """Both sizes given: the slots won and the GB went unread (``POST /admin/expert-cache`` refuses both)."""
    with pytest.raises(ValueError, match="expert_cache_slots and expert_cache_gb both given"):
        EngineConfig(expert_cache_slots=8, expert_cache_gb=1.0)
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--expert-cache-slots", "8",
                 "--expert-cache-gb", "1"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and "expert_cache_slots and expert_cache_gb both given" in err[0], err


def test_more_cpu_threads_than_cpus_is_refused(tiny_model_dir, capsys):
    """``--cpu-threads 100000`` started that many torch threads: "can't start new thread", then a segfault."""
    many = (os.cpu_count() or 1) + 1
    with pytest.raises(ValueError, match=f"cpu_threads {many}: more than the {many - 1} logical CPUs"):
        EngineConfig(cpu_threads=many)
    assert EngineConfig(cpu_threads=many - 1).cpu_threads == many - 1
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu", "--cpu-threads", "100000"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("edgemoe: error: cpu_threads 100000: more than the "), err


def test_chat_template_kwargs_without_chat_is_refused(tiny_model_dir, capsys, monkeypatch):
    """``generate --chat-template-kwargs`` without ``--chat`` was ignored: a plain prompt has no template."""
    import edgemoe.engine.llm as llm

    monkeypatch.setattr(llm, "LLM", lambda *a, **k: pytest.fail("LLM() reached"))
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu", "--chat-template-kwargs",
                 '{"enable_thinking": false}']) == 2
    err = _stderr_lines(capsys)
    assert err == ["edgemoe: error: --chat-template-kwargs: applies to the chat template, which only --chat uses"]


@pytest.mark.parametrize("flags, said", [
    (["--seed", "7"], "edgemoe: seed 7: seeds dummy weights only (load_format dummy); these are read from HF "
                      "safetensors, so it is not used"),
    (["--no-verify-weights"], "edgemoe: verify_weights False: applies to the checksums of an FTW checkpoint"),
])
def test_options_of_other_weight_formats_are_said_to_be_unused(tiny_model_dir, capsys, flags, said):
    """``--seed`` (dummy weights) and ``--no-verify-weights`` (FTW) on an HF checkpoint were ignored without a word."""
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--max-tokens", "1", "--device", "cpu",
                 "--cpu-executor", "torch", *flags]) == 0
    assert any(ln.rsplit("\r", 1)[-1].startswith(said) for ln in _stderr_lines(capsys))


def test_context_length_and_rope_scaling(tiny_model_dir, capsys):
    from edgemoe.models import load_config

    cfg = load_config(tiny_model_dir)
    assert cfg.context_length() == cfg.max_position_embeddings == 4096
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    yarn = load_config({**raw, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 2048}})
    assert yarn.context_length() == 8192
    linear = load_config({**raw, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.context_length() == 8192

    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu",
                 "--max-model-len", "100000"]) == 1
    err = _stderr_lines(capsys)
    assert len(err) == 1 and "max_model_len 100000 exceeds the model's context length 4096" in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "serve", "profile"])
def test_device_cuda_without_cuda_is_one_line(tiny_model_dir, capsys, monkeypatch, command):
    import edgemoe.server.app as app

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("serve() reached without CUDA"))
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", str(_free_port())] if command == "serve" else []
    assert main([command, str(tiny_model_dir), *extra, "--device", "cuda"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("edgemoe: error: --device cuda:") and "CUDA is not available" in err[0]


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flags, named", [
    (["--device", "meta"], "--device meta: device type 'meta' is not supported"),  # loaded, then failed on .item()
    (["--record-routing", "{tmp}/missing/routing.jsonl"], "--record-routing {tmp}/missing/routing.jsonl: No such file"),
    (["--record-routing", "{tmp}"], "--record-routing {tmp}: Is a directory"),  # both failed after the load
])
def test_bad_values_fail_before_loading(tiny_model_dir, tmp_path, capsys, monkeypatch, command, flags, named):
    """A value that cannot work is one line naming the flag before the weights load (which can take
    minutes), not ``model failed to load: ...`` after them."""
    import edgemoe.engine.llm as llm
    import edgemoe.server.app as app

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("serve() reached"))
    monkeypatch.setattr(llm, "LLM", lambda *a, **k: pytest.fail("LLM() reached"))
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", str(_free_port())]
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert main([command, str(tiny_model_dir), *extra, *flags]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("edgemoe: error: " + named.format(tmp=tmp_path)), err


def test_an_empty_api_key_is_refused(tiny_model_dir, capsys, monkeypatch):
    """``--api-key ""`` (e.g. ``--api-key "$KEY"`` with KEY unset) served every route without a key."""
    import edgemoe.server.app as app

    monkeypatch.setattr(app, "serve", lambda *a, **k: pytest.fail("serve() reached"))
    monkeypatch.setenv("EDGEMOE_API_KEY", "from-the-environment")
    for key in ("", "  "):
        assert main(["serve", str(tiny_model_dir), "--port", str(_free_port()), "--api-key", key]) == 2
        err = _stderr_lines(capsys)
        assert len(err) == 1 and err[0].startswith("edgemoe: error: --api-key: empty"), err


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.mark.parametrize("broken_by, named", [("truncated weights", "model.safetensors"),
                                              ("no tokenizer files", "no usable tokenizer")])
def test_serve_exits_when_the_model_fails_to_load(tiny_model_dir, tmp_path, broken_by, named):
    """A checkpoint that fails to load (truncated weights; no tokenizer files, where transformers would
    build an empty tokenizer from config.json and every prompt would be empty) stops the server at once
    with one error line, instead of a server answering 503, or serving nothing, forever."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors" and not (broken_by == "no tokenizer files" and f.name in TOKENIZER_FILES):
            (broken / f.name).write_bytes(f.read_bytes())
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    cut = len(weights) // 2 if broken_by == "truncated weights" else len(weights)
    (broken / "model.safetensors").write_bytes(weights[:cut])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "edgemoe", "serve", str(broken), "--device", "cpu", "--port",
                        str(_free_port()), "--log-level", "warning"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("edgemoe:")]
    assert len(ours) == 1 and ours[0].startswith("edgemoe: error: model failed to load:"), r.stderr
    assert named in ours[0] and "Traceback" not in r.stderr


def test_load_error_while_reading_starts_its_own_line(tmp_path, capsys):
    """A checkpoint that fails while its tensors are read (here a NaN FP8 scale) left the progress bar open:
    the error line was written after the bar's text, on the same terminal line."""
    from safetensors.torch import load_file, save_file

    from edgemoe.synth import make_model

    d = make_model(tmp_path / "m", "qwen3_moe", "tiny", seed=1, quant="fp8")
    sd = load_file(d / "model.safetensors")
    name = "model.layers.3.mlp.experts.15.down_proj.weight_scale_inv"  # the last expert read
    sd[name] = torch.full(sd[name].shape, float("nan")).to(sd[name].dtype)
    save_file(sd, d / "model.safetensors")
    assert main(["generate", str(d), "--prompt", "hi", "--device", "cpu", "--cpu-executor", "torch"]) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.split("\n") if "edgemoe: error:" in ln)
    assert line.rsplit("\r", 1)[-1].startswith(f"edgemoe: error: {d / 'model.safetensors'}: tensor {name} "), err


def test_model_paths_that_are_not_model_directories(tiny_model_dir, tmp_path, capsys):
    """A weights file, a Hugging Face cache entry and the hub cache itself: one line pointing at the
    directory to pass instead."""
    weights = tiny_model_dir / "model.safetensors"
    entry = tmp_path / "hub" / "models--org--tiny"
    snapshot = entry / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (entry / "snapshots" / "ffff0000").mkdir()  # an older snapshot without files
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("0123abcd")
    (snapshot / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    for path, expected in ((weights, f"is a file, not a model directory; pass the model directory holding it, "
                                     f"{str(tiny_model_dir)!r}"),
                           (entry, f"it is a Hugging Face cache entry: pass its snapshot directory, {str(snapshot)!r}"),
                           (entry.parent, "it is a Hugging Face hub cache: pass one model's snapshot directory"),
                           (tmp_path / "nowhere", "does not exist")):
        for command in ("serve", "generate"):
            assert main([command, str(path), "--prompt", "hi"] if command == "generate" else [command, str(path)]) == 2
            err = _stderr_lines(capsys)
            assert len(err) == 1 and err[0].startswith("edgemoe: error: ") and expected in err[0], err


def test_a_directory_where_a_file_belongs_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """``profile --out DIR`` and ``replay-routing DIR`` ended in an ``IsADirectoryError`` traceback (profile's
    after its measurement)."""
    import edgemoe.bench.profile as profile

    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: pytest.fail("measured"))
    assert main(["profile", str(tiny_model_dir), "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = _stderr_lines(capsys)
    assert err == [f"edgemoe: error: --out {tmp_path}: is a directory; give the path of the profile JSON to write"]
    assert main(["replay-routing", str(tmp_path), "--no-plot"]) == 1
    err = _stderr_lines(capsys)
    assert len(err) == 1 and err[0].startswith("edgemoe: error: ") and "Is a directory" in err[0], err


def test_a_directory_without_a_tokenizer_is_refused(tiny_model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name not in TOKENIZER_FILES:
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"bare: no usable tokenizer .*tokenizer\.json"):
        LLM(str(bare), progress=False, **CPU)


# ---------------------------------------------------------------- bandwidths


def _profile(bp=12.0, bh=30.0, rounds=None, other=0.1, **kw) -> dict:
    return {"version": bandwidth.PROFILE_VERSION, "device": "cpu", "cpu_executor": "torch",
            "machine": {"cpu_threads": torch.get_num_threads(), "cores": 2, "other_processes_cores": other},
            "expert": {"hidden": 64, "intermediate": 64, "dtype": "float32", "row_bytes": 49152,
                       "rotated_bytes": 1 << 29},
            "isolated": {"b_p_gbps": bp, "b_h_gbps": bh}, "concurrent": {"b_p_gbps": bp / 2, "b_h_gbps": bh / 2},
            "rounds": rounds or {"b_p_gbps": [bp] * 3, "b_h_gbps": [bh] * 3}, **kw}


def test_a_profile_with_both_bandwidth_overrides_is_refused(tiny_model_dir, tmp_path, capsys):
    """``--profile`` with both ``--bandwidth-*-gbps`` went unread (its fixed costs too)."""
    saved = tmp_path / "p.json"
    saved.write_text(json.dumps(_profile()))
    assert EngineConfig(profile_path=str(saved), bandwidth_pcie_gbps=10.0).profile_path == str(saved)  # B_H read
    assert main(["generate", str(tiny_model_dir), "--prompt", "hi", "--device", "cpu", "--profile", str(saved),
                 "--bandwidth-pcie-gbps", "10", "--bandwidth-cpu-gbps", "20"]) == 2
    err = _stderr_lines(capsys)
    assert len(err) == 1 and "leave nothing of the profile to read" in err[0] and str(saved) in err[0], err


def test_plausibility_rules():
    assert implausible(_profile()) is None
    assert "below the 0.1 GB/s" in implausible(_profile(bp=0.02))
    assert "B_H rounds disagree" in implausible(_profile(rounds={"b_p_gbps": [12, 12, 12], "b_h_gbps": [30, 8, 30]}))
    assert "other processes kept 1.6 of 2 cores busy" in implausible(_profile(other=1.6))
    assert implausible(_profile(other=None)) is None  # not measured (no /proc/stat): not held against it


def test_lone_bandwidth_overrides_are_honoured(tiny_model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    opts = dict(CPU, expert_cache_slots=8, expert_policy="qstar")
    with caplog.at_level(logging.INFO, logger="edgemoe.startup"):
        runner = LLM(str(tiny_model_dir), progress=False, bandwidth_pcie_gbps=3.0, **opts).engine.runner
    bw = runner.experts.bandwidths
    assert bw.pcie == 3.0 and bw.cpu > 0 and bw.source.startswith("B_P command line, B_H quick start-up measurement")
    assert "B_P command line, B_H quick" in runner.summary()
    assert any("measuring B_P and B_H" in r.getMessage() for r in caplog.records)

    layout = runner.pool.layout
    saved = bandwidth.default_profile_path(layout, torch.device("cpu"))

    def profile_of_this_pool(**kw) -> dict:
        prof = _profile(**kw)
        prof["expert"].update(format=layout.format.value, row_bytes=layout.row_bytes)
        return prof

    saved.write_text(json.dumps(profile_of_this_pool()))
    runner = LLM(str(tiny_model_dir), progress=False, bandwidth_cpu_gbps=7.0, **opts).engine.runner
    bw = runner.experts.bandwidths
    assert (bw.pcie, bw.cpu) == (6.0, 7.0) and bw.source == f"B_P profile {saved} (concurrent pair), B_H command line"

    saved.write_text(json.dumps(profile_of_this_pool(bp=0.02)))  # a saved implausible profile is not used
    with caplog.at_level(logging.WARNING, logger="edgemoe.experts.bandwidth"):
        runner = LLM(str(tiny_model_dir), progress=False, bandwidth_cpu_gbps=7.0, **opts).engine.runner
    assert runner.experts.bandwidths.source.startswith("B_P quick start-up measurement")
    assert any("not used, implausible measurement" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="implausible measurement"):  # ... and named explicitly, an error
        LLM(str(tiny_model_dir), progress=False, profile_path=str(saved), **opts)


def test_measurement_records_rounds_and_machine_load(tiny_model_dir):
    from edgemoe.experts.cpu_executor import TorchCpuExecutor
    from edgemoe.experts.pool import HostExpertPool
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat

    layout = ExpertLayout.build(WeightFormat.for_dtype(torch.float32), 64, 64)
    ex = TorchCpuExecutor(HostExpertPool(1, layout, torch.float32))
    prof = bandwidth.measure(None, layout, torch.device("cpu"), ex, 0.15, 1 << 24)
    assert len(prof["rounds"]["b_p_gbps"]) == len(prof["rounds"]["b_h_gbps"]) == bandwidth.ROUNDS
    assert prof["isolated"]["b_p_gbps"] in prof["rounds"]["b_p_gbps"]  # the median round
    assert prof["machine"]["cores"] >= 1
    if sys.platform == "linux":
        assert prof["machine"]["other_processes_cores"] >= 0


def test_profile_saves_only_a_plausible_measurement(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`edgemoe profile` writes a plausible measurement and refuses a starved one (B_P 0.02 GB/s, as
    recorded under contention), saving nothing. The measurements are fixed here so the outcome does
    not depend on how busy the test machine is (the real measurement is covered above)."""
    from edgemoe.bench.profile import run_profile

    monkeypatch.setattr(bandwidth._MachineLoad, "cores", lambda self: 0.05)
    monkeypatch.setattr(bandwidth, "measure_cpu", lambda *a, **k: 20.0)
    monkeypatch.setattr(bandwidth, "measure_copy", lambda *a, **k: 10.0)
    out = tmp_path / "p.json"
    cfg = EngineConfig(device="cpu", dtype="float32", cpu_executor="torch")
    run_profile(tiny_model_dir, cfg, out, seconds=0.15)
    saved = json.loads(out.read_text())
    assert saved["isolated"] == {"b_p_gbps": 10.0, "b_h_gbps": 20.0} and implausible(saved) is None
    out.unlink()
    monkeypatch.setattr(bandwidth, "measure_copy", lambda *a, **k: 0.02)
    with pytest.raises(ImplausibleMeasurement, match=r"nothing saved: isolated B_P 0\.02 GB/s"):
        run_profile(tiny_model_dir, cfg, out, seconds=0.15)
    assert not out.exists()
    assert main(["profile", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--cpu-executor", "torch",
                 "--out", str(out)]) == 1
    assert "implausible measurement, nothing saved" in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------- start-up progress and the native build


def test_startup_says_what_it_does(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="edgemoe.startup"):
        LLM(str(tiny_model_dir), progress=False, **CPU)
    lines = [r.getMessage() for r in caplog.records if r.name == "edgemoe.startup"]
    assert any(ln.startswith("loading Qwen3MoeForCausalLM from") and ln.endswith("...") for ln in lines), lines
    assert any(ln.startswith("loading Qwen3MoeForCausalLM from") and ": done in" in ln for ln in lines), lines


def test_native_build_cache_key_covers_what_the_build_depends_on(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    base = native.build_dir()
    assert base.parent == tmp_path / "torch_ext" and base == native.build_dir()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/site-packages/torch/__init__.py")
    other_venv = native.build_dir()
    monkeypatch.undo()
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "CSRC", tmp_path / "other-checkout" / "csrc")
    (tmp_path / "other-checkout").mkdir()
    (tmp_path / "other-checkout" / "csrc").symlink_to(native.Path(native.__file__).parent / "csrc")
    other_checkout = native.build_dir()
    monkeypatch.setattr(native, "CSRC", native.Path(native.__file__).resolve().parent / "csrc")
    monkeypatch.setattr(native, "EXTRA_CFLAGS", ("-O2",))
    other_flags = native.build_dir()
    monkeypatch.setattr(native, "EXTRA_CFLAGS", ("-O3",))
    monkeypatch.setenv("EDGEMOE_NATIVE_CFLAGS", "-DEDGEMOE_PREFETCH_ROWS=4")
    env_flags = native.build_dir()
    assert native.cflags()[-1] == "-DEDGEMOE_PREFETCH_ROWS=4"
    assert len({base, other_venv, other_checkout, other_flags, env_flags}) == 5
    key = native.build_key()
    assert {"sources", "source_dir", "flags", "compiler", "torch", "python", "platform"} <= set(key)
    assert torch.__version__ in key["torch"] and sys.version in key["python"]


def test_the_native_extension_builds_wherever_it_can():
    """The kernel tests skip where the extension is unavailable; where nothing rules it out (Linux, a C++ compiler),
    a failed build is a failure here, with the compiler's first error, not a suite of skips."""
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    assert native.build().error is None, native.build().error


def test_first_native_build_is_announced_with_an_estimate(monkeypatch, tmp_path, caplog):
    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    monkeypatch.setenv("EDGEMOE_CACHE", str(tmp_path))
    cpp = native._cpp_extension()
    monkeypatch.setattr(cpp, "load", lambda **kw: "module")  # the compile itself is tested by the kernel tests
    with caplog.at_level(logging.INFO, logger="edgemoe.startup"):
        result = native.build.__wrapped__()
    msgs = [r.getMessage() for r in caplog.records if r.name == "edgemoe.startup"]
    assert result.module == "module" and not result.cached
    assert msgs[0].startswith("compiling the native CPU expert kernels, once, into")
    assert "about" in msgs[0] and "cores" in msgs[0] and ": done in" in msgs[1]


# ---------------------------------------------------------------- counters, threads


def test_expert_counters_survive_a_resize(tiny_model_dir):
    from prometheus_client import CollectorRegistry, generate_latest

    from edgemoe.engine.metrics import ExpertCacheCollector

    llm = LLM(str(tiny_model_dir), progress=False, expert_cache_slots=6, expert_policy="fill-all", **CPU)
    runner = llm.engine.runner
    reg = CollectorRegistry()
    reg.register(ExpertCacheCollector(runner.expert_stats))

    def totals() -> dict[str, float]:
        out = {}
        for line in generate_latest(reg).decode().splitlines():
            if line.startswith("edgemoe_expert_") and "_total{" in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(["counters must not decrease"], params)
    before = totals()
    assert before['edgemoe_expert_cache_misses_total{phase="decode"}'] > 0
    runner.resize_expert_cache(slots=3, policy="cpu-all")
    assert totals() == before  # the new cache starts cold, the totals carry on
    llm.generate(["counters must not decrease"], params)
    after = totals()
    assert all(after[k] >= v for k, v in before.items())
    cpu = 'edgemoe_expert_cpu_executed_total{phase="decode"}'
    assert after[cpu] > before[cpu]


def test_importing_edgemoe_first_makes_torch_threads_wait_passively():
    code = "import edgemoe, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.stdout.strip() == "PASSIVE", r.stderr
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env,
                       "OMP_WAIT_POLICY": "ACTIVE"}, timeout=120)
    assert r.stdout.strip() == "ACTIVE", r.stderr  # the user's choice is kept


def _lines(*lines):
    it = iter(lines)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_chat_commands_stay_local_and_replies_are_capped(tiny_model_dir, monkeypatch, capsys):
    import io

    import edgemoe.server.chat_client as chat_client
    from edgemoe.server.chat_client import ChatSession, Output, main_loop

    from conftest import start_agent_server

    options = {"max_model_len": 1024, "dtype": "float32", "cpu_executor": "torch"}
    with start_agent_server(tiny_model_dir, "tiny", engine_options=options) as srv:
        srv.scripts.push("one two three four five six seven eight nine ten")  # longer than the cap
        buf = io.StringIO()
        session = ChatSession(srv.openai(), "tiny", max_tokens=4)
        lines = _lines("/help", "/bogus and words", "//etc/hosts is mine", "/EXIT", "never read")
        assert main_loop(session, lines, Output(buf, use_rich=False)) == 0
        text = buf.getvalue()
        assert all(name in text for name in ("/help", "/reset", "/exit")) and "unknown command /bogus" in text
        assert "[reply cut at max_tokens=4" in text
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
        assert session.messages[0]["content"] == "/etc/hosts is mine"  # `//` sends one slash
        srv.wait_idle()
        metrics = srv.llm.metrics.render().decode()
        assert 'edgemoe_requests_total{finish_reason="length"} 1.0' in metrics  # only the // line reached the model
        assert "edgemoe_prompt_tokens_total" in metrics

        seen = {}
        monkeypatch.setattr(chat_client, "main_loop", lambda s, read, out: seen.update(s.sampling) or 0)
        assert main(["chat", "--base-url", srv.base + "/v1"]) == 0
        assert seen == {"max_tokens": 1024}  # a cap is always sent (`--max-tokens`, default 1024)
    assert main(["chat", "--max-tokens", "0"]) == 2 and "--max-tokens" in capsys.readouterr().err
    for bad in ("-1", "nan", "inf"):  # each turn was sent and refused by the server
        assert main(["chat", "--temperature", bad]) == 2
        assert _stderr_lines(capsys) == [f"edgemoe: error: --temperature must be a finite number >= 0, got "
                                         f"{float(bad)}"]


def _status_error(cls, status: int, message: str):
    import httpx

    request = httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions")
    return cls(f"Error code: {status} - {message}", response=httpx.Response(status, request=request), body=None)


def test_chat_reports_server_errors_and_keeps_the_conversation(monkeypatch, capsys):
    """A turn the server refuses (an unknown model, a bad --temperature, a server gone) ended the chat with
    a traceback; now it is one line, the chat goes on, and the failed turn is not resent with the next."""
    import io
    from types import SimpleNamespace

    import httpx
    import openai

    import edgemoe.server.chat_client as chat_client
    from edgemoe.server.chat_client import ChatSession, Output, main_loop

    sent = []
    # the HTTP library the installed SDK is built on (httpx, or httpx2 in later releases): a stream cut short
    # raises its own error, not one of openai's
    http_lib = sys.modules[openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0]]
    assert http_lib.HTTPError in chat_client.transport_errors()

    def create(messages, **kw):
        sent.append([m["content"] for m in messages])
        if len(sent) == 1:
            raise _status_error(openai.NotFoundError, 404, "The model `nosuch` does not exist.")
        if len(sent) == 2:
            raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1/chat/completions"))
        raise http_lib.RemoteProtocolError("peer closed connection without sending complete message body")

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
    buf = io.StringIO()
    session = ChatSession(client, "nosuch", max_tokens=4)
    assert main_loop(session, _lines("first", "second", "third", "/exit"), Output(buf, use_rich=False)) == 0
    text = buf.getvalue()
    assert "[error: Error code: 404 - The model `nosuch` does not exist.]" in text
    assert "[error: Connection error.]" in text
    assert "[error: peer closed connection without sending complete message body]" in text
    assert sent == [["first"], ["second"], ["third"]] and session.messages == []

    class Refusing:  # the server answers /v1/models with 401
        def __init__(self, **kw):
            self.models = SimpleNamespace(list=self.list)

        def list(self):
            raise _status_error(openai.AuthenticationError, 401, "Invalid API key")

    monkeypatch.setattr(openai, "OpenAI", Refusing)
    monkeypatch.setattr(chat_client, "main_loop", lambda *a: pytest.fail("chat started"))
    assert main(["chat", "--base-url", "http://127.0.0.1:9/v1"]) == 2
    err = _stderr_lines(capsys)
    assert err == ["edgemoe: error: http://127.0.0.1:9/v1: Error code: 401 - Invalid API key"], err


def test_readme_lists_every_subcommand():
    from edgemoe.cli import build_parser

    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"edgemoe {name}" in readme, f"README.md does not show `edgemoe {name}`"
    assert Path(ROOT / "scripts" / "quickstart.sh").stat().st_mode & 0o111


# ---------------------------------------------------------------- bf16: what is exact


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> Path:
    from edgemoe.synth import make_model

    return make_model(tmp_path_factory.mktemp("tiny-bf16") / "tiny", "qwen3_moe", "tiny", dtype="bfloat16")


POLICIES = {  # name: engine options; "resident" is the reference
    "fill-all, 8 slots": dict(expert_cache_slots=8, expert_policy="fill-all"),  # batch overflow to the CPU
    "qstar, 8 slots": dict(expert_cache_slots=8, expert_policy="qstar", bandwidth_pcie_gbps=10, bandwidth_cpu_gbps=25),
    "static, 16 slots": dict(expert_cache_slots=16, expert_policy="static"),
    "cpu-all": dict(expert_policy="cpu-all"),
}


@pytest.mark.parametrize("executor", ["native", "torch"])
def test_bf16_greedy_tokens_do_not_depend_on_the_policy(tiny_bf16, executor):
    """In bf16 the CPU executors round where the device path does (x, gate, up, SiLU, the activation,
    y, the router weight and y·w as bf16 values), so every policy decodes the all-resident run's tokens
    here; the remaining difference, float32 summation order inside dot products, is in the README."""
    if executor == "native" and native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    prompts = ["The capital of France is", "Once upon a time", "def fib(n):", "1 2 3 4"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    opts = dict(device="cpu", max_model_len=256, cpu_executor=executor)

    def tokens(**kw) -> list[list[int]]:
        llm = LLM(str(tiny_bf16), progress=False, **opts, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    resident = tokens(expert_cache_slots=10**6, expert_policy="fill-all")
    for name, kw in POLICIES.items():
        assert tokens(**kw) == resident, f"{name} ({executor} CPU executor) decoded other tokens than all-resident"

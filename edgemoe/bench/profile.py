"""``edgemoe profile``: measure B_P and B_H on this machine for a model's deployed expert rows and save them.

Reads only the model's metadata (``config.json``, the safetensors headers or the FTW manifest; no weights)
to find the row layout the engine deploys (format and shape: packed FP8 / MXFP4 / NVFP4 rows or float rows,
:func:`edgemoe.weights.loader.deployed_layout`); random valid rows of that layout are synthesized and
rotated over ``ROTATE_BYTES_PROFILE`` bytes (far more than the last-level cache), and measured with the
CPU executor the engine would use for them (``edgemoe.experts.bandwidth.measure``). The profile is saved
under a name keyed by format and shape, which the engine looks up.
"""

from __future__ import annotations

import json
from pathlib import Path

from edgemoe.config import EngineConfig, parse_dtype
from edgemoe.engine.expert_runtime import configure_torch_threads
from edgemoe.experts.bandwidth import (
    ROTATE_BYTES_PROFILE,
    ImplausibleMeasurement,
    default_profile_path,
    implausible,
    measure,
)
from edgemoe.experts.cpu_executor import make_cpu_executor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.models import load_config
from edgemoe.startup import startup_step
from edgemoe.weights.dtypes import checkpoint_dtype
from edgemoe.weights.loader import deployed_layout


def run_profile(model_dir: str | Path, config: EngineConfig, out_path: str | Path | None = None,
                seconds: float = 1.0, rotate_bytes: int = ROTATE_BYTES_PROFILE) -> dict:
    """Measure this machine for ``model_dir``'s deployed expert rows and save the profile JSON.

    Args:
        model_dir: a checkpoint directory (Hugging Face, FTW, or ``config.json`` alone with
            ``--load-format dummy``).
        config: engine options (device, dtype, load format, CPU executor and threads are used).
        out_path: where to write (default: the per-format-and-shape path the engine looks up).
        seconds: measuring time per bandwidth.
        rotate_bytes: bytes of rows rotated over (default: far more than a last-level cache).

    Returns:
        The profile dict (``edgemoe.experts.bandwidth``'s format) with ``"path"`` set.

    Raises:
        ImplausibleMeasurement: the measurement fails ``implausible`` (e.g. other processes loaded
            the CPU); nothing is written.
    """
    cfg = load_config(model_dir)
    dtype = checkpoint_dtype(cfg.torch_dtype, model_dir) if config.dtype == "auto" else parse_dtype(config.dtype)
    device = config.resolved_device()
    configure_torch_threads(config.cpu_threads)
    layout = deployed_layout(model_dir, dtype, config.load_format)
    act = cfg.expert_activation
    executor = make_cpu_executor(HostExpertPool(1, layout, dtype, act), config.cpu_threads, config.cpu_executor)
    threads = f"{executor.threads} thread{'s' if executor.threads != 1 else ''}"
    with startup_step(f"measuring B_P and B_H on the {executor.name} CPU executor, {threads}",
                      f"about {4 * seconds + 1:.0f} s; keep the machine otherwise idle"):
        prof = measure(None, layout, device, executor, seconds, rotate_bytes, compute_dtype=dtype, activation=act)
    reason = implausible(prof)
    if reason is not None:
        raise ImplausibleMeasurement(f"implausible measurement, nothing saved: {reason} (re-run on an idle machine)")
    path = Path(out_path) if out_path else default_profile_path(layout, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=2))
    prof["path"] = str(path)
    return prof

"""``edgemoe profile``: measure B_P and B_H on this machine for a model's expert shape and save them.

Reads only the model's ``config.json`` (no weights): experts of the model's shape are synthesized and
rotated over ``ROTATE_BYTES_PROFILE`` bytes (far more than the last-level cache), and measured with
the CPU executor the engine would use (``edgemoe.experts.bandwidth.measure``).
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


def run_profile(model_dir: str | Path, config: EngineConfig, out_path: str | Path | None = None,
                seconds: float = 1.0) -> dict:
    """Measure this machine for ``model_dir``'s expert shape and save the profile JSON.

    Args:
        model_dir: a checkpoint directory (its ``config.json``).
        config: engine options (device, dtype, CPU executor and threads are used).
        out_path: where to write (default: the per-shape path the engine looks up).
        seconds: measuring time per bandwidth.

    Returns:
        The profile dict (``edgemoe.experts.bandwidth``'s format) with ``"path"`` set.

    Raises:
        ImplausibleMeasurement: the measurement fails ``implausible`` (e.g. other processes loaded
            the CPU); nothing is written.
    """
    cfg = load_config(model_dir)
    dtype = parse_dtype(cfg.torch_dtype if config.dtype == "auto" else config.dtype)
    device = config.resolved_device()
    configure_torch_threads(config.cpu_threads)
    executor = make_cpu_executor(HostExpertPool(1, cfg.hidden_size, cfg.moe_intermediate_size, dtype),
                                 config.cpu_threads, config.cpu_executor)
    threads = f"{executor.threads} thread{'s' if executor.threads != 1 else ''}"
    with startup_step(f"measuring B_P and B_H on the {executor.name} CPU executor, {threads}",
                      f"about {4 * seconds + 1:.0f} s; keep the machine otherwise idle"):
        prof = measure(None, cfg.hidden_size, cfg.moe_intermediate_size, dtype, device, executor, seconds,
                       ROTATE_BYTES_PROFILE)
    reason = implausible(prof)
    if reason is not None:
        raise ImplausibleMeasurement(f"implausible measurement, nothing saved: {reason} (re-run on an idle machine)")
    path = Path(out_path) if out_path else default_profile_path(cfg.hidden_size, cfg.moe_intermediate_size, dtype,
                                                                device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=2))
    prof["path"] = str(path)
    return prof

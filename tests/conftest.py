"""Shared pytest fixtures: tiny random-weight checkpoints built once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

FIXTURES = ROOT.parent / "shared" / "fixtures"  # ../shared beside the checkout (CI lays it there too)
QWEN3_TOKENIZER_DIR = FIXTURES / "tokenizers" / "qwen3"

# Tiny test models gain nothing from intra-op threads, and OpenMP spin-waiting on a busy 2-core CI
# machine made a decode step ~10x slower (measured: 100 steps 12.9 s with 2 threads vs 1.0 s with 1).
torch.set_num_threads(int(os.environ.get("EDGEMOE_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The ``tiny`` qwen3_moe preset with the built-in tokenizer, saved in float32 so batched and
    single-sequence greedy decoding agree exactly (no bf16 rounding ties)."""
    from edgemoe.weights.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny", "qwen3_moe", "tiny", dtype="float32")


@pytest.fixture(scope="session")
def qwen3_tokenizer_model_dir(tmp_path_factory) -> Path:
    """``tiny`` geometry with the real Qwen3 tokenizer (skipped when the fixture is absent)."""
    if not (QWEN3_TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"Qwen3 tokenizer fixture not found at {QWEN3_TOKENIZER_DIR}")
    from edgemoe.weights.make_model import make_model

    return make_model(
        tmp_path_factory.mktemp("tiny_qwen3tok") / "tiny-qwen3tok",
        "qwen3_moe",
        "tiny",
        tokenizer=QWEN3_TOKENIZER_DIR,
        dtype="float32",
    )

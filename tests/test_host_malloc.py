"""Freed host memory kept for reuse on a CPU device (``edgemoe.engine.host_malloc``): glibc's mallopt takes both
parameters, a CPU runner says so in its start-up summary, and ``keep_freed_host_memory=False`` leaves malloc alone.

The effect is measured, not asserted: CPU prefill of 8192 tokens with four Qwen3-30B-A3B layers on the development VM
went from about 2.15 million minor page faults to 0.33-0.38 million (``docs/benchmarks/peers.md``). Here a child
process checks the mechanism: with it, a freed 64 MB block is served again without faulting its pages in.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from edgemoe.config import EngineConfig
from edgemoe.engine import host_malloc
from edgemoe.engine.model_runner import ModelRunner

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason="glibc malloc only")

_FAULTS = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
if {keep}:
    from edgemoe.engine.host_malloc import keep_freed_memory
    assert keep_freed_memory() is not None
import threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def touch():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
def work():
    touch()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        touch()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
if {thread}:  # a thread started after the call (the server's engine thread)
    t = threading.Thread(target=work)
    t.start()
    t.join()
else:
    work()
"""


def _faults(keep: bool, thread: bool = False) -> int:
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", _FAULTS.format(root=root, keep=keep, thread=thread)],
                         capture_output=True, text=True, check=True, timeout=60)
    return int(out.stdout.strip())


@needs_glibc
@pytest.mark.parametrize("thread", [False, True])
def test_freed_blocks_are_reused_without_page_faults(thread):
    pages = (64 << 20) // 4096
    assert _faults(False, thread) >= 4 * pages  # glibc maps and unmaps a 64 MB block each time: every page faults
    assert _faults(True, thread) < pages // 10  # kept: the pages of the first block serve the next ones


def test_the_server_sets_it_before_its_engine_thread_starts(tiny_model_dir, monkeypatch):
    from edgemoe.engine import async_engine

    calls = []
    monkeypatch.setattr(async_engine, "keep_freed_memory", lambda: calls.append(1))
    async_engine.AsyncLLM(model_dir=tiny_model_dir, config=EngineConfig(device="cpu"), start=False)
    assert calls == [1]
    async_engine.AsyncLLM(model_dir=tiny_model_dir, config=EngineConfig(device="cpu", keep_freed_host_memory=False),
                          start=False)
    assert calls == [1]


@needs_glibc
def test_keep_freed_memory_reports_what_it_set():
    assert "keeps freed memory" in host_malloc.keep_freed_memory()


@needs_glibc
def test_a_cpu_runner_names_it_in_its_summary_and_the_option_turns_it_off(tiny_model_dir, monkeypatch):
    runner = ModelRunner(tiny_model_dir, EngineConfig(device="cpu"), progress=False)
    assert "host memory  glibc malloc keeps freed memory" in runner.summary()
    calls = []
    monkeypatch.setattr("edgemoe.engine.model_runner.keep_freed_memory", lambda: calls.append(1))
    off = ModelRunner(tiny_model_dir, EngineConfig(device="cpu", keep_freed_host_memory=False), progress=False)
    assert off.host_malloc is None and not calls and "host memory" not in off.summary()

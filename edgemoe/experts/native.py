"""The native CPU expert executor: C++ kernels on a persistent pinned thread pool.

The torch-ops executor reaches about a third of the host's DRAM read bandwidth on decode batches
(31 of 93 GB/s on the H200 host); a routed expert at T <= 8 is two GEMVs bound by the bytes of
weights read. This executor computes a step's CPU set with kernels that read every weight row once
for all of the expert's tokens, split across all cores by output rows (``csrc/executor.h``).

- **Build**: ``torch.utils.cpp_extension.load`` compiles ``csrc/*.cpp`` on first use (about 38
  CPU-seconds: 20 s on 2 idle cores, 12 s at best: the pybind11 bindings alone) into
  ``~/.cache/edgemoe/torch_ext/<name>-<hash>/``
  (``EDGEMOE_CACHE`` moves the root), announced on the ``edgemoe.startup`` logger with an estimate.
  The hash covers everything the build commands depend on (:func:`build_key`): the sources and
  their location, the flags, the compiler and its version, the torch installation's path and
  version, Python and the platform; so an edit rebuilds, and two virtualenvs or checkouts each keep
  their own build instead of rebuilding each other's.
  Without ninja (which ``load`` requires) the compiler is called directly with the same flags
  (``<hash>/direct/``). No compiler (or ``EDGEMOE_NATIVE=0``): :class:`NativeUnavailable` with a
  one-line reason, and :func:`edgemoe.experts.cpu_executor.make_cpu_executor` falls back to the
  torch executor.
- **ISA**: one binary for every x86-64 CPU; each kernel is compiled for its own target and picked at
  run time from cpuid: ``avx512bf16`` (``vdpbf16ps``: bf16 weights, and quantized weights computing
  in bf16; its MXFP4 / NVFP4 kernels multiply integers with ``vpdpbusd`` and also need AVX-512 VNNI)
  > ``avx512`` > ``avx2vnni`` (MXFP4 / NVFP4 computing in bf16 only: the same integer products with the
  256-bit AVX-VNNI ``vpdpbusd`` of CPUs without AVX-512, Intel client cores since Alder Lake) > ``avx2int``
  (the same, with AVX2's byte multiply-adds in place of ``vpdpbusd``: CPUs with neither, such as AMD Zen 2 and
  Zen 3) > ``avx2`` (+FMA) > ``scalar``. ``EDGEMOE_CPU_ISA=<level>`` (or ``isa=``) caps
  the level; a level the CPU lacks is never selected. float32 weights, and quantized rows computing in
  float32, stop at ``avx512``.
- **Bank**: the pool's byte bank is described once per pool (``ExpertBanks`` in ``csrc/executor.h``: base
  address, ``row_bytes``, every section's offset in a row and the compute dtype, :func:`expert_banks`).
  Kernels exist for bf16 and float32 rows and for the quantized rows at their packed size: FP8 e4m3 with
  128x128 float32 block scales, MXFP4 (e2m1 nibbles, E8M0 scale per 32) and NVFP4 (e2m1, e4m3 scale per
  16, float32 per-tensor multiplier), computing in bfloat16 or float32. They read the codes and scales
  straight from the row and dequantize in registers (``csrc/kernel_impl.h``, ``kernels_avx512bf16.cpp``);
  nothing is dequantized to memory. A pool without a kernel (float16 rows, quantized rows computing in
  float16, FP8 blocks that are not a power of two >= 16 columns: :func:`native_reason`) raises
  :class:`NativeUnavailable` and the factory falls back to the torch executor, which dequantizes.
- **Experts**: the activation of the pool's :class:`~edgemoe.config.ExpertActivation` (SiLU SwiGLU, or
  gpt-oss's clamped SwiGLU ``(clamp(u, ±limit) + 1) · g' · sigmoid(alpha · g')``, ``g' = min(g, limit)``)
  and, where the rows have bias sections (gpt-oss: float32 ``b13 [2I]``, ``b2 [H]``), each projection's
  bias added after its product, in every format and at every ISA level: the activation and the bias adds
  run in ``csrc/executor.cpp`` between the two GEMVs, the GEMV kernels are the same.
- **Numerics**: float32 accumulation. For bf16 weights the kernels round where the torch path
  (``edgemoe.experts.compute.swiglu_expert`` in bf16) and the GPU kernels (``kernels/expert_gemv``)
  do: x, gate, up, SiLU(gate), the SiLU·up activation, the down projection y, the router weight and
  y·weight become bf16 values (round-to-nearest-even, as ``.to(torch.bfloat16)``) before the float32
  sum over routes; with biases, each bias (cast to bf16) and each projection-plus-bias sum too; for the
  clamped SwiGLU, each op of ``gated_activation`` (the clamps, ``alpha · g'``, the sigmoid, ``g' · sigmoid``,
  ``u + 1`` and the product). What remains different is the order of float32 additions inside each dot
  product (this SIMD order vs oneDNN's or Triton's), a one-ulp bf16 flip where it crosses a
  rounding boundary (0.3-0.5% of outputs at H=2048). float32 weights compute in float32
  throughout. Quantized rows are post-scaled at every ISA level: the kernels multiply the codes' exact
  values (unscaled) by the activation, sum per group of elements sharing a scale, and multiply each group's
  partial sum by its float32 scale (FP8 ``scale``, MXFP4 ``2^(e - 127)``, NVFP4
  ``float32(float(e4m3) * multiplier)``): the format's exact weights, unrounded, in bf16 and float32 compute
  alike, where the torch path dequantizes each weight as :meth:`~edgemoe.quant.layout.ExpertLayout.dequant_rows`
  does and, in bf16, rounds it to bf16 (the same numbers for MXFP4, whose scales are powers of two; FP8 and
  NVFP4 agree within bf16 tolerance: ``docs/quantization.md``); the step rounds at the bf16 points above.
  The ``avx512bf16``, ``avx2vnni`` and ``avx2int`` FP4 kernels also round the activation's elements below 2^-6 of their
  lane of 8's largest (at 2^-13 of it: ``Q15_LANES`` in ``csrc/kernels.h``), within bf16 tolerance. The AVX-512-BF16
  instructions treat float32 subnormals as zero (bf16 weights below 2^-126, which no
  release has; bf16 activations below 2^-126), and the e4m3 NaN codes (which no quantizer writes) read as
  ±480 in the vector parts of the kernels, NaN in scalar code (``docs/quantization.md`` lists these edge
  cases). Kernels run with flush-to-zero and denormals-are-zero off (the caller's setting restored after),
  so ``torch.set_flush_denormal(True)`` changes no result. Results do not depend on the thread count.
- **Threads**: :func:`plan_threads` decides the count and the pinning, the one place that does:
  one per physical core, minus the cores that the threads beside the pool need (on CUDA one, for
  the Python thread and the CUDA driver), never more. The caller is thread 0, the others are
  pinned (``sched_setaffinity``; skipped where refused), spin ``spin_us`` (default 2000,
  ``EDGEMOE_CPU_SPIN_US``) after a step, yielding their core to any other runnable thread and
  stopping early when they find themselves preempted, then sleep. The GIL is released during a
  step. A CPU decode step's dense GEMVs run on the same threads (:meth:`DenseKernels.linear`).
- **Inside the CUDA graph**: :meth:`NativeCpuExecutor.make_step` registers (pinned)
  buffers once and returns a :class:`RegisteredStep`; :meth:`RegisteredStep.serve` starts a native
  thread that runs it whenever a device kernel rings its doorbell (``edgemoe/kernels/doorbell.py``),
  which is how ``edgemoe/experts/device_decode.py`` hands its CPU branch over inside the captured
  decode step. The C entry ``void edgemoe_run_step(void*)`` (``fn_address``/``address``) also fits
  ``cudaLaunchHostFunc``; the decode path stopped using that because the host node kept the GPU's
  other work waiting on the H200 (docs/benchmarks/decode.md).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from edgemoe.experts.compute import run_experts_torch
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels.cpu_work import carve_cpu_work, cpu_work_words
from edgemoe.quant.weights import WeightFormat
from edgemoe.startup import startup_step

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("bindings.cpp", "executor.cpp", "cpu_features.cpp", "kernels_scalar.cpp", "kernels_avx2.cpp",
           "kernels_avx2int.cpp", "kernels_avx2vnni.cpp", "kernels_avx512.cpp", "kernels_avx512bf16.cpp",
           "dense.cpp")
HEADERS = ("kernels.h", "kernel_impl.h", "fp4_int256.h", "executor.h", "dense.h")
EXTRA_CFLAGS = ("-O3",)


def cflags() -> list[str]:
    """The compiler flags of the build: ``EXTRA_CFLAGS`` and then ``EDGEMOE_NATIVE_CFLAGS`` (whitespace-separated,
    e.g. ``-DEDGEMOE_PREFETCH_ROWS=4`` to try another of ``csrc/kernel_impl.h``'s tuning constants on a
    machine; they are part of :func:`build_key`, so each set builds into its own directory)."""
    return [*EXTRA_CFLAGS, *os.environ.get("EDGEMOE_NATIVE_CFLAGS", "").split()]

EXT_NAME = "edgemoe_cpu_ext"
BUILD_CPU_SECONDS = 38  # compiler CPU time of a full build (g++ 12, AMD EPYC dev VM: 38.2 s user+sys)
BUILD_LONGEST_SECONDS = 12  # its longest source (bindings.cpp, pybind11): the wall time on many cores

ISA_LEVELS = ("scalar", "avx2", "avx2int", "avx2vnni", "avx512", "avx512bf16")  # index = the C++ Isa value
WEIGHT_FORMATS = {torch.float32: 0, torch.bfloat16: 1}  # dtypes of the float kernels (edgemoe::WeightFormat)
NATIVE_FORMATS = {WeightFormat.FP32: 0, WeightFormat.BF16: 1, WeightFormat.FP16: 2, WeightFormat.FP8_BLOCK: 3,
                  WeightFormat.MXFP4: 4, WeightFormat.NVFP4: 5}
"""Row format -> ``edgemoe::WeightFormat`` (``csrc/kernels.h``); which of them have kernels is the C++ side's answer."""
QUANTIZED_FORMATS = (WeightFormat.FP8_BLOCK, WeightFormat.MXFP4, WeightFormat.NVFP4)
"""Quantized row formats the native kernels dequantize in registers."""
X_FORMATS = {torch.float32: 0, torch.bfloat16: 1}
ACT_KINDS = {"silu": 0, "swiglu_oai": 1}
"""``ExpertActivation.kind`` -> ``edgemoe::ActKind`` (``csrc/executor.h``)."""

# Between two steps of a CPU-only decode the caller runs serial torch ops (norms, RoPE, attention:
# ~0.5 ms a layer on the dev VM); workers still spinning take the next GEMV at once: 2000 µs against
# 300 µs measured 3-8 % more tokens/s there. A spin never holds a core another thread wants (SpinWait).
DEFAULT_SPIN_US = 2000
# Steps reading fewer weight bytes run on the calling thread alone: waking the pool costs more.
DEFAULT_MIN_PARALLEL_BYTES = 256 * 1024
DEFAULT_MIN_CHUNK_BYTES = 256 * 1024
# An expert with more tokens than this in one step runs on the torch-ops path (oneDNN GEMM; AMX where
# present), which wins once the work stops being a bandwidth-bound GEMV (prefill on the CPU). Measured
# crossover on the 2-core dev VM (1 thread, Qwen3-30B-A3B expert): ~12 tokens; docs/benchmarks/cpu_executor.md.
DEFAULT_MAX_TOKENS_PER_EXPERT = 16

_STATUS = {
    1: (IndexError, "token index outside [0, T)"),
    2: (IndexError, "flat expert id outside [0, num_ids)"),
    3: (ValueError, "route offsets are not non-decreasing from 0"),
    4: (ValueError, "invalid arguments"),
    5: (ValueError, "step larger than the registered capacity"),
    6: (RuntimeError, "no kernel for this weight format on this CPU"),
    7: (RuntimeError, "internal error (allocation failure)"),
}


class NativeUnavailable(RuntimeError):
    """The native executor cannot be used here; ``str(err)`` is a one-line reason."""


# ---------------------------------------------------------------------------------------------- build
_SERVING: "weakref.WeakSet[RegisteredStep]" = weakref.WeakSet()  # steps whose doorbell server runs


@atexit.register
def _stop_servers() -> None:
    """Join every doorbell server before the interpreter frees the pinned buffers they poll."""
    for step in list(_SERVING):
        step.close()


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its import-time "No CUDA runtime is found"
    warning: the extension is CPU code and never needs CUDA."""
    log_ = logging.getLogger("torch.utils.cpp_extension")
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        import torch.utils.cpp_extension as cpp
    finally:
        log_.setLevel(level)
    return cpp


def build_key() -> dict[str, str]:
    """Everything the build's output depends on, as the build commands see it: the sources (names,
    contents and directory: ninja's build file records absolute paths, so a second checkout with the
    same sources would otherwise rebuild the first one's), the flags, the compiler (resolved path and
    ``--version``), the torch installation (path and version: its bundled pybind11 headers), Python
    (version, ABI tag, include directory) and the platform.
    """
    import subprocess
    import sysconfig

    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    cxx = os.environ.get("CXX", "c++")
    cxx_path = shutil.which(cxx) or cxx
    try:
        version = subprocess.run([cxx_path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unknown ({exc})"
    return {
        "sources": h.hexdigest(),
        "source_dir": str(CSRC),
        "flags": " ".join(cflags()),
        "compiler": f"{os.path.realpath(cxx_path)} {version.strip()}",
        "torch": f"{torch.__version__} {Path(torch.__file__).resolve().parent}",
        "python": f"{sys.version} {sys.implementation.cache_tag} {sysconfig.get_paths()['include']}",
        "platform": f"{sys.platform} {platform.machine()} {' '.join(platform.libc_ver())}",
    }


def build_dir() -> Path:
    """``<EDGEMOE_CACHE or ~/.cache/edgemoe>/torch_ext/<name>-<hash of build_key()>``."""
    h = hashlib.sha256(json.dumps(build_key(), sort_keys=True).encode())
    root = Path(os.environ.get("EDGEMOE_CACHE", Path.home() / ".cache" / "edgemoe"))
    return root / "torch_ext" / f"{EXT_NAME}-{h.hexdigest()[:16]}"


def build_estimate() -> str:
    """How long a first build takes here: ``BUILD_CPU_SECONDS`` spread over the usable cores (one
    compiler process per source), at least the longest source's time, e.g. ``"about 20 s on 2 cores"``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    seconds = math.ceil(max(BUILD_CPU_SECONDS / max(1, min(cores, len(SOURCES))), BUILD_LONGEST_SECONDS))
    return f"about {seconds} s on {cores} core{'s' if cores > 1 else ''}, more when they are busy"


def unavailable_reason() -> str | None:
    """Why the extension cannot be built or loaded here, without trying (``None``: it can)."""
    if os.environ.get("EDGEMOE_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return "disabled by EDGEMOE_NATIVE=0"
    if sys.platform != "linux":
        return f"native CPU kernels are built for Linux only (this is {sys.platform})"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler found ({cxx!r} is not on PATH; install g++ or set CXX)"
    return None


@contextlib.contextmanager
def build_lock(bdir: Path):
    """Serialize the processes that build or load the extension in ``bdir`` (created if missing).

    An exclusive ``flock`` on ``bdir/build.lock``, which the kernel drops when its holder dies however it
    dies. Held, it also removes a ``bdir/lock`` left behind: ``torch.utils.cpp_extension.load`` marks a
    build with that file and waits, forever and silently, while it exists, so a build killed by a timeout
    or Ctrl-C would otherwise hang every later start (every edgemoe build takes this lock first, so the
    file cannot belong to a live build).
    """
    import fcntl

    bdir.mkdir(parents=True, exist_ok=True)
    with open(bdir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = bdir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


def _build_direct(bdir: Path):
    """Build without ninja (``cpp_extension.load`` requires it): the compiler called directly, one
    process per source in parallel, same flags, output cached in ``bdir``; returns the module.

    The sources use no torch headers (only pybind11, shipped inside torch), so nothing links
    against libtorch. The caller holds :func:`build_lock`; the ``.so`` appears atomically.
    """
    import importlib.util
    import subprocess
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    include_paths = _cpp_extension().include_paths

    so = bdir / f"{EXT_NAME}.so"
    if not so.exists():
        cxx = os.environ.get("CXX", "c++")
        flags = [*cflags(), "-std=c++17", "-fPIC", f"-DTORCH_EXTENSION_NAME={EXT_NAME}",
                 *(f"-isystem{p}" for p in include_paths()), f"-isystem{sysconfig.get_paths()['include']}"]

        def compile_one(src: str) -> Path:
            obj = bdir / (Path(src).stem + ".o")
            cmd = [cxx, *flags, "-c", str(CSRC / src), "-o", str(obj)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"{cxx} failed on {src}: {r.stderr.strip()}")
            return obj

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objs = list(pool.map(compile_one, SOURCES))
        tmp = bdir / f"{EXT_NAME}.so.tmp{os.getpid()}"
        r = subprocess.run([cxx, "-shared", *map(str, objs), "-o", str(tmp), "-lpthread"], capture_output=True,
                           text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed to link: {r.stderr.strip()}")
        os.replace(tmp, so)
    spec = importlib.util.spec_from_file_location(EXT_NAME, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class BuildResult:
    """The outcome of building (or finding cached) and loading the extension, once per process.

    Attributes:
        module: the loaded extension, or ``None`` when unavailable.
        error: the one-line reason it is unavailable (``None`` when loaded).
        seconds: build/load time. cached: the ``.so`` was already built. dir: the build directory.
        builder: ``torch.utils.cpp_extension.load`` or ``direct (no ninja)``.
    """

    module: object | None
    error: str | None = None
    seconds: float = 0.0
    cached: bool = False
    dir: str = ""
    builder: str = ""


@functools.cache
def build() -> BuildResult:
    """Build (first use; cached per user and :func:`build_key`) and load the extension, once per process."""
    reason = unavailable_reason()
    if reason is not None:
        return BuildResult(None, reason)
    cpp = _cpp_extension()
    ninja = cpp.is_ninja_available()
    t0 = time.perf_counter()
    try:
        bdir = build_dir() if ninja else build_dir() / "direct"  # reads the sources: they may be missing
        cached = any(bdir.glob(f"{EXT_NAME}*.so"))
        with build_lock(bdir), contextlib.nullcontext() if cached else startup_step(
                f"compiling the native CPU expert kernels, once, into {bdir}", build_estimate()):
            if ninja:
                ext = cpp.load(name=EXT_NAME, sources=[str(CSRC / s) for s in SOURCES],
                               extra_cflags=cflags(), build_directory=str(bdir))
            else:  # e.g. a GPU host without network: no `pip install ninja` there
                ext = _build_direct(bdir)
    except Exception as e:  # compiler errors, missing sources, an unwritable cache, a broken toolchain
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        first = next((ln for ln in lines if "error:" in ln), lines[0] if lines else type(e).__name__)  # the compiler's
        log.debug("native CPU kernels failed to build", exc_info=e)
        return BuildResult(None, f"native CPU kernels failed to build: {first}")
    return BuildResult(ext, None, time.perf_counter() - t0, cached, str(bdir),
                       "torch.utils.cpp_extension.load" if ninja else "direct (no ninja)")


def load_extension():
    """The compiled module, building it on first use (cached per user and source version).

    Raises:
        NativeUnavailable: no compiler, disabled, or the build failed (reason in the message;
            the same reason is raised again on later calls without retrying).
    """
    result = build()
    if result.module is None:
        raise NativeUnavailable(result.error)
    return result.module


def available() -> bool:
    """Whether the extension builds/loads on this machine (builds it if needed)."""
    try:
        load_extension()
        return True
    except NativeUnavailable:
        return False


# ---------------------------------------------------------------------------------------------- ISA
def feature_bits() -> dict[str, int]:
    """Name → bit of the C++ feature mask (``avx2``, ``fma``, ``avx512f``, ``avx512bw``, ...)."""
    return dict(load_extension().feature_bits())


def cpu_features() -> dict[str, bool]:
    """Features of this CPU as the kernels see them (cpuid, and xgetbv for OS register support)."""
    mask = load_extension().cpu_features()
    return {name: bool(mask & bit) for name, bit in feature_bits().items()}


def _mask(features) -> int:
    if isinstance(features, int):
        return features
    bits = feature_bits()
    unknown = set(features) - set(bits)
    if unknown:
        raise ValueError(f"unknown CPU feature(s) {sorted(unknown)}; known: {sorted(bits)}")
    m = 0
    for name in features:
        m |= bits[name]
    return m


def _level(isa: str | None) -> int:
    if isa is None or isa in ("", "auto", "best"):
        return -1
    if isa not in ISA_LEVELS:
        raise ValueError(f"unknown ISA level {isa!r}; choose one of {ISA_LEVELS} (or 'auto')")
    return ISA_LEVELS.index(isa)


def isa_cap_from_env() -> str | None:
    """``EDGEMOE_CPU_ISA``: the highest ISA level the executor may use (unset/``auto``: no cap)."""
    v = os.environ.get("EDGEMOE_CPU_ISA", "").strip().lower()
    return None if v in ("", "auto", "best") else v


def select_isa(features, cap: str | None = None, dtype: torch.dtype | WeightFormat = torch.bfloat16,
               compute: torch.dtype = torch.bfloat16) -> str | None:
    """The ISA level the executor picks for ``features`` (names or a mask) — the C++ function itself.

    Args:
        features: iterable of feature names (see :func:`feature_bits`) or a bitmask; may be fake.
        cap: highest level allowed (``None``: no cap).
        dtype: weight dtype, or a row :class:`~edgemoe.quant.weights.WeightFormat` (``float32`` has no
            ``avx512bf16`` kernel and gets ``avx512``).
        compute: a quantized format's compute dtype: its ``avx512bf16``, ``avx2vnni`` and ``avx2int`` kernels
            compute in bfloat16, so in ``float32`` only the levels whose kernels take float32 activations count
            (``avx512``, ``avx2``, ``scalar``).

    Returns:
        A name from :data:`ISA_LEVELS`, or ``None`` when the format has no native kernel.
    """
    fmt = NATIVE_FORMATS.get(dtype) if isinstance(dtype, WeightFormat) else WEIGHT_FORMATS.get(dtype)
    if fmt is None:
        return None
    bf16_compute = dtype not in QUANTIZED_FORMATS or compute == torch.bfloat16
    level = load_extension().select_isa(_mask(features), _level(cap), fmt, bf16_compute)
    return None if level < 0 else ISA_LEVELS[level]


def supported_isas(dtype: torch.dtype | WeightFormat = torch.bfloat16,
                   compute: torch.dtype = torch.bfloat16) -> list[str]:
    """Every level this CPU can run for ``dtype`` (a weight dtype or a row format computing in ``compute``),
    lowest first (what the tests force in turn)."""
    mask = load_extension().cpu_features()
    out = []
    for cap in ISA_LEVELS:
        lvl = select_isa(mask, cap, dtype, compute)
        if lvl is not None and lvl not in out:
            out.append(lvl)
    return out


def isa_report() -> dict:
    """Features, supported levels and the level picked per weight dtype and per quantized row format
    (computing in bfloat16) under ``EDGEMOE_CPU_ISA``."""
    cap = isa_cap_from_env()
    kinds = {**{str(d).replace("torch.", ""): d for d in WEIGHT_FORMATS}, **{f.value: f for f in QUANTIZED_FORMATS}}
    return {
        "features": cpu_features(),
        "supported": {name: supported_isas(k) for name, k in kinds.items()},
        "cap": cap,
        "selected": {name: select_isa(load_extension().cpu_features(), cap, k) for name, k in kinds.items()},
    }


def physical_core_cpus() -> list[int]:
    """One logical CPU per physical core among those this process may run on, in CPU order.

    Reads ``/sys/devices/system/cpu/cpuN/topology`` (package, core); where it cannot, every allowed
    CPU counts as a core.
    """
    seen, out = set(), []
    for cpu in _allowed_cpus():
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            core = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            core = ("cpu", str(cpu))
        if core not in seen:
            seen.add(core)
            out.append(cpu)
    return out or [0]


def _allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


ALONGSIDE_CUDA = 1
"""Cores the executor leaves free on a CUDA device: the Python thread launches and waits for the GPU
while the pool computes, and the CUDA driver runs threads of its own; on the device decode path the
pool's worker 0 is the doorbell server thread, so nothing of the pool runs on the Python thread."""


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the context, restored after."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass(frozen=True)
class ThreadPlan:
    """Thread count and pinning of the native executor's pool (from :func:`plan_threads`).

    Attributes:
        threads: pool threads, worker 0 included (the calling thread, or the doorbell server thread).
        cpus: CPU per thread id (``[]``: unpinned). Entry 0 is worker 0's core: the doorbell server
            pins itself there; a calling Python thread is never pinned (its affinity is not ours).
        limit: most threads that never oversubscribe the cores (``cores - reserved``).
        cores: physical cores this process may run on. reserved: cores left to the threads that run
            beside the pool (``alongside`` minus the spare SMT siblings).
        requested: the count asked for (``None``: the default, ``limit``).
        note: why ``threads`` differs from ``requested`` (``None`` when it does not).
        torch_threads: torch's intra-op threads during a CPU forward whose dense GEMVs all run on the
            pool (a decode step, :meth:`NativeCpuExecutor.forward_threads`): 1. What torch still computes there (norms,
            RoPE, decode attention) is small, and an OpenMP team costs a scheduler slice at its
            barrier whenever one of its threads has lost its core to the pool or to another process.
    """

    threads: int
    cpus: tuple[int, ...]
    limit: int
    cores: int
    reserved: int
    requested: int | None
    note: str | None
    torch_threads: int = 1


def plan_threads(requested: int | None = None, alongside: int = 0, pin: bool = True,
                 cores: list[int] | None = None, logical: int | None = None, oversubscribe: bool = False) -> ThreadPlan:
    """The native executor's thread count and pinning: the one place edgemoe decides them.

    A pool thread that shares its core with another busy thread loses whole scheduler slices (ms),
    and a step waits for its slowest thread, so the pool never takes more cores than are free of the
    threads that must run beside it (``alongside``: on CUDA the Python thread and the CUDA driver's,
    :data:`ALONGSIDE_CUDA`; CPU-only, the calling thread is worker 0 and nothing else runs). Spare SMT
    siblings of the pinned cores host those threads instead of a whole core. On the H200 host (16
    cores, no SMT) decode with 16 pool threads beside the Python thread ran 30 % slower than with 15.

    Args:
        requested: threads asked for (``--cpu-threads``; ``None``: the most that never oversubscribe).
            A larger count is capped (``note`` says so).
        alongside: busy threads outside the pool that need a core while the pool computes.
        pin: pin pool threads to one physical core each (the last ``threads`` cores, so the
            first ones stay free for the threads alongside).
        cores: physical-core CPUs (default :func:`physical_core_cpus`). logical: logical CPUs this
            process may use (default: its affinity mask).
        oversubscribe: take ``requested`` as given even beyond ``limit`` (threads past the cores are
            not pinned): tests of thread-count independence, and benchmarks that reproduce an
            oversubscribed machine.

    Returns:
        A :class:`ThreadPlan`.

    Raises:
        ValueError: ``requested < 1`` or ``alongside < 0``.
    """
    if requested is not None and requested < 1:
        raise ValueError(f"threads must be >= 1, got {requested}")
    if alongside < 0:
        raise ValueError(f"alongside must be >= 0, got {alongside}")
    cores = list(physical_core_cpus() if cores is None else cores)
    logical = len(_allowed_cpus()) if logical is None else int(logical)
    reserved = min(len(cores) - 1, max(0, alongside - max(0, logical - len(cores))))
    limit = max(1, len(cores) - reserved)
    threads, note = limit, None
    if requested is not None:
        threads = int(requested) if oversubscribe else min(int(requested), limit)
        if threads < requested:
            note = (f"{requested} threads requested, {threads} used: {len(cores)} cores, {reserved} left to the "
                    f"threads that run beside the pool")
    cpus = tuple(cores[max(0, len(cores) - threads):]) if pin and threads <= len(cores) else ()
    return ThreadPlan(threads, cpus, limit, len(cores), reserved, requested, note)


# ---------------------------------------------------------------------------------------------- executor
def _raise_status(status: int, where: str) -> None:
    exc, msg = _STATUS.get(status, (RuntimeError, f"status {status}"))
    raise exc(f"{where}: {msg}")


def expert_banks(ext, pool: HostExpertPool):
    """The ``ExpertBanks`` description of ``pool``'s byte bank (``csrc/executor.h``): its base address,
    ``row_bytes``, geometry, format, every section's byte offset in a row (-1 where the format has none: the
    bias sections ``b13`` / ``b2`` exist for experts with biases) and the experts' activation (kind, alpha,
    limit).

    The pool must outlive every use of the description (the executor keeps a reference to it).
    """
    lay, act = pool.layout, pool.activation
    off = {s.name: s.offset for s in lay.sections}
    bn, bk = lay.block_size or (0, 0)
    return ext.ExpertBanks(base=pool.bank.data_ptr(), row_bytes=lay.row_bytes, num_ids=pool.num_ids,
                           hidden=lay.hidden, inter=lay.intermediate, fmt=NATIVE_FORMATS[lay.format],
                           w13_off=off["w13"], w2_off=off["w2"], w13_scale_off=off.get("w13_scale", -1),
                           w2_scale_off=off.get("w2_scale", -1), w13_scale2_off=off.get("w13_scale2", -1),
                           w2_scale2_off=off.get("w2_scale2", -1), b13_off=off.get("b13", -1),
                           b2_off=off.get("b2", -1), block_rows=bn, block_cols=bk,
                           compute=int(pool.compute_dtype == torch.bfloat16), act=ACT_KINDS[act.kind],
                           alpha=act.alpha, limit=act.limit)


def native_reason(pool: HostExpertPool) -> str | None:
    """Why the native kernels cannot compute ``pool``'s experts whatever the CPU (``None``: they can).

    Kernels exist for bf16 and float32 rows, and for FP8 block, MXFP4 and NVFP4 rows computing in bfloat16 or
    float32, for either activation (SiLU SwiGLU, gpt-oss's clamped SwiGLU) with or without expert biases; FP8
    scale blocks must be powers of two of at least 16 columns (128 x 128 in every release).
    """
    lay = pool.layout
    if lay.format not in (WeightFormat.BF16, WeightFormat.FP32, *QUANTIZED_FORMATS):
        return (f"no native kernel for {lay.format.value} expert rows (bf16, float32, fp8_block, mxfp4 and nvfp4 "
                "rows have them)")
    if lay.format in QUANTIZED_FORMATS and pool.compute_dtype not in (torch.bfloat16, torch.float32):
        return (f"no native kernel for {lay.format.value} expert rows computing in {pool.compute_dtype} "
                "(bfloat16 and float32 have them)")
    if lay.format is WeightFormat.FP8_BLOCK:
        bk = lay.block_size[1]
        if bk < 16 or bk & (bk - 1):
            return (f"no native kernel for FP8 block size {lay.block_size} (the kernels need power-of-two blocks "
                    "of >= 16 columns)")
    return None


class NativeCpuExecutor:
    """Runs a step's CPU set of routed experts with the native kernels (a ``CpuExecutor``, see
    ``edgemoe.experts.cpu_executor``; ``registers_steps``: :meth:`make_step` is available).

    Args:
        pool: the host expert pool; rows of a format with native kernels (bf16, float32; FP8 block, MXFP4 and
            NVFP4 computing in bfloat16 or float32: :func:`native_reason`).
        threads: worker threads including the caller (``None``: the most that never oversubscribe the
            cores; a larger count is capped: :func:`plan_threads`).
        alongside: busy threads outside the pool that need a core (:func:`plan_threads`;
            :data:`ALONGSIDE_CUDA` on a CUDA device).
        isa: highest ISA level to use (``None``: ``EDGEMOE_CPU_ISA``, else the best this CPU has).
        pin: pin the pool's threads to one physical core each (workers 1..n-1 at start, the doorbell
            server thread when it runs).
        oversubscribe: use ``threads`` even beyond the cores (:func:`plan_threads`).
        spin_us: µs a worker spins after a step before sleeping (``None``: ``EDGEMOE_CPU_SPIN_US`` or 2000).
        min_parallel_bytes: steps reading fewer weight bytes run on the caller alone (0: always parallel).
        min_chunk_bytes: a step's phase is cut into fewer chunks per thread (at least one each) where its chunks
            would read fewer weight bytes than this (0: four chunks per thread whatever their size): a chunk's
            rows are a few sequential streams that start cold, so small chunks of 4-bit rows read slowly.
        max_tokens_per_expert: experts with more tokens than this in a step run on the torch-ops path.

    Attributes:
        name: ``"native-<isa>"``, e.g. ``native-avx512bf16``. isa: the level in use for the pool's
        row format. threads: worker count. pinned: CPU per thread (-1: not pinned; thread 0 is the caller).
        plan: the :class:`ThreadPlan` the pool was built from; threads_note: its ``note``.

    Raises:
        NativeUnavailable: the extension cannot be built/loaded, or the pool's row format has no kernel.
        ValueError: unknown ``isa``.
    """

    registers_steps = True

    def __init__(self, pool: HostExpertPool, threads: int | None = None, *, alongside: int = 0, isa: str | None = None,
                 pin: bool = True, oversubscribe: bool = False, spin_us: int | None = None,
                 min_parallel_bytes: int = DEFAULT_MIN_PARALLEL_BYTES, min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
                 max_tokens_per_expert: int = DEFAULT_MAX_TOKENS_PER_EXPERT, _core=None, _plan=None):
        ext = load_extension()
        self.pool = pool
        self._fmt = NATIVE_FORMATS[pool.format]
        self.max_tokens_per_expert = int(max_tokens_per_expert)
        if _core is None:
            _plan = plan_threads(threads, alongside, pin, oversubscribe=oversubscribe)
            if _plan.note:
                log.info("native CPU executor: %s", _plan.note)
            if spin_us is None:
                spin_us = int(os.environ.get("EDGEMOE_CPU_SPIN_US", DEFAULT_SPIN_US))
            cap = isa if isa is not None else isa_cap_from_env()
            _core = ext.Executor(_plan.threads, list(_plan.cpus), _level(cap), int(spin_us), int(min_parallel_bytes),
                                 int(min_chunk_bytes))
        self._core = _core
        self.plan = _plan
        reason = native_reason(pool)
        if reason is not None:
            raise NativeUnavailable(reason)
        level = self._core.isa_for(self._fmt, pool.compute_dtype == torch.bfloat16)
        if level < 0:
            raise NativeUnavailable(f"no native kernel for {pool.format.value} expert rows on this CPU")
        self._banks = expert_banks(ext, pool)
        self.isa = ISA_LEVELS[level]
        self.name = f"native-{self.isa}"
        self.threads = self._core.threads
        self.threads_note = _plan.note if _plan is not None else None
        self.pinned = list(self._core.pinned)
        self._dense: DenseKernels | None = None

    @property
    def dense(self) -> "DenseKernels":
        """The native dense operations of a CPU decode step (:class:`DenseKernels`), its GEMVs on this
        executor."""
        if self._dense is None:
            self._dense = DenseKernels(self)
        return self._dense

    def forward_threads(self, rows: int) -> contextlib.AbstractContextManager:
        """A context for a CPU forward over ``rows`` tokens: with at most :attr:`max_tokens_per_expert` rows
        (a decode step, whose GEMVs run on this executor's pool through :attr:`dense`) torch's intra-op
        threads are :func:`plan_threads`' ``torch_threads`` inside and restored after; else nothing changes."""
        if rows > self.max_tokens_per_expert:
            return contextlib.nullcontext()
        return _torch_threads(self.plan.torch_threads)

    def with_pool(self, pool: HostExpertPool) -> "NativeCpuExecutor":
        """An executor over another pool sharing this one's threads (e.g. a bandwidth-rotation pool)."""
        return NativeCpuExecutor(pool, max_tokens_per_expert=self.max_tokens_per_expert, _core=self._core,
                                 _plan=self.plan)

    def trace_calls(self, capacity: int) -> None:
        """Record the next ``capacity`` calls of the executor's step (:meth:`run`, a registered step, the
        doorbell server's) for :meth:`traced`; 0 stops and drops the record (benchmarks: where a call's time
        goes; a clock read at each point of a recorded call, nothing otherwise)."""
        self._core.trace_calls(int(capacity))

    def traced(self) -> torch.Tensor:
        """The calls recorded since :meth:`trace_calls`: ``[calls, 3 + 4 * threads]`` int64 nanoseconds of the
        steady clock, per call the caller's ``[entry, dispatch to the pool, return]``, then per pool thread ``[start
        of its job, end of its phase-1 chunks (gate and up rows), exit from the barrier between the phases, end of
        its phase-2 chunks (down rows)]``; 0 where a thread did not run the call (a call small enough to run on the
        caller alone)."""
        return torch.tensor(self._core.traced(), dtype=torch.int64).view(-1, self._core.trace_stride)

    def run(self, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]], out: torch.Tensor) -> None:
        """Accumulate ``Σ weight · expert(x[token])`` into ``out`` (the GIL is released meanwhile).

        Args:
            x: ``[T, H]`` hidden states on the CPU (float32 and bfloat16 are used as they are; other
                float dtypes are converted to float32).
            work: per expert ``(flat_id, token_idx [n] int, weight [n] float)``. Experts with more
                than ``max_tokens_per_expert`` tokens run on the torch-ops path after the others,
                which run natively, accumulated in list order.
            out: ``[T, H]`` float32 contiguous CPU accumulator (added to, not overwritten).

        Raises:
            TypeError: ``out`` is not a contiguous float32 CPU tensor, or a tensor is not on the CPU.
            ValueError: shape mismatch (``x``/``out``/``H``, token and weight counts).
            IndexError: a token index outside ``[0, T)`` or an expert id outside the pool.
        """
        if not work:
            return
        self._check_io(x, out)
        fids, offsets, toks, wts, heavy = [], [0], [], [], []
        for item in work:
            fid, tok, wt = item
            n = tok.numel()
            if wt.numel() != n:
                raise ValueError(f"expert {fid}: {n} token indices but {wt.numel()} weights")
            if n > self.max_tokens_per_expert:
                heavy.append(item)
                continue
            fids.append(int(fid))
            offsets.append(offsets[-1] + n)
            toks.append(tok)
            wts.append(wt)
        if fids:
            self._run_native(x, fids, offsets, toks, wts, out)
        if heavy:  # GEMM-sized experts: the torch-ops path (oneDNN) is faster there
            run_experts_torch(self.pool, x, heavy, out)

    def run_grouped(self, x: torch.Tensor, fids: list[int], counts: list[int], tok: torch.Tensor, wt: torch.Tensor,
                    out: torch.Tensor) -> None:
        """:meth:`run` over routes already grouped by expert (``CpuExecutor.run_grouped``): one native call
        over ``tok`` / ``wt`` as they are when no expert has more than ``max_tokens_per_expert`` routes,
        else :meth:`run` over the split work. Raises as :meth:`run`."""
        if len(counts) != len(fids) or sum(counts) != tok.numel() or wt.numel() != tok.numel():
            raise ValueError(f"{len(fids)} experts with {len(counts)} route counts summing to {sum(counts)}, "
                             f"for {tok.numel()} token indices and {wt.numel()} weights")
        if not fids:
            return
        if max(counts) > self.max_tokens_per_expert:  # GEMM-sized experts among them: run() splits them off
            self.run(x, list(zip(fids, tok.split(counts), wt.split(counts))), out)
            return
        self._check_io(x, out)
        self._run_native(x, [int(f) for f in fids], [0, *itertools.accumulate(counts)], [tok], [wt], out)

    def _check_io(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
            raise TypeError(f"out must be a contiguous float32 CPU tensor, got {out.dtype} on {out.device}")
        if x.device.type != "cpu":
            raise TypeError(f"x must be on the CPU, got {x.device}")
        if x.dim() != 2 or x.shape[1] != self.pool.hidden or tuple(out.shape) != tuple(x.shape):
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must both be [T, {self.pool.hidden}]")

    def _run_native(self, x, fids, offsets, toks, wts, out) -> None:
        if x.dtype not in X_FORMATS:
            x = x.float()
        x = x.contiguous()
        tok = (toks[0] if len(toks) == 1 else torch.cat(toks)).to(torch.int64).contiguous()
        wt = (wts[0] if len(wts) == 1 else torch.cat(wts)).to(torch.float32).contiguous()
        if tok.device.type != "cpu" or wt.device.type != "cpu":
            raise TypeError("token indices and weights must be CPU tensors")
        st = self._core.run(self._banks, x.data_ptr(), X_FORMATS[x.dtype], x.shape[0], out.data_ptr(), fids, offsets,
                            tok.data_ptr(), wt.data_ptr())
        if st:
            _raise_status(st, f"{self.name}.run")

    @property
    def preempted_waits(self) -> int:
        """Waits between steps whose spin a worker cut short because it had lost its core (a sign of
        an oversubscribed machine; the worker then sleeps until the next step)."""
        return self._core.preempted_waits

    def linear(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T`` on the pool's threads with the native GEMV kernels (a linear layer without
        bias, for the few rows of a decode step: bound by the bytes of ``weight`` read, which every
        thread streams in its own row range).

        Args:
            x: ``[..., K]`` CPU tensor, float32 or bfloat16, last dim contiguous.
            weight: ``[N, K]`` CPU tensor in the executor's weight formats (bfloat16 or float32),
                rows contiguous. bf16 weights compute with ``x`` rounded to bf16 and float32
                accumulation, as torch's bf16 matmul does.
            out: optional ``[..., N]`` contiguous result (float32 or bfloat16); default a new tensor
                of ``x.dtype``.

        Returns:
            ``out`` (or the new ``[..., N]`` tensor).

        Raises:
            TypeError: a tensor off the CPU, or an unsupported dtype. ValueError: shapes do not match.
        """
        if x.device.type != "cpu" or weight.device.type != "cpu":
            raise TypeError(f"linear: tensors must be on the CPU, got x on {x.device}, weight on {weight.device}")
        if weight.dtype not in WEIGHT_FORMATS or x.dtype not in X_FORMATS:
            raise TypeError(f"linear: weight {weight.dtype} / x {x.dtype}: float32 and bfloat16 are supported")
        if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or weight.stride(1) != 1:
            raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [..., K] and "
                             "[N, K] with rows contiguous")
        N = weight.shape[0]
        if out is not None and (out.dtype not in X_FORMATS or not out.is_contiguous() or out.device.type != "cpu"
                                or tuple(out.shape) != (*x.shape[:-1], N)):
            raise ValueError(f"linear: out must be a contiguous float32/bfloat16 CPU tensor of shape "
                             f"{(*x.shape[:-1], N)}, got {out.dtype} {tuple(out.shape)}")
        return self._linear_checked(x, weight, out)

    def _linear_checked(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """:meth:`linear` on arguments already checked (a decode step's GEMVs check them once)."""
        N, K = weight.shape
        x2 = x.reshape(-1, K)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        if out is None:
            out = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
        st = self._core.linear(weight.data_ptr(), WEIGHT_FORMATS[weight.dtype], N, K,
                               weight.stride(0) * weight.element_size(), x2.data_ptr(), X_FORMATS[x2.dtype], M,
                               x2.stride(0), out.data_ptr(), X_FORMATS[out.dtype], N)
        if st:
            _raise_status(st, f"{self.name}.linear")
        return out

    def sum_f32(self, t: torch.Tensor) -> float:
        """Sum of a contiguous float32 CPU tensor read by all threads (the read-bandwidth test)."""
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise TypeError("sum_f32 needs a contiguous float32 CPU tensor")
        return self._core.sum_f32(t.data_ptr(), t.numel())

    def make_step(self, max_tokens: int, max_experts: int, max_routes: int | None = None,
                  x_dtype: torch.dtype = torch.float32, zero_out: bool = True,
                  pin_memory: bool = False) -> "RegisteredStep":
        """Register buffers for the C entry point (see :class:`RegisteredStep`); ``pin_memory``
        page-locks them so device copies into and out of them are asynchronous (and capturable)."""
        return RegisteredStep(self, max_tokens, max_experts, max_routes, x_dtype, zero_out, pin_memory)


class DenseKernels:
    """The dense bf16 operations of a CPU decode step as single native calls (``csrc/dense.cpp``):
    RMSNorm over rows, and an attention layer's decode work after its projections (per-head q/k
    RMSNorm, rotate-half RoPE, the K/V write into the paged cache, attention over the cached tokens);
    and, given an executor, the step's dense linear layers of few rows (:meth:`linear`: attention
    projections, routers, dense MLPs, the LM head) as GEMVs on its pool.

    On a CPU-only machine a decode step is otherwise a few hundred small torch operations per token
    whose own CPU time was about a third of the step (16-core Xeon, Qwen3-30B-A3B geometry, 16 layers:
    17 of 54 ms per token; 0.95 ms of every attention layer's 1.33 ms was not its GEMVs). Rounding follows
    the torch operations these replace (``edgemoe.layers.norm.RMSNorm``,
    ``edgemoe.layers.rotary.RotaryEmbedding``) except summation order:
    the norm statistic (a normalized value may move by one bf16 ulp) and attention, computed in float32
    and rounded once (torch's SDPA blocks and rounds in its own order).
    Given an executor, three calls take whole parts of a layer: :meth:`try_attention_layer` (q/k/v GEMV,
    attention, o GEMV), :meth:`try_moe_decode` (a softmax top-k MoE layer from its router to the residual add)
    and :meth:`try_moe_routes` (a MoE layer's given routes); :meth:`try_add_rms_norm` is a residual add and the
    norm after it. Norms run on the caller's thread (microseconds). Attention over the cached tokens is flash-decoding
    (Dao et al., 2023): each sequence's keys in chunks of a fixed 128, a part (max, exp-sum, weighted values)
    per chunk and KV head, then the parts merged in chunk order, so the result does not depend on the thread
    count; given an executor, its pool's threads share the chunks and the merges, else the caller computes them
    alone. It takes every context length: on one thread of the development VM, Qwen3-30B-A3B's attention (32
    query heads, 4 KV heads of 128) over 300-32000 cached tokens ran 1.3-2x faster than the torch path (norms,
    RoPE, the page gather and SDPA; ``benchmarks/cpu_attention.py``). The GEMVs split their rows over the
    executor's threads.

    Args:
        gemv: the executor whose pool computes :meth:`linear` and the attention (``None``: no linear is
            taken and attention runs on the caller's thread).

    Raises (constructor):
        NativeUnavailable: the extension does not build here.
    """

    max_rows = 64  # RMSNorm calls with more rows (a prefill chunk) stay on torch's threads

    def __init__(self, gemv: "NativeCpuExecutor | None" = None):
        self._ext = load_extension()
        # a weak reference: the executor caches this object, and a cycle would keep a replaced executor's
        # pinned thread pool alive until the cycle collector ran
        self._gemv = None if gemv is None else weakref.ref(gemv)
        self.max_linear_rows = 0 if gemv is None else gemv.max_tokens_per_expert  # more rows: a GEMM, oneDNN's

    def takes_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether :meth:`linear` takes ``x @ weight.T + bias``: bf16 ``x [..., K]`` and ``weight [N, K]`` (rows
        contiguous) on the CPU, at most :attr:`max_linear_rows` rows, a CPU bias or none."""
        return (x.dim() >= 1 and 0 < x.numel() <= self.max_linear_rows * x.shape[-1] and x.dtype == torch.bfloat16
                and weight.dtype == torch.bfloat16 and x.device.type == "cpu" and weight.device.type == "cpu"
                and weight.dim() == 2 and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1]
                and (bias is None or bias.device.type == "cpu"))

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` on the executor's GEMV kernels: ``[..., N]`` bf16, the product accumulated
        in float32 and rounded once (a bias added before that rounding), as torch's bf16 linear up to
        float32 summation order (:meth:`NativeCpuExecutor.linear`).

        Raises:
            ValueError: arguments :meth:`takes_linear` refuses.
        """
        if (y := self.try_linear(x, weight, bias)) is None:
            raise ValueError(f"linear: x {x.dtype} {tuple(x.shape)} on {x.device}, weight {weight.dtype} "
                             f"{tuple(weight.shape)}: bf16 CPU tensors, at most {self.max_linear_rows} rows")
        return y

    def try_linear(self, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`linear` where :meth:`takes_linear` takes the product (checked once), else ``None``.

        Raises:
            ValueError: the executor these kernels ran on was closed.
        """
        if not self.takes_linear(x, weight, bias):
            return None
        gemv = self._gemv()
        if gemv is None:
            raise ValueError("linear: the executor these kernels ran on was closed")
        if bias is None:
            return gemv._linear_checked(x, weight, None)
        y = gemv._linear_checked(x, weight, torch.empty(*x.shape[:-1], weight.shape[0]))  # float32
        return y.add_(bias).to(x.dtype)

    def try_moe_decode(self, x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
                       id_base: int, residual: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """One softmax top-k MoE layer of a CPU decode step whose every routed expert runs on the executor, as one
        native call (``Executor::moe_decode``): the router GEMV, softmax top-k routing, the experts and the residual
        add, with no torch operation between them. The same computation as the Python path it replaces
        (``TopKRouter``, ``HybridExperts`` with every route on the CPU, then ``residual + routed``): the same
        kernels over the routes in the same order, the logits rounded to bf16, the routing weights to bf16 and
        the routed sum to bf16 where that path rounds; the softmax differs only in its summation order and
        ``exp`` (float32 ulps, rarely one bf16 ulp of a weight), and equal probabilities at the k-th place keep
        the lower expert.

        Args:
            x: ``[T, H]`` bf16 CPU hidden states (the MLP input), at most :attr:`max_linear_rows` rows.
            router_weight: ``[E, H]`` bf16, rows contiguous (``Qwen3MoeTopKRouter``'s ``weight``).
            top_k, norm_topk_prob: the router's settings.
            id_base: flat id of the layer's expert 0 in the executor's pool (``moe_layer * E``).
            residual: ``[T, H]`` bf16 added to the result, or ``None``.

        Returns:
            ``(out [T, H] bf16, ids [T, k] int64 descending weight, weights [T, k] bf16, distinct experts run)``,
            or ``None`` where the call does not take these arguments (dtypes, devices, shapes, rows).

        Raises:
            ValueError: the executor these kernels ran on was closed. IndexError: ``id_base`` puts the layer's
                experts outside the executor's pool. RuntimeError: no kernel for the pool's rows on this CPU.
        """
        if (self._gemv is None or x.dim() != 2 or not 0 < x.shape[0] <= self.max_linear_rows
                or router_weight.dim() != 2):
            return None
        T, H = x.shape
        E = router_weight.shape[0]
        if (not self._is_bf16_cpu(x, router_weight) or not x.is_contiguous() or not router_weight.is_contiguous()
                or router_weight.shape[1] != H or not 1 <= top_k <= E):
            return None
        if residual is not None and (not self._is_bf16_cpu(residual) or residual.shape != x.shape
                                     or not residual.is_contiguous()):
            return None
        gemv = self._gemv()
        if gemv is None:
            raise ValueError("moe_decode: the executor these kernels ran on was closed")
        if gemv.pool.hidden != H:
            return None
        out = torch.empty(T, H, dtype=torch.bfloat16)
        ids = torch.empty(T, top_k, dtype=torch.int64)
        weights = torch.empty(T, top_k, dtype=torch.bfloat16)
        res = 0 if residual is None else residual.data_ptr()
        st, n = gemv._core.moe_decode(gemv._banks, x.data_ptr(), T, router_weight.data_ptr(), E, int(top_k),
                                      bool(norm_topk_prob), int(id_base), res, out.data_ptr(), ids.data_ptr(),
                                      weights.data_ptr(), 0)
        if st:
            _raise_status(st, f"{gemv.name}.moe_decode")
        return out, ids, weights, n

    def try_moe_routes(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                       id_base: int) -> tuple[torch.Tensor, int] | None:
        """A MoE layer's routed experts for routes any router computed, as one native call
        (``Executor::moe_decode`` without a router): the routes grouped by expert in ascending (expert, token, k)
        order, the two-phase expert step into a float32 sum, rounded to bf16 — what ``HybridExperts.forward``
        computes with every route on the CPU (``group_routes``, ``run_grouped``, ``.to(bfloat16)``), bit for bit,
        without its torch operations.

        Args:
            x: ``[T, H]`` bf16 CPU hidden states, at most :attr:`max_linear_rows` rows.
            ids: ``[T, k]`` int64 experts of the layer (``< num_experts``). weights: ``[T, k]`` float32 or bf16.
            num_experts: ``E``, experts per layer. id_base: flat id of the layer's expert 0 (``moe_layer * E``).

        Returns:
            ``(out [T, H] bf16, distinct experts run)``, or ``None`` where it does not take the arguments.

        Raises:
            ValueError: the executor was closed. IndexError: an id outside ``[0, num_experts)`` or a layer
                outside the pool. RuntimeError: no kernel for the pool's rows on this CPU.
        """
        if (self._gemv is None or x.dim() != 2 or not 0 < x.shape[0] <= self.max_linear_rows or not self._is_bf16_cpu(x)
                or not x.is_contiguous() or ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]
                or ids.device.type != "cpu" or weights.device.type != "cpu" or not 1 <= ids.shape[1] <= num_experts):
            return None
        gemv = self._gemv()
        if gemv is None:
            raise ValueError("moe_decode: the executor these kernels ran on was closed")
        if gemv.pool.hidden != x.shape[1]:
            return None
        ids = ids.to(torch.int64).contiguous()
        wts = weights.to(torch.float32).contiguous()
        T, H = x.shape
        out = torch.empty(T, H, dtype=torch.bfloat16)
        st, n = gemv._core.moe_decode(gemv._banks, x.data_ptr(), T, 0, int(num_experts), ids.shape[1], False,
                                      int(id_base), 0, out.data_ptr(), ids.data_ptr(), 0, wts.data_ptr())
        if st:
            _raise_status(st, f"{gemv.name}.moe_decode")
        return out, n

    @staticmethod
    def _is_bf16_cpu(*ts: torch.Tensor) -> bool:
        for t in ts:  # a loop, not all() over a generator: a decode step calls this a few hundred times
            if t.dtype != torch.bfloat16 or t.device.type != "cpu":
                return False
        return True

    def takes_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether :meth:`rms_norm` takes ``x [..., D]`` (bf16 on the CPU, at most :attr:`max_rows` rows
        of a contiguous last dim) with ``weight [D]`` bf16."""
        return (self._is_bf16_cpu(x, weight) and x.dim() >= 1 and x.shape[-1] == weight.numel() and x.numel() > 0
                and x.numel() <= self.max_rows * x.shape[-1] and x.stride(-1) == 1 and weight.is_contiguous())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, float32_scale: bool = False) -> torch.Tensor:
        """``RMSNorm(x) * weight`` over the last dim, ``[..., D]`` bf16 in and out (see the class docstring).

        Raises:
            ValueError: arguments :meth:`takes_norm` refuses.
        """
        if (y := self.try_rms_norm(x, weight, eps, float32_scale)) is None:
            raise ValueError(f"rms_norm: x {x.dtype} {tuple(x.shape)} on {x.device} with weight {weight.dtype} "
                             f"{tuple(weight.shape)}: bf16 CPU tensors, at most {self.max_rows} rows")
        return y

    def try_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     float32_scale: bool = False) -> torch.Tensor | None:
        """:meth:`rms_norm` where :meth:`takes_norm` takes it (checked once), else ``None``."""
        if not self.takes_norm(x, weight):
            return None
        D = x.shape[-1]
        x2 = x if x.dim() == 2 else x.reshape(-1, D)
        if x2.stride(0) < D:
            x2 = x2.contiguous()
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        self._ext.rms_norm_bf16(x2.data_ptr(), x2.shape[0], D, x2.stride(0), weight.data_ptr(), float(eps),
                                bool(float32_scale), y.data_ptr(), D)
        return y

    def try_add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                         float32_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residual add and the norm after it as one call: ``r = x + delta`` (rounded to bf16, as torch's bf16
        add) and ``(r, RMSNorm(r) * weight)`` as :meth:`rms_norm`; ``x``, ``delta`` ``[T, D]`` bf16 contiguous on
        the CPU (at most :attr:`max_rows` rows), else ``None``."""
        if (x.dim() != 2 or delta.shape != x.shape or not self.takes_norm(x, weight) or not self._is_bf16_cpu(delta)
                or not x.is_contiguous() or not delta.is_contiguous()):
            return None
        r = torch.empty(x.shape, dtype=torch.bfloat16)
        y = torch.empty(x.shape, dtype=torch.bfloat16)
        self._ext.add_rms_norm_bf16(x.data_ptr(), delta.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                                    float(eps), bool(float32_scale), r.data_ptr(), y.data_ptr())
        return r, y

    def takes_decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, batch) -> bool:
        """Whether :meth:`decode_attention` takes this step: bf16 CPU tensors, one new token per
        sequence (in batch order), at any context length."""
        if not self._is_bf16_cpu(q, k_cache) or batch.decode is not None:
            return False
        seqs = batch.seqs
        return bool(seqs) and len(seqs) == q.shape[0] and all(s.q_len == 1 and s.q_start == i
                                                              for i, s in enumerate(seqs))

    def _pages(self, batch, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """A decode step's ``[T, P]`` int64 page tables, ``[T]`` int64 KV lengths, ``[T]`` int64 KV slots and
        the slots the cache must have (every page and new slot below it), once per step.

        Raises:
            ValueError: a page table shorter than its sequence's KV length needs, or ``kv_slots`` not one
                per sequence.
        """
        key = ("dense_pages", page_size)
        if (got := batch.step_cache.get(key)) is None:
            seqs = batch.seqs
            width = max(1, max(-(-s.kv_len // page_size) for s in seqs))
            tables = torch.zeros(len(seqs), width, dtype=torch.int64)
            for i, s in enumerate(seqs):
                n = -(-s.kv_len // page_size)
                if s.page_table.numel() < n:
                    raise ValueError(f"decode_attention: sequence {s.seq_id} has {s.page_table.numel()} pages for "
                                     f"{s.kv_len} tokens of {page_size}")
                tables[i, :n] = s.page_table[:n]
            slots = batch.kv_slots.to(torch.int64).contiguous()
            if slots.numel() != len(seqs):
                raise ValueError(f"decode_attention: {slots.numel()} KV slots for {len(seqs)} sequences")
            need = max(int(tables.max()) * page_size + page_size, int(slots.max()) + 1)
            got = batch.step_cache[key] = (tables, torch.tensor([s.kv_len for s in seqs], dtype=torch.int64), slots,
                                           need)
        return got

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, eps: float, float32_scale: bool, cos: torch.Tensor | None,
                         sin: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor, batch,
                         page_size: int, scale: float) -> torch.Tensor:
        """One attention layer's decode step after its projections (see the class docstring).

        Args:
            q: ``[T, Hq * D]`` bf16 (rows contiguous; may be a view of a fused q/k/v output), one token of
                each of ``batch.seqs``. k, v: ``[T, Hk * D]`` bf16.
            q_norm, k_norm: ``[D]`` bf16 RMSNorm weights of the heads, or ``None`` (no norm). eps,
                float32_scale: as ``edgemoe.layers.norm.RMSNorm``.
            cos, sin: ``[T, R]`` bf16 RoPE tables (``RotaryEmbedding.step_tables``), ``R`` even and at most
                ``D``: rotate-half on the first ``R`` dims of each head; ``None``: no RoPE.
            k_cache, v_cache: one layer's ``[slots, Hk, D]`` bf16 KV planes; the new tokens go to
                ``batch.kv_slots``.
            batch: the step's ``ForwardBatch`` (sequences, KV slots, the step cache for page tables).
            page_size: tokens per KV page. scale: softmax scale.

        Returns:
            ``[T, Hq, D]`` bf16 attention output.

        Raises:
            ValueError: shapes or dtypes that do not fit, or a step :meth:`takes_decode_attention` refuses.
        """
        if q.dim() != 2 or k_cache.dim() != 3:
            raise ValueError(f"decode_attention: q {tuple(q.shape)} must be [T, Hq*D], caches {tuple(k_cache.shape)} "
                             "[slots, Hk, D]")
        T, Hk, D = q.shape[0], k_cache.shape[1], k_cache.shape[2]
        Hq = q.shape[1] // D
        if not self.takes_decode_attention(q, k_cache, batch) or not self._is_bf16_cpu(k, v):
            raise ValueError("decode_attention: bf16 CPU tensors and a decode step of one token per sequence")
        if (q.shape[1] != Hq * D or tuple(k.shape) != (T, Hk * D) or tuple(v.shape) != (T, Hk * D)
                or any(t.stride(1) != 1 for t in (q, k, v))):
            raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                             f"fit [T, Hq*D], [T, Hk*D] x 2 with caches {tuple(k_cache.shape)}")
        tail = self._attention_args(T, Hq, q_norm, k_norm, eps, float32_scale, cos, sin, k_cache, v_cache, batch,
                                    page_size, scale)
        out = torch.empty(T, Hq, D, dtype=torch.bfloat16)
        gemv = None if self._gemv is None else self._gemv()  # the pool's threads share the chunks, else this one
        st = self._ext.decode_attention_bf16(None if gemv is None else gemv._core, q.data_ptr(), k.data_ptr(),
                                             v.data_ptr(), q.stride(0), k.stride(0), v.stride(0), *tail, out.data_ptr())
        if st:
            raise ValueError(f"decode_attention: sizes refused (Hq {Hq}, Hk {Hk}, D {D}, page {page_size})")
        return out

    def _attention_args(self, T: int, Hq: int, q_norm, k_norm, eps: float, float32_scale: bool, cos, sin,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, batch, page_size: int, scale: float) -> tuple:
        """The native attention calls' arguments from ``tokens`` to ``scale`` (``DecodeAttentionArgs``), checked.

        Raises:
            ValueError: caches, norms or RoPE tables that do not fit, pages beyond the cache.
        """
        Hk, D = k_cache.shape[1], k_cache.shape[2]
        if (not self._is_bf16_cpu(k_cache, v_cache) or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or v_cache.shape != k_cache.shape or Hq % Hk):
            raise ValueError(f"decode_attention: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be one "
                             f"contiguous bf16 [slots, Hk, D] each, Hk dividing Hq = {Hq}")
        for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
            if w is not None and (w.dtype != torch.bfloat16 or w.numel() != D or not w.is_contiguous()):
                raise ValueError(f"decode_attention: {name} must be [{D}] bf16, got {w.dtype} {tuple(w.shape)}")
        R, cos_ld = 0, 0
        if cos is not None:
            R, cos_ld = cos.shape[-1], cos.stride(0)
            if (cos.dtype != torch.bfloat16 or sin is None or sin.shape != cos.shape or sin.stride() != cos.stride()
                    or cos.shape[0] != T or cos.stride(1) != 1 or R % 2 or R > D):
                raise ValueError(f"decode_attention: cos/sin must be [{T}, R <= {D}] bf16 with even R")
        tables, lens, slots, need = self._pages(batch, page_size)
        if need > k_cache.shape[0]:
            raise ValueError(f"decode_attention: pages or KV slots up to {need} for a cache of "
                             f"{k_cache.shape[0]} slots")
        return (T, Hq, Hk, D, 0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(),
                float(eps), bool(float32_scale), 0 if cos is None else cos.data_ptr(),
                0 if sin is None else sin.data_ptr(), cos_ld, R, slots.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), int(page_size), float(scale))

    def try_attention_layer(self, x: torch.Tensor, qkv_weight: torch.Tensor, o_weight: torch.Tensor, *,
                            q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, float32_scale: bool,
                            cos: torch.Tensor | None, sin: torch.Tensor | None, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, batch, page_size: int, scale: float) -> torch.Tensor | None:
        """A whole attention layer of a CPU decode step as one native call (``Executor::attention_layer``): the
        q/k/v GEMV over the fused matrix, :meth:`decode_attention` over its columns and the o GEMV, with the
        kernels and rounding points of those three calls (q/k/v and the attention output rounded to bf16) and no
        Python or torch operation between them.

        Args:
            x: ``[T, H]`` bf16 contiguous, the layer's normalized input, one token of each of ``batch.seqs``.
            qkv_weight: ``[(Hq + 2 Hk) D, H]`` bf16, q, k and v rows in that order (``FusedQKV``), no bias.
            o_weight: ``[H, Hq D]`` bf16 (``o_proj``, no bias).
            The rest as :meth:`decode_attention`.

        Returns:
            ``[T, H]`` bf16, or ``None`` where it does not take the step (no executor, dtypes, shapes, rows, a step
            :meth:`takes_decode_attention` refuses): then the separate calls.

        Raises:
            ValueError: caches, norms, tables or pages that do not fit (as :meth:`decode_attention`).
        """
        gemv = None if self._gemv is None else self._gemv()
        if gemv is None or x.dim() != 2 or k_cache.dim() != 3 or not 0 < x.shape[0] <= self.max_linear_rows:
            return None
        (T, H), D = x.shape, k_cache.shape[2]
        Hq = o_weight.shape[-1] // D
        N = qkv_weight.shape[0]
        if (not self.takes_decode_attention(x, k_cache, batch) or not self._is_bf16_cpu(qkv_weight, o_weight)
                or not x.is_contiguous() or not qkv_weight.is_contiguous() or not o_weight.is_contiguous()
                or qkv_weight.dim() != 2 or qkv_weight.shape[1] != H or tuple(o_weight.shape) != (H, Hq * D)
                or N != (Hq + 2 * k_cache.shape[1]) * D):
            return None
        tail = self._attention_args(T, Hq, q_norm, k_norm, eps, float32_scale, cos, sin, k_cache, v_cache, batch,
                                    page_size, scale)
        y = torch.empty(T, H, dtype=torch.bfloat16)
        st = self._ext.attention_layer_bf16(gemv._core, x.data_ptr(), H, qkv_weight.data_ptr(), o_weight.data_ptr(),
                                            *tail, y.data_ptr())
        if st:
            Hk = k_cache.shape[1]
            _raise_status(st, f"{gemv.name}.attention_layer (Hq {Hq}, Hk {Hk}, D {D}, page {page_size})")
        return y


class RegisteredStep:
    """A step over pre-registered host buffers, callable from C as ``edgemoe_run_step(address)``.

    The graph's producer writes the step into the buffers below (device→pinned-host copies or a
    kernel writing mapped memory); the step then runs with no Python involved, either through
    :meth:`serve` (a native thread polling a doorbell that a device kernel rings: the decode path's
    way, :mod:`edgemoe.kernels.doorbell`) or as a host node,
    ``cudaLaunchHostFunc(stream, fn_address, address)``.

    Buffers (CPU tensors, pinned when ``pin_memory``):
        x ``[max_tokens, H]`` (``x_dtype``), out ``[max_tokens, H]`` float32 (zeroed by each call
        when ``zero_out``), and the work as views of one int64 buffer ``pack`` (:func:`carve_cpu_work`):
        dims int64 ``[2]`` = (T, n_experts), fids int64 ``[max_experts]``, offsets int64
        ``[max_experts + 1]``, tok int64 ``[max_routes]``, wt float32 ``[max_routes]``.

    Attributes:
        address: the ``edgemoe_step*`` (int). fn_address: ``void edgemoe_run_step(void*)`` (int).
        releases: the doorbell server posts the release word (``serve(release_timeout_s=...)``).
    """

    def __init__(self, executor: NativeCpuExecutor, max_tokens: int, max_experts: int, max_routes: int | None,
                 x_dtype: torch.dtype, zero_out: bool, pin_memory: bool = False):
        self._server = self.address = 0  # doorbell server handle (serve), edgemoe_step* (below)
        self.releases = False  # serve(release_timeout_s=...): the server posts the release word
        if x_dtype not in X_FORMATS:
            raise ValueError(f"x_dtype must be float32 or bfloat16, got {x_dtype}")
        ext = load_extension()
        pool = executor.pool
        max_routes = int(max_routes if max_routes is not None else max_tokens * max_experts)
        self.executor = executor
        pm = dict(pin_memory=bool(pin_memory))
        self.x = torch.zeros(max_tokens, pool.hidden, dtype=x_dtype, **pm)
        self.out = torch.zeros(max_tokens, pool.hidden, dtype=torch.float32, **pm)
        self.pack = torch.zeros(cpu_work_words(max_experts, max_routes), dtype=torch.int64, **pm)
        self.dims, self.fids, self.offsets, self.tok, self.wt = carve_cpu_work(self.pack, max_experts, max_routes)
        self._ext = ext
        self.address = ext.step_create(executor._core, executor._banks, X_FORMATS[x_dtype], self.x.data_ptr(),
                                       self.out.data_ptr(), self.dims.data_ptr(), self.fids.data_ptr(),
                                       self.offsets.data_ptr(), self.tok.data_ptr(), self.wt.data_ptr(), max_tokens,
                                       max_experts, max_routes, bool(zero_out))
        self.fn_address = ext.run_step_address()
        self._fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self.fn_address)  # releases the GIL while running

    def _live(self) -> int:
        """The step's address; raises ``RuntimeError`` once :meth:`close` has freed it."""
        if not self.address:
            raise RuntimeError("this registered step is closed")
        return self.address

    def set_work(self, x: torch.Tensor, work: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Host-side producer: write ``x [T, H]`` and ``work`` (as for ``run``) into the buffers."""
        T, E = x.shape[0], len(work)
        R = sum(t.numel() for _, t, _ in work)
        if T > self.x.shape[0] or E > self.fids.numel() or R > self.tok.numel():
            raise ValueError(f"step (T={T}, experts={E}, routes={R}) exceeds the registered capacity")
        self.x[:T].copy_(x)
        self.dims.copy_(torch.tensor([T, E]))
        off = 0
        for e, (fid, tok, wt) in enumerate(work):
            n = tok.numel()
            self.fids[e] = int(fid)
            self.offsets[e] = off
            self.tok[off:off + n].copy_(tok)
            self.wt[off:off + n].copy_(wt)
            off += n
        self.offsets[E] = off

    def __call__(self) -> None:
        """Run the registered step through the C entry point (as a host node would).

        Raises:
            IndexError / ValueError / RuntimeError: the status the step left (see ``_STATUS``).
        """
        self._fn(self._live())
        st = self._ext.step_status(self.address)
        if st:
            _raise_status(st, "edgemoe_run_step")

    @property
    def calls(self) -> int:
        """Completed calls of the step."""
        return self._ext.step_calls(self._live())

    def bench(self, order: torch.Tensor, tokens: int, experts_per_call: int, seconds: float) -> tuple[int, float]:
        """Run this step over rotating experts for ``seconds``, no Python per call (B_H measurement).

        Call ``c`` computes experts ``order[c·e .. c·e + e)`` (``e = experts_per_call``, wrapping
        around), each for tokens ``0 .. tokens - 1`` of ``x``. Overwrites the step's work buffers.

        Args:
            order: ``[n]`` int64 CPU tensor of flat expert ids.

        Returns:
            ``(calls, seconds elapsed)``.

        Raises:
            ValueError: the sizes exceed the registered capacity; IndexError etc.: a failed step.
            RuntimeError: the step is closed, or its doorbell server is running (it shares the buffers).
        """
        if self._server:
            raise RuntimeError("bench() would race the doorbell server on the step's buffers")
        order = order.to(torch.int64).contiguous()
        calls, dt, status = self._ext.step_bench(self._live(), order.data_ptr(), order.numel(), int(tokens),
                                                 int(experts_per_call), float(seconds))
        if status:
            _raise_status(status, "step_bench")
        return calls, dt

    def bench_served(self, order: torch.Tensor, tokens: int, experts_per_call: int, seconds: float,
                     gap_us: int = 0, poll_us: int = 10) -> tuple[int, float]:
        """Ring this step's doorbell server over rotating experts for ``seconds``, a native thread
        standing in for the device (B_H as the device decode path drives the executor, without a GPU).

        Per call the thread writes the work (experts ``order[c·e .. c·e + e)``, tokens ``0 ..
        tokens - 1``), advances the request word, polls the done word every ``poll_us`` µs (0: spin;
        the device's wait kernel uses no CPU core, a sleeping poll almost none), then idles
        ``gap_us`` µs (the GPU's work between two MoE layers). Overwrites the step's work buffers.

        Returns:
            ``(calls, seconds elapsed)``.

        Raises:
            RuntimeError: the step is closed or not served (:meth:`serve` first). ValueError etc.:
                sizes beyond the registered capacity, or a failed step.
        """
        if not self._server:
            raise RuntimeError("bench_served() needs the doorbell server: call serve() first")
        order = order.to(torch.int64).contiguous()
        calls, dt, status = self._ext.server_bench(self._live(), self.doorbell.data_ptr(), self.doorbell[8:].data_ptr(),
                                                   order.data_ptr(), order.numel(), int(tokens), int(experts_per_call),
                                                   float(seconds), int(gap_us), int(poll_us))
        if status:
            _raise_status(status, "server_bench")
        return calls, dt

    def serve(self, pin_memory: bool = True, active_spin_us: int = 20_000,
              release_timeout_s: float | None = None) -> torch.Tensor:
        """Start a native thread that runs this step whenever its doorbell is rung (idempotent).

        Returns the doorbell: ``[24]`` int64 CPU tensor (pinned when ``pin_memory``): word 0 is the
        request counter a producer advances after writing the step's buffers, word 1 the count of
        requests given up, word 8 (its own cache line) the last request served, stored after ``out``
        is complete, word 9 that step's time in nanoseconds since the server's last poll that found no request
        (stored just before word 8; a device join's graded lateness reads it), and word 16 (its own cache line)
        the release word (below). The thread is the
        pool's worker 0 and pins itself to the executor's first planned core (:attr:`ThreadPlan.cpus`).
        It spins for ``active_spin_us`` after each step (consecutive MoE layers arrive within
        microseconds), yielding its core to any other runnable thread and stopping early when it
        finds itself preempted (:attr:`preempted`), then polls every 50 µs (every 1 ms after a second
        of silence). :meth:`close` stops it.

        With ``release_timeout_s`` (the device waits with a stream memory operation,
        :mod:`edgemoe.kernels.doorbell`): after the done word the server also stores 1 into the
        release word's low 32 bits (the device resets it to 0 after its wait), and a watchdog thread
        gives a request up when it stays unanswered for ``release_timeout_s`` seconds: it adds 1 to
        word 1 and stores the release word itself, and answers every later request so at once (the
        server stops serving). :meth:`close` gives up a request still pending the same way.

        Raises:
            ValueError: ``release_timeout_s`` not > 0, or a second call asking for the other protocol.
        """
        release = release_timeout_s is not None
        if release and not (release_timeout_s > 0 and math.isfinite(release_timeout_s)):
            raise ValueError(f"release_timeout_s must be a finite number of seconds > 0, got {release_timeout_s}")
        if self._server:
            if release != self.releases:
                raise ValueError("this step is already served with the other doorbell protocol (release word "
                                 f"{'on' if self.releases else 'off'})")
            return self.doorbell
        self._live()
        self.doorbell = torch.zeros(24, dtype=torch.int64, pin_memory=bool(pin_memory))
        self.releases = release
        bell = self.doorbell.data_ptr()
        self._server = self._ext.server_start(self.address, bell, bell + 8 * 8, int(active_spin_us),
                                              self.executor._core.caller_cpu, bell + 16 * 8 if release else 0,
                                              bell + 8 if release else 0,
                                              max(1, round(release_timeout_s * 1000)) if release else 0)
        _SERVING.add(self)
        return self.doorbell

    @property
    def served(self) -> int:
        """Requests the doorbell server has completed (0 when not serving)."""
        return self._ext.server_served(self._server) if self._server else 0

    @property
    def preempted(self) -> int:
        """Idle spins the doorbell server cut short because it had lost its core (0 when not serving)."""
        return self._ext.server_preempted(self._server) if self._server else 0

    @property
    def server_cpu(self) -> int:
        """CPU the doorbell server thread pinned itself to (-1: not pinned, or not serving)."""
        return self._ext.server_pinned(self._server) if self._server else -1

    @property
    def status(self) -> int:
        """Status code the last call left (0 = ok; see ``_STATUS``)."""
        return self._ext.step_status(self._live())

    @property
    def failed(self) -> int:
        """Served requests whose step failed (a bad id or size; ``status`` says which), 0 when not serving."""
        return self._ext.server_failed(self._server) if self._server else 0

    def close(self) -> None:
        """Stop the doorbell server (if any) and free the registered step."""
        if self._server:
            self._ext.server_stop(self._server)
            self._server = 0
        if self.address:
            self._ext.step_destroy(self.address)
            self.address = 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

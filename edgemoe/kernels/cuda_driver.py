"""Stream memory operations of the CUDA driver API, called through ``ctypes`` on ``libcuda``.

``cuStreamWaitValue32`` enqueues on a stream a wait until a 32-bit word in memory satisfies a
condition; ``cuStreamWriteValue32`` enqueues a store of a 32-bit value. Both run in the GPU's
front end (the stream's command processor), not on an SM: a pending wait holds no multiprocessor
and launches nothing. Recorded under stream capture, they become batch-memory-operation nodes of
the CUDA graph, with the address and value fixed at capture time. This module binds the "v2"
entry points (``cuStreamWaitValue32_v2`` / ``cuStreamWriteValue32_v2``, CUDA 11.7 and later),
which every platform enables by default (the legacy ones needed a kernel-module parameter); 32-bit
operations need no device attribute (64-bit ones would need
``CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS``, the ``NOR`` condition
``CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR``; neither is used here).

Addresses are device pointers: a pinned host tensor's is :func:`host_device_pointer`
(``cuMemHostGetDevicePointer``; with unified addressing torch's pinned allocations, made by
``cudaHostAlloc`` or ``cudaHostRegister`` with default flags, are mapped, and the result equals the
host address). Managed memory is refused by the driver.

Reference: CUDA Driver API, "Stream Memory Operations" (``CUstreamWaitValue_flags``:
``CU_STREAM_WAIT_VALUE_GEQ`` waits until ``(int32_t)(*addr - value) >= 0``; a write is preceded by
a memory fence scoped to the stream). Only torch and ctypes are imported; no cuda-python.
"""

from __future__ import annotations

import ctypes
import functools

import torch

WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0, cyclic
WAIT_EQ = 1  # CU_STREAM_WAIT_VALUE_EQ
WRITE_DEFAULT = 0  # CU_STREAM_WRITE_VALUE_DEFAULT: fenced after the stream's earlier writes
MIN_DRIVER = 11070  # cuDriverGetVersion of CUDA 11.7: the v2 stream memory operations
LIBRARY = "libcuda.so.1"


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the ``CUresult``."""


class _Driver:
    """The few ``libcuda`` entry points used here, with their C signatures."""

    def __init__(self, lib: ctypes.CDLL):
        u32, uint, ptr, res = ctypes.c_uint32, ctypes.c_uint, ctypes.c_void_p, ctypes.c_int
        self.lib = lib
        self.wait32 = self._fn("cuStreamWaitValue32_v2", [ptr, ctypes.c_uint64, u32, uint])
        self.write32 = self._fn("cuStreamWriteValue32_v2", [ptr, ctypes.c_uint64, u32, uint])
        self.host_ptr = self._fn("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(ctypes.c_uint64), ptr, uint])
        self.version = self._fn("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        self.error_name = self._fn("cuGetErrorName", [res, ctypes.POINTER(ctypes.c_char_p)])

    def _fn(self, name: str, argtypes: list):
        f = getattr(self.lib, name)  # AttributeError: a driver without the symbol
        f.argtypes, f.restype = argtypes, ctypes.c_int
        return f

    def check(self, status: int, call: str) -> None:
        if status == 0:
            return
        name = ctypes.c_char_p()
        self.error_name(status, ctypes.byref(name))
        label = name.value.decode() if name.value else "unknown error"
        raise DriverError(f"{call} failed: {label} ({status})")


@functools.cache
def _load(library: str = LIBRARY) -> _Driver | str:
    """The bound driver, or why there is none (one line)."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return f"the CUDA driver library {library} does not load ({exc})"
    try:
        drv = _Driver(lib)
    except AttributeError as exc:
        return f"the CUDA driver lacks the v2 stream memory operations (CUDA 11.7 or later): {exc}"
    v = ctypes.c_int()
    if drv.version(ctypes.byref(v)) != 0 or v.value < MIN_DRIVER:
        return f"the CUDA driver is version {v.value}, stream memory operations need {MIN_DRIVER} (CUDA 11.7)"
    return drv


def unavailable_reason(device: torch.device | str, library: str = LIBRARY) -> str | None:
    """``None`` when stream memory operations can be enqueued on ``device``'s streams, else why not.

    Args:
        device: the compute device.
        library: the driver library to load (a test names a missing one).
    """
    if torch.device(device).type != "cuda":
        return "stream memory operations need a CUDA device"
    if torch.version.hip:
        return "stream memory operations are bound for the CUDA driver, not HIP"
    got = _load(library)
    return got if isinstance(got, str) else None


def driver_version() -> int | None:
    """``cuDriverGetVersion`` (e.g. 13000 for CUDA 13.0), or ``None`` without a usable driver."""
    got = _load(LIBRARY)
    if isinstance(got, str):
        return None
    v = ctypes.c_int()
    got.check(got.version(ctypes.byref(v)), "cuDriverGetVersion")
    return v.value


def _driver() -> _Driver:
    got = _load(LIBRARY)
    if isinstance(got, str):
        raise DriverError(got)
    return got


def host_device_pointer(t: torch.Tensor, device: torch.device | str) -> int:
    """The address at which ``device`` reads pinned host tensor ``t``'s first element
    (``cuMemHostGetDevicePointer``). Synchronizes ``device`` (a set-up call, never under capture):
    that makes its primary context current on this thread, as the driver call needs.

    Raises:
        ValueError: ``t`` is not a pinned CPU tensor.
        DriverError: no driver, or the driver refused the pointer (memory not mapped for the device).
    """
    if t.device.type != "cpu" or not t.is_pinned():
        raise ValueError("stream memory operations on host memory need a pinned CPU tensor")
    drv = _driver()
    torch.cuda.synchronize(device)
    out = ctypes.c_uint64()
    drv.check(drv.host_ptr(ctypes.byref(out), ctypes.c_void_p(t.data_ptr()), 0), "cuMemHostGetDevicePointer")
    return int(out.value)


def wait_value32(stream: int, address: int, value: int, flags: int = WAIT_GEQ) -> None:
    """Enqueue on ``stream`` (a ``CUstream`` handle, ``torch.cuda.Stream.cuda_stream``) a wait until
    the 32-bit word at device ``address`` satisfies ``flags`` against ``value`` (default: cyclic
    ``>=``). Work enqueued after it starts once the condition holds; it never times out.

    Raises:
        DriverError: no driver, or the call failed (e.g. not capturable in this capture mode).
    """
    drv = _driver()
    drv.check(drv.wait32(ctypes.c_void_p(stream), address, value & 0xFFFFFFFF, flags), "cuStreamWaitValue32")


def write_value32(stream: int, address: int, value: int) -> None:
    """Enqueue on ``stream`` a store of the 32-bit ``value`` to device ``address`` (after a memory
    fence over the stream's earlier work).

    Raises:
        DriverError: no driver, or the call failed.
    """
    drv = _driver()
    drv.check(drv.write32(ctypes.c_void_p(stream), address, value & 0xFFFFFFFF, WRITE_DEFAULT),
              "cuStreamWriteValue32")

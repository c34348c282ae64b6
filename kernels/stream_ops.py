"""Stream-ordered waits, writes, copies and fills through the CUDA driver API.

A copy stream can wait until a running kernel has raised a counter in device memory, copy what the
counter announces with a copy engine, then raise a flag in a peer's memory, all without the host and
without an SM: CUDA's stream memory operations (`cuStreamWaitValue32`, `cuStreamWriteValue32`) beside
`cuMemcpyAsync`. They are captured into CUDA graphs like any stream work. torch offers no wait-value op,
so these call libcuda through ctypes. Addresses are device addresses (UVA: a peer's buffer mapped into
this process is one too); streams are `torch.cuda.Stream.cuda_stream` handles.

Two hazards of a stream that waits on device memory:
* With lazy module loading (CUDA's default), the first launch of a kernel loads its module, which may
  wait for the device to drain. A waiting stream then blocks the host until its flag is raised: launch
  every kernel a wait depends on before enqueueing the wait.
* With CUDA_DEVICE_MAX_CONNECTIONS=1 all streams share one hardware queue, so a wait also holds back
  the other streams' work queued behind it.
"""

from __future__ import annotations

import ctypes
import functools

WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise RuntimeError(f"stream operations need the CUDA driver library libcuda.so.1 ({err})") from err
    value_op = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    signatures = {
        "cuStreamWaitValue32_v2": value_op,
        "cuStreamWriteValue32_v2": value_op,
        "cuMemcpyAsync": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemsetD32Async": [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")


def wait_geq(stream: int, address: int, value: int) -> None:
    """Work queued on `stream` after this waits until the int32 at `address` reached `value`."""
    _check(_driver().cuStreamWaitValue32_v2(stream, address, value, WAIT_VALUE_GEQ), "cuStreamWaitValue32")


def write(stream: int, address: int, value: int) -> None:
    """Write the int32 `value` at `address` once the work queued before it on `stream` has completed
    (with a memory barrier: that work's writes are visible first)."""
    _check(_driver().cuStreamWriteValue32_v2(stream, address, value, 0), "cuStreamWriteValue32")


def copy(stream: int, dst: int, src: int, nbytes: int) -> None:
    """Copy `nbytes` from `src` to `dst` on `stream` (a copy engine)."""
    _check(_driver().cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


def fill(stream: int, address: int, value: int, count: int) -> None:
    """Set `count` int32 words from `address` to `value` on `stream` (no kernel module to load)."""
    _check(_driver().cuMemsetD32Async(address, value, count, stream), "cuMemsetD32Async")

"""Launch a Triton kernel without Triton's per-call argument binding and specialization.

    launch(kernel, grid, *args, stream=None, **constexprs_and_options)  ==  kernel[grid](*args, ...)

`kernel[grid](...)` binds and specializes every argument on every call before it looks up the
compiled kernel, and weft's comm GEMMs take 20-30 arguments; an eager tensor-parallel training step
makes about a hundred such launches. Here the compiled kernel is kept under a key computed from exactly
what Triton 3.6 specializes on, and a later call with the same key goes straight to the compiled
kernel's launcher (which still encodes each TMA descriptor). On a 2x H100 host (Llama-3-8B width, 4
layers, tp = 2, weft's kernels), the host queued an eager step in 55.0 / 59.1 / 53.8 ms through
Triton's dispatch and in 54.3 / 54.2 / 51.4 ms through this, alternating in one process. The key:
* an int: whether it is 1 (compiled in as a constant), a multiple of 16, and its integer type (i32,
  i64 or u64 by value);
* a tensor: its dtype and whether its address is a multiple of 16;
* a host TensorDescriptor: its dtype and block shape (the launcher encodes the TMA descriptor itself);
* a bool, a float, None: the type; a tuple: each item;
* a constexpr parameter and a launch option (num_warps, num_stages, launch_pdl, ...): its value;
plus the current device. A key met for the first time launches through `kernel[grid]`, which compiles
or finds the kernel as usual. Under the interpreter (TRITON_INTERPRET=1) every call goes through
`kernel[grid]`.

A call site whose launches differ only in their tensors and descriptors (a comm kernel's per-shape
call plan) keeps a `Relaunch` and calls it as it would call `launch`: after the first launch it skips
the key as well, which leaves binding the arguments and Triton's launcher.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton import knobs
from triton.tools.tensor_descriptor import TensorDescriptor

Grid = tuple[int] | tuple[int, int] | tuple[int, int, int]
Launcher = Callable[..., Any]  # `launch` or a `Relaunch`

_I32 = (-(2**31), 2**31)
_I64_MAX = 2**63


def _spec(arg: Any) -> Any:
    """What Triton 3.6 specializes a runtime argument on (see the module docstring)."""
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if isinstance(arg, int):
        return (arg == 1, arg % 16 == 0, _I32[0] <= arg < _I32[1], arg < _I64_MAX)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, TensorDescriptor):
        return (arg.base.dtype, tuple(arg.block_shape))
    if isinstance(arg, tuple):
        return tuple(_spec(item) for item in arg)
    raise TypeError(f"launch: no specialization rule for an argument of type {type(arg).__name__}")


class _Signature:
    """A kernel's parameters in order: names, which are constexpr, defaults."""

    def __init__(self, kernel: triton.JITFunction) -> None:
        self.names = [p.name for p in kernel.params]
        self.constexpr = [p.is_constexpr for p in kernel.params]
        parameters = kernel.signature.parameters
        self.defaults = {name: parameters[name].default for name in self.names}

    def bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], tuple]:
        """Every parameter's value in order (what the compiled launcher takes), and the launch options
        (the keyword arguments that name no parameter) as a sorted tuple."""
        if len(args) > len(self.names):
            raise TypeError(f"launch: {len(args)} positional arguments for {len(self.names)} parameters")
        values = list(args)
        for name in self.names[len(args) :]:
            if name in kwargs:
                values.append(kwargs[name])
            elif self.defaults[name] is not inspect.Parameter.empty:
                values.append(self.defaults[name])
            else:
                raise TypeError(f"launch: missing argument {name!r}")
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in self.defaults))
        return values, options


_SIGNATURES: dict[triton.JITFunction, _Signature] = {}
_COMPILED: dict[tuple, Any] = {}


def launch(
    kernel: Any, grid: Grid, *args: Any, stream: torch.cuda.Stream | None = None, **kwargs: Any
) -> Any:
    """`kernel[grid](*args, **kwargs)` on `stream` (default: the current stream), with the host work
    described in the module docstring. Returns the compiled kernel (None under the interpreter)."""
    if not isinstance(kernel, triton.JITFunction):  # the interpreter's InterpretedFunction
        with torch.cuda.stream(stream):
            return kernel[grid](*args, **kwargs)
    signature = _SIGNATURES.get(kernel)
    if signature is None:
        signature = _SIGNATURES[kernel] = _Signature(kernel)
    values, options = signature.bind(args, kwargs)
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    key = (
        kernel,
        device,
        options,
        tuple(v if const else _spec(v) for v, const in zip(values, signature.constexpr, strict=True)),
    )
    compiled = _COMPILED.get(key)
    if compiled is None:  # compiles, or finds the kernel in Triton's caches
        with torch.cuda.stream(stream):
            compiled = _COMPILED[key] = kernel[grid](*args, **kwargs)
        return compiled
    _run(compiled, grid, values, stream, driver, device)
    return compiled


def _run(
    compiled: Any, grid: Grid, values: list[Any], stream: torch.cuda.Stream | None, driver: Any, device: int
) -> None:
    """The compiled kernel's own launcher, on `stream` (default: the current stream)."""
    grid3 = (*grid, 1, 1)[:3]
    handle = stream.cuda_stream if stream is not None else driver.get_current_stream(device)
    hooks = knobs.runtime
    compiled.run(
        *grid3, handle, compiled.function, compiled.packed_metadata,
        compiled.launch_metadata(grid3, handle, *values), hooks.launch_enter_hook, hooks.launch_exit_hook,
        *values,
    )  # fmt: skip


class Relaunch:
    """The launches of one call site of one kernel on one device, whose tensors and descriptors keep
    their dtypes and block shapes (the caller's word): the first goes through `launch`; a later one
    whose other arguments and options equal the first's, and whose tensors are 16-byte aligned, runs
    the first's compiled kernel directly (no key), with its own tensors and descriptors; any other goes
    through `launch`. Called as `launch` is."""

    def __init__(self) -> None:
        self.compiled: Any = None
        self.fixed: tuple = ()

    def __call__(
        self, kernel: Any, grid: Grid, *args: Any, stream: torch.cuda.Stream | None = None, **kwargs: Any
    ) -> Any:
        if self.compiled is None:
            self.compiled = launch(kernel, grid, *args, stream=stream, **kwargs)
            if self.compiled is not None:  # compiled (not the interpreter)
                values, options = _SIGNATURES[kernel].bind(args, kwargs)
                self.fixed = self._fixed(kernel, values, options)
            return self.compiled
        values, options = _SIGNATURES[kernel].bind(args, kwargs)
        if self._fixed(kernel, values, options) != self.fixed or any(
            isinstance(v, torch.Tensor) and v.data_ptr() % 16 for v in values
        ):
            return launch(kernel, grid, *args, stream=stream, **kwargs)
        driver = triton.runtime.driver.active
        _run(self.compiled, grid, values, stream, driver, driver.get_current_device())
        return self.compiled

    @staticmethod
    def _fixed(kernel: Any, values: list[Any], options: tuple) -> tuple:
        """What must not change between launches: the kernel, device, options and every argument but
        the tensors and descriptors."""
        device = triton.runtime.driver.active.get_current_device()
        kept = tuple(v for v in values if not isinstance(v, (torch.Tensor, TensorDescriptor)))
        return (kernel, device, options, kept)

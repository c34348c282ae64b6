"""kernels/launch.py: its key is at least as fine as Triton's own specialization (two arguments it
cannot tell apart, Triton cannot either), its binding orders arguments as the compiled launcher takes
them, and a launch computes what `kernel[grid]` computes: on CPU through the interpreter, on a GPU
through the compiled kernel's launcher, across calls that reuse the key and calls that change it; a
`Relaunch` computes the same, its later launches skipping the key only where nothing but the tensors
changed."""

import itertools

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.launch import Relaunch, _Signature, _spec, launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _samples() -> list[object]:
    base = torch.empty(64, 64, dtype=torch.bfloat16)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16]
    ints += [2**31 - 16, 2**31, 2**31 + 1, 2**40, 2**63 - 16, 2**63, 2**64 - 1]  # i32 / i64 / u64 edges
    tensors = [base, base[:, 1:], base[:, 8:], base.float(), base.view(torch.int16)[:, 3:]]
    descs = [
        TensorDescriptor(base, [64, 64], [64, 1], [16, 32]),
        TensorDescriptor(base[:, 8:], [64, 56], [64, 1], [16, 32]),
        TensorDescriptor(base, [64, 64], [64, 1], [32, 32]),
        TensorDescriptor(base.view(torch.float16), [64, 64], [64, 1], [16, 32]),
    ]
    tuples = [(base, 16), (base, 1), (base[:, 1:], 16), ((1, 2), (3, 4)), ((1, 16), (3, 4))]
    return [*ints, *tensors, *descs, *tuples, True, False, 1.5, 2.0, None]


def test_key_separates_whatever_triton_specializes_differently() -> None:
    samples = _samples()
    native = [native_specialize_impl(BaseBackend, arg, False, True, True) for arg in samples]
    for (a, na), (b, nb) in itertools.combinations(zip(samples, native, strict=True), 2):
        if _spec(a) == _spec(b):
            assert na == nb, f"launch's key merges {a!r} and {b!r}, which Triton specializes as {na} / {nb}"


def test_key_refuses_what_it_has_no_rule_for() -> None:
    with pytest.raises(TypeError, match="no specialization rule"):
        _spec("a string")


def _add(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, TWICE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    out = tl.load(x_ptr + offs, mask=mask) + scale * tl.load(y_ptr + offs, mask=mask)
    if TWICE:
        out = 2 * out
    tl.store(out_ptr + offs, out, mask=mask)


def test_binding_orders_every_parameter_and_splits_off_the_options() -> None:
    signature = _Signature(JITFunction(_add))
    values, options = signature.bind(("x", "y", "o"), {"n": 5, "scale": 2.0, "BLOCK": 64, "num_warps": 4})
    assert values == ["x", "y", "o", 5, 2.0, 64, False]  # TWICE's default filled in
    assert options == (("num_warps", 4),)
    assert signature.constexpr == [False] * 5 + [True, True]
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        signature.bind(("x", "y", "o", 5, 2.0), {})


add_kernel = triton.jit(_add)


def _run(n: int, twice: bool, offset: int = 0, launcher=launch) -> None:
    x, y = (torch.randn(n + offset, device=DEVICE)[offset:] for _ in range(2))
    out = torch.full_like(x, float("nan"))
    launcher(add_kernel, (triton.cdiv(n, 128),), x, y, out, n, 0.5, BLOCK=128, TWICE=twice, num_warps=4)
    expected = (x + 0.5 * y) * (2 if twice else 1)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("twice", [False, True])
def test_launch_computes_what_the_kernel_computes(twice: bool) -> None:
    for n in (1000, 1024, 1, 33):  # n = 1 and multiples of 16 change Triton's specialization
        _run(n, twice)


@pytest.mark.gpu
def test_compiled_launches_reuse_and_change_keys_on_the_gpu() -> None:
    # The first call of each key goes through kernel[grid]; later ones through the compiled launcher,
    # with fresh tensors (other addresses) and on a side stream.
    cases = [(4096, False, 0), (4096, True, 0), (1, False, 0), (777, False, 1), (4096, False, 3)]
    for _ in range(3):
        for n, twice, offset in cases:
            _run(n, twice, offset)
    side = torch.cuda.Stream()
    x, y = torch.randn(2, 5000, device="cuda")
    out = torch.full_like(x, float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    for _ in range(2):
        launch(add_kernel, (40,), x, y, out, 5000, 1.0, BLOCK=128, num_warps=4, stream=side)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(out, x + y)


def test_relaunch_computes_what_the_kernel_computes_as_its_arguments_change() -> None:
    # One Relaunch sees fresh tensors (the fast path on a GPU), then an n, a constexpr and an alignment
    # the first launch was not compiled for (each must go through `launch`), then the first again.
    relaunch = Relaunch()
    first = (1024, False, 0)
    for n, twice, offset in (first, first, first, (1000, False, 0), (1024, True, 0), (1024, False, 1), first):
        _run(n, twice, offset, relaunch)
    if DEVICE == "cuda":
        assert relaunch.compiled is not None

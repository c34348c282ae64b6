"""FP8 decode kernels against their references: fused add + RMSNorm + quantize, SwiGLU + quantize,
per-token quantize and the skinny GEMM (FP8 and bf16). Fresh random inputs, ragged sizes, poisoned outputs; on
CPU through Triton's interpreter, on a GPU natively."""

import weakref

import pytest
import torch

from kernels import fp8_gemm as gemm_module
from kernels.fp8 import FP8, dequantize, quantize_per_token, quantize_reference, quantize_weight_per_channel
from kernels.fp8_gemm import (
    GemmConfig,
    bf16_gemm,
    bf16_gemm_reference,
    fp8_gemm,
    fp8_gemm_reference,
    skinny_bf16_gemm,
    skinny_fp8_gemm,
)
from kernels.fp8_norm import (
    add_rmsnorm,
    add_rmsnorm_fp8,
    add_rmsnorm_fp8_reference,
    add_rmsnorm_reference,
    rmsnorm,
    rmsnorm_fp8,
)
from kernels.fp8_swiglu import swiglu, swiglu_fp8, swiglu_fp8_reference, swiglu_reference
from tests.sm90 import MAX_SHARED_BYTES, compile_sm90, ptxas_log, run_without_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 3, 17]
HIDDEN = [64, 1000, 4096]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), "output holds NaN/inf: an element was not written"
    return ((out - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def assert_rounded_alike(out: torch.Tensor, ref: torch.Tensor) -> None:
    """`out` (bf16) is the fp32 `ref` rounded to bf16, up to the rare one-ulp flip where the kernel's fp32
    differs from the reference's in its last bits: relative error below 1e-3, where a systematic error
    of one bf16 ulp, or truncation instead of rounding, makes 2e-3 to 8e-3."""
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.to(torch.bfloat16)) < 1e-3


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs the kernels allocate (torch.empty, empty_like, new_empty) start as NaN, so an element
    they never write fails the test."""

    def poisoning(allocate):
        def poisoned_allocate(*args, **kwargs):
            tensor = allocate(*args, **kwargs)
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            return tensor

        return poisoned_allocate

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoning(torch.Tensor.new_empty))


def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("ragged", [0, 3])
def test_add_rmsnorm_persistent_rounds(poisoned: None, ragged: int) -> None:
    """The persistent norm: one program per SM walks 5 whole rounds of rows, then `ragged` rows get
    one-row programs of their own; every row must be written once, with the right values."""
    from kernels import fp8

    rows = (fp8.NORM_PERSISTENT_ROWS_PER_SM + 1) * fp8.programs_cap(torch.device(DEVICE)) + ragged
    x, weight, residual = bf16(rows, 1000), bf16(1000, scale=0.5) + 1, bf16(rows, 1000, scale=3.0)
    q, scales, got_residual = add_rmsnorm_fp8(x, residual, weight, 1e-5, None)
    ref_q, ref_scales, new_residual = add_rmsnorm_fp8_reference(x, residual, weight, 1e-5, None)
    assert torch.equal(got_residual, new_residual)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)
    assert rel_err(dequantize(q, scales), dequantize(ref_q, ref_scales)) < 2e-2


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("mode", ["dynamic", "static", "bf16"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm(poisoned: None, rows: int, hidden: int, mode: str, with_residual: bool) -> None:
    x, weight = bf16(rows, hidden), bf16(hidden, scale=0.5) + 1
    residual = bf16(rows, hidden, scale=3.0) if with_residual else None
    if rows > 1:  # an all-zero row: its norm is 0 * rsqrt(eps), and NaN without eps
        x[1] = 0
        if residual is not None:
            residual[1] = 0
    original = residual.clone() if residual is not None else None
    if mode == "bf16":
        if with_residual:
            out, got_residual = add_rmsnorm(x, residual, weight, 1e-5)
        else:
            out = rmsnorm(x, weight, 1e-5)
        ref, new_residual = add_rmsnorm_reference(x, original, weight, 1e-5)
        assert_rounded_alike(out, ref)
    else:
        static = torch.tensor([0.02], device=DEVICE) if mode == "static" else None
        if with_residual:
            q, scales, got_residual = add_rmsnorm_fp8(x, residual, weight, 1e-5, static)
        else:
            q, scales = rmsnorm_fp8(x, weight, 1e-5, static)
        ref_q, ref_scales, new_residual = add_rmsnorm_fp8_reference(x, original, weight, 1e-5, static)
        assert q.dtype == FP8 and q.shape == x.shape
        torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)
        assert rel_err(dequantize(q, scales), dequantize(ref_q, ref_scales)) < 2e-2
    if with_residual:
        assert torch.equal(got_residual, new_residual)
        assert torch.equal(residual, original)  # the input residual is left as it was


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [64, 1000, 3584])
@pytest.mark.parametrize("mode", ["dynamic", "static", "bf16"])
def test_swiglu(poisoned: None, rows: int, hidden: int, mode: str) -> None:
    x = bf16(rows, 2 * hidden, scale=2.0)
    if mode == "bf16":
        assert_rounded_alike(swiglu(x), swiglu_reference(x))
        return
    static = torch.tensor([0.05], device=DEVICE) if mode == "static" else None
    q, scales = swiglu_fp8(x, static)
    ref_q, ref_scales = swiglu_fp8_reference(x, static)
    assert q.shape == (rows, hidden)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)
    assert rel_err(dequantize(q, scales), dequantize(ref_q, ref_scales)) < 2e-2


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("k", [64, 777, 4096])
def test_quantize_per_token(poisoned: None, rows: int, k: int) -> None:
    x = bf16(rows, k, scale=4.0)
    q, scales = quantize_per_token(x)
    ref_scales = quantize_reference(x)[1]
    torch.testing.assert_close(scales, ref_scales, rtol=1e-5, atol=0)
    assert rel_err(dequantize(q, scales), x) < 4e-2  # e4m3 keeps 3 mantissa bits


GEMM_SHAPES = [(96, 256), (200, 320), (72, 1000)]


@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
@pytest.mark.parametrize(("n", "k"), GEMM_SHAPES)
@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_gemm(poisoned: None, m: int, n: int, k: int, split_k: int | None, swap_ab: bool) -> None:
    if split_k is None and swap_ab:
        pytest.skip("the tuned/heuristic config has one setting of swap_ab")
    a, a_scale = quantize_per_token(bf16(m, k))
    b, b_scale = quantize_weight_per_channel(bf16(n, k, scale=0.05))
    block_n = 64 if swap_ab else 32
    config = GemmConfig(block_n, 128, split_k, swap_ab=swap_ab) if split_k else None
    out = skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, fp8_gemm_reference(a, a_scale, b, b_scale)) < 1e-2


@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 96, 1000, 1), (5, 200, 320, 3), (16, 72, 1000, 2)])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_gemm_without_early_tile(
    poisoned: None, m: int, n: int, k: int, split_k: int, swap_ab: bool
) -> None:
    """The loop starts with the first K tile when none is loaded before the PDL wait."""
    a, a_scale = quantize_per_token(bf16(m, k))
    b, b_scale = quantize_weight_per_channel(bf16(n, k, scale=0.05))
    config = GemmConfig(64 if swap_ab else 32, 128, split_k, num_stages=5, swap_ab=swap_ab, early_tile=False)
    out = skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    assert rel_err(out, fp8_gemm_reference(a, a_scale, b, b_scale)) < 1e-2


@pytest.mark.parametrize(("m", "n", "k"), [(1, 192, 16384), (16, 136, 12288)])
@pytest.mark.parametrize(
    "config", [None, GemmConfig(64, 256, 3, num_stages=5, swap_ab=True, early_tile=False)]
)
def test_skinny_gemm_long_positive_sums(
    poisoned: None, m: int, n: int, k: int, config: GemmConfig | None
) -> None:
    """All-positive operands over a long K: every product adds to the sum, so an accumulator that
    drops low bits drifts far past bf16's rounding (on H200, Hopper's fp8 wgmma left to accumulate
    over all of K came out 4-19% low; torch._scaled_mm 0.2% off)."""
    a, a_scale = quantize_per_token((torch.rand(m, k, device=DEVICE) + 0.5).to(torch.bfloat16))
    b, b_scale = quantize_weight_per_channel((torch.rand(n, k, device=DEVICE) + 0.5).to(torch.bfloat16))
    out = skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    assert rel_err(out, fp8_gemm_reference(a, a_scale, b, b_scale)) < 4e-3


def quantize_groups(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] in e4m3 with one scale per token and group of K / groups elements: [M, groups]."""
    q, scales = quantize_reference(x.view(x.shape[0], groups, -1))
    return q.view(x.shape), scales


@pytest.mark.parametrize("m", [1, 5, 16, 33])
@pytest.mark.parametrize(
    ("n", "k", "groups", "config"),
    [
        (96, 512, 4, None),  # groups of 128: the K tile shrinks to fit where the config's is larger
        (200, 1024, 2, GemmConfig(64, 256, 3, swap_ab=True)),  # a split inside a group
        (72, 768, 6, GemmConfig(32, 128, 2, swap_ab=False)),
        (136, 1024, 16, GemmConfig(64, 256, 1, num_stages=5, swap_ab=True, early_tile=False)),  # tile 64
        # Llama-3-8B's wo: a kv head's 512 per group (2 stages: at M = 33 the 64-row tiles of 3 or more
        # stages and the early tile pass Hopper's 227 KiB of shared memory)
        (64, 4096, 8, GemmConfig(64, 512, 2, num_stages=2, swap_ab=True)),
    ],
)
def test_skinny_gemm_group_scales(
    poisoned: None, m: int, n: int, k: int, groups: int, config: GemmConfig | None
) -> None:
    """A scaled per token and group of K (the decode attention's output, a scale per kv head): each
    K tile's dot is scaled by its group's scales, whatever the split and tile sizes; rows of very
    different magnitude per group, so that a scale applied to the wrong group shows."""
    x = bf16(m, k) * torch.logspace(-2, 2, groups, device=DEVICE).repeat_interleave(k // groups)
    a, a_scale = quantize_groups(x.to(torch.bfloat16), groups)
    b, b_scale = quantize_weight_per_channel(bf16(n, k, scale=0.05))
    out = skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = fp8_gemm_reference(a, a_scale, b, b_scale)
    assert rel_err(out, ref) < 1e-2
    assert rel_err(ref, (x.float() @ dequantize(b, b_scale).t()).to(torch.bfloat16)) < 5e-2


def test_group_scales_below_the_smallest_group_and_past_m_64(poisoned: None) -> None:
    """Groups of 16 (under MIN_A_GROUP) and M > 64 (the stock path) re-quantize A per token first."""
    for m, k, groups in [(3, 64, 4), (70, 512, 4)]:
        a, a_scale = quantize_groups(bf16(m, k), groups)
        b, b_scale = quantize_weight_per_channel(bf16(48, k, scale=0.05))
        assert rel_err(fp8_gemm(a, a_scale, b, b_scale), fp8_gemm_reference(a, a_scale, b, b_scale)) < 4e-2


def test_group_scales_must_split_k() -> None:
    a, _ = quantize_per_token(bf16(2, 96))
    b, b_scale = quantize_weight_per_channel(bf16(64, 96))
    with pytest.raises(ValueError, match="G dividing K"):
        fp8_gemm(a, torch.ones(2, 5, device=DEVICE), b, b_scale)


BF16_GEMM_SHAPES = [(96, 256), (200, 320), (72, 1000), (130, 77)]


@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize(("n", "k"), BF16_GEMM_SHAPES)
@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_skinny_bf16_gemm(poisoned: None, m: int, n: int, k: int, split_k: int | None, swap_ab: bool) -> None:
    """The same kernel without scales on bf16 operands: ragged N and K (K = 77 is shorter than one
    tile), split-K on and off, both tile orientations."""
    if split_k is None and swap_ab:
        pytest.skip("the tuned/heuristic config has one setting of swap_ab")
    a, b = bf16(m, k), bf16(n, k, scale=0.05)
    config = GemmConfig(64 if swap_ab else 32, 64, split_k, swap_ab=swap_ab) if split_k else None
    out = skinny_bf16_gemm(a, b, config)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert rel_err(out, bf16_gemm_reference(a, b)) < 1e-2


@pytest.mark.parametrize(("m", "n", "k", "split_k"), [(1, 96, 1000, 2), (16, 72, 1000, 3)])
def test_skinny_bf16_gemm_without_early_tile(poisoned: None, m: int, n: int, k: int, split_k: int) -> None:
    a, b = bf16(m, k), bf16(n, k, scale=0.05)
    config = GemmConfig(64, 64, split_k, num_stages=5, swap_ab=True, early_tile=False)
    assert rel_err(skinny_bf16_gemm(a, b, config), bf16_gemm_reference(a, b)) < 1e-2


def test_bf16_gemm_op_hands_large_m_to_linear(poisoned: None) -> None:
    """bf16_gemm: the skinny kernel up to M = 64 (its heuristic config: half the e4m3 block_k), then
    F.linear; the split-K workspace is left EMPTY."""
    a, b = bf16(70, 300), bf16(136, 300, scale=0.05)
    ref = bf16_gemm_reference(a, b)
    assert rel_err(bf16_gemm(a[:64], b), ref[:64]) < 1e-2
    assert rel_err(bf16_gemm(a, b), ref) < 1e-2
    assert gemm_module.config_for(1, 136, 300, a.device, torch.bfloat16).block_k == 128
    workspace = gemm_module.split_workspace(a.device, 0)
    assert (workspace.view(torch.int32) == gemm_module.EMPTY.value).all()


def test_bf16_and_fp8_configs_do_not_collide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuned configs are keyed by operand dtype: a bf16 entry never serves e4m3 operands or back."""
    fp8_cfg, bf16_cfg = GemmConfig(64, 256, 2, swap_ab=True), GemmConfig(64, 128, 3, swap_ab=True)
    key8, key16 = gemm_module.config_key(1, 4096, 512), gemm_module.config_key(1, 4096, 512, torch.bfloat16)
    assert key8 != key16
    monkeypatch.setattr(gemm_module, "TUNED", {gemm_module.REFERENCE_GPU: {key8: fp8_cfg, key16: bf16_cfg}})
    device = torch.device(DEVICE)
    assert gemm_module.config_for(1, 4096, 512, device) == fp8_cfg
    assert gemm_module.config_for(1, 4096, 512, device, torch.bfloat16) == bf16_cfg
    monkeypatch.setattr(gemm_module, "TUNED", {gemm_module.REFERENCE_GPU: {key16: bf16_cfg}})
    assert gemm_module.config_for(1, 4096, 512, device) == gemm_module.heuristic_config(1, 4096, 512)


@pytest.mark.parametrize(("n", "k", "split"), [(2304, 16384, 3), (4096, 4096, 2), (1280, 8192, 6)])
def test_bf16_heuristic_keeps_the_tile_bytes(n: int, k: int, split: int) -> None:
    """bf16 tiles hold the bytes of the e4m3 ones (half the K), and slices at least 2 KiB of a row (so
    1280 x 8192 splits 6 ways where e4m3 stops at 4)."""
    cfg = gemm_module.heuristic_config(1, n, k, element_bytes=2)
    assert cfg.block_k == 128 and cfg.split_k == split and k // cfg.split_k * 2 >= 2048


def check_sm90_ptx() -> None:
    """Every tuned GEMM config of the reference GPU, and the heuristic's, compiles for sm_90 with its
    wgmma instructions pipelined (ptxas serializes them if anything reads their accumulators while
    they run, as an early tile promoted inside the MMA chain did: up to 35% slower on H200); swapped
    tiles run on wgmma, and M <= 16 configs without the early tile fit two programs per SM, which is
    what they are for. The same for bf16 operands (no scales). Runs without TRITON_INTERPRET
    (tests/sm90.py)."""
    ints = ["M", "N", "K", "k_per_split", "stride_am", "stride_bn", "stride_om"]
    aligned = ["a_ptr", "b_ptr", "out_ptr", "partial_ptr", "N", "K", "k_per_split", "stride_am", "stride_bn"]
    cases = {}  # (dtype, BLOCK_M, config, A_GROUP), each once
    for key, cfg in gemm_module.TUNED[gemm_module.REFERENCE_GPU].items():
        dtype = "bf16" if key.startswith("bf16,") else "fp8"
        cases[(dtype, int(key.removeprefix("bf16,").split(",")[0]), cfg, 0)] = None
    for dtype, element_bytes in (("fp8", 1), ("bf16", 2)):
        for m in (1, 64):
            cfg = gemm_module.heuristic_config(m, 2304, 16384, element_bytes=element_bytes)
            cases[(dtype, gemm_module.m_bucket(m), cfg, 0)] = None
    # A scaled per group of 512 (a Llama-3 kv head's slice of the attention output).
    cases |= {(dtype, block_m, cfg, 512): None for dtype, block_m, cfg, _ in cases if dtype == "fp8"}
    assert any(not cfg.early_tile for *_, cfg, _ in cases) and any(cfg.early_tile for *_, cfg, _ in cases)
    for dtype, block_m, cfg, a_group in cases:
        operand, scaled = ("*fp8e4nv", True) if dtype == "fp8" else ("*bf16", False)
        names = ("a", "b", "a_scale", "b_scale", "out", "partial")
        types = (operand, operand, "*fp32", "*fp32", "*bf16", "*fp32")
        signature = {f"{name}_ptr": t for name, t in zip(names, types, strict=True)}
        signature |= dict.fromkeys(ints, "i32")
        constexprs = dict(
            SCALED=scaled,
            A_PER_TOKEN=scaled,
            A_GROUP=a_group,
            B_PER_CHANNEL=scaled,
            BLOCK_M=block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SWAP_AB=cfg.swap_ab,
            EARLY_TILE=int(cfg.early_tile),
            SPLIT=cfg.split_k > 1,
            SNAP=False,
            UPCAST=False,
            PDL=True,
        )
        compiled = compile_sm90(
            gemm_module._skinny_gemm_kernel,
            signature,
            constexprs,
            aligned,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        where = f"{dtype} M <= {block_m}, {cfg}, A groups of {a_group or 'K'}"
        assert "serialized" not in ptxas_log(compiled.asm["ptx"]), f"{where}: wgmma serialized"
        if cfg.swap_ab:
            assert "wgmma.mma_async" in compiled.asm["ptx"], f"{where}: no wgmma"
        if block_m <= 16 and not cfg.early_tile:
            assert 2 * compiled.metadata.shared <= MAX_SHARED_BYTES, f"{where}: one program per SM"


def test_gemm_compiles_for_sm90() -> None:
    run_without_interpreter("tests.test_fp8_kernels")


def test_gemm_per_tensor_scales_and_large_m_handover(poisoned: None) -> None:
    a = bf16(70, 128).to(FP8)
    b = bf16(48, 128).to(FP8)
    a_scale, b_scale = torch.tensor([0.5], device=DEVICE), torch.tensor([0.25], device=DEVICE)
    ref = fp8_gemm_reference(a, a_scale, b, b_scale)
    assert rel_err(fp8_gemm(a[:9], a_scale, b, b_scale), ref[:9]) < 1e-2
    assert rel_err(fp8_gemm(a, a_scale, b, b_scale), ref) < 1e-2  # M > 64: the stock path


@pytest.mark.parametrize("swap_ab", [False, True])
def test_split_k_is_deterministic(swap_ab: bool) -> None:
    a, a_scale = quantize_per_token(bf16(4, 1024))
    b, b_scale = quantize_weight_per_channel(bf16(64, 1024))
    config = GemmConfig(block_n=64 if swap_ab else 32, block_k=128, split_k=4, swap_ab=swap_ab)
    first = skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    assert all(torch.equal(first, skinny_fp8_gemm(a, a_scale, b, b_scale, config)) for _ in range(3))


def test_split_k_workspace_is_left_empty() -> None:
    """Each element of the split-K workspace is its own arrival flag: every call must leave the whole
    workspace at the EMPTY sentinel, or the next call would sum a stale partial."""
    a, a_scale = quantize_per_token(bf16(5, 1000))
    b, b_scale = quantize_weight_per_channel(bf16(300, 1000))
    ref = fp8_gemm_reference(a, a_scale, b, b_scale)
    for split in (2, 5, 3):  # different slices of the workspace each time
        out = skinny_fp8_gemm(a, a_scale, b, b_scale, GemmConfig(64, 128, split, swap_ab=True))
        assert rel_err(out, ref) < 1e-2
        workspace = gemm_module.split_workspace(a.device, 0)
        assert (workspace.view(torch.int32) == gemm_module.EMPTY.value).all()


def test_split_k_workspace_outlives_its_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA graph captured before the workspace grew still points at the old one: it must stay
    allocated (and EMPTY) rather than go back to the allocator."""
    monkeypatch.setattr(gemm_module, "_WORKSPACES", {})
    device = torch.device(DEVICE)
    old = weakref.ref(gemm_module.split_workspace(device, 10))
    grown = gemm_module.split_workspace(device, old().numel() + 1)
    assert grown.numel() > old().numel()
    assert old() is not None and (old().view(torch.int32) == gemm_module.EMPTY.value).all()


@pytest.mark.parametrize(
    ("n", "k", "split"),
    [
        (2304, 16384, 3),
        (4096, 4096, 2),
        (6144, 4096, 1),
        (1280, 8192, 4),
        (2304, 2048, 1),
        (10240, 8192, 3),
        (28672, 4096, 1),
    ],
)
def test_heuristic_split(n: int, k: int, split: int) -> None:
    """Narrow N fills the 132 SMs once, 1-2 tiles per SM get a last wave at least 90% full (at M <= 16
    only), wider N no split; every slice at least 2048 long. Programs that fit in one wave at M <= 16
    give up the early tile for a fifth stage."""
    cfg = gemm_module.heuristic_config(1, n, k)
    assert cfg.split_k == split
    assert cfg.split_k == 1 or k // cfg.split_k >= 2048
    one_wave = -(-n // 64) * split <= 132
    assert (cfg.early_tile, cfg.num_stages) == ((False, 5) if one_wave else (True, 4))
    assert gemm_module.heuristic_config(32, n, k).early_tile
    assert gemm_module.heuristic_config(64, n, k).split_k == (1 if n >= 132 * 64 else split)


def test_configs_are_looked_up_per_gpu_model(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A GPU model's own tuned config wins, a model tuned for nothing falls back to the reference GPU's,
    an untuned shape to the heuristic; saving one model's configs keeps the others'."""
    own, reference = GemmConfig(64, 128, 5, num_stages=6, swap_ab=True), GemmConfig(64, 256, 2, swap_ab=True)
    monkeypatch.setattr(gemm_module, "TUNED", {gemm_module.REFERENCE_GPU: {"16,4096,512": reference}})
    monkeypatch.setattr(gemm_module, "CONFIG_FILE", tmp_path / "configs.json")
    monkeypatch.setattr(gemm_module, "gpu_model", lambda device: "Some GPU")
    device = torch.device(DEVICE)
    assert gemm_module.config_for(3, 4096, 512, device) == reference
    gemm_module.save_tuned("Some GPU", {"16,4096,512": own})
    assert gemm_module.config_for(3, 4096, 512, device) == own
    assert gemm_module.config_for(3, 4096, 1024, device) == gemm_module.heuristic_config(3, 4096, 1024)
    saved = gemm_module._load_tuned()
    assert saved == {gemm_module.REFERENCE_GPU: {"16,4096,512": reference}, "Some GPU": {"16,4096,512": own}}
    (tmp_path / "configs.json").write_text('{"16,4096,512": {"block_n": 64, "block_k": 256, "split_k": 2}}')
    with pytest.raises(ValueError, match="GPU models"):
        gemm_module._load_tuned()


def test_bad_inputs_fail_clearly() -> None:
    a, a_scale = quantize_per_token(bf16(2, 64))
    b, b_scale = quantize_weight_per_channel(bf16(32, 64))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(a.float(), a_scale, b, b_scale)
    with pytest.raises(ValueError, match="bfloat16 operands"):
        bf16_gemm(bf16(2, 64).float(), bf16(32, 64))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        bf16_gemm(bf16(2, 64), bf16(32, 48))
    with pytest.raises(ValueError, match="contiguous along K"):
        bf16_gemm(bf16(2, 64), bf16(64, 32).t())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fp8_gemm(a, a_scale, b[:, :32].contiguous(), b_scale)
    with pytest.raises(ValueError, match="per row"):
        fp8_gemm(a, a_scale[:1].repeat(3), b, b_scale)
    with pytest.raises(ValueError, match="hidden size"):
        rmsnorm_fp8(bf16(2, 64), bf16(32), 1e-5, None)
    for x in (bf16(2, 63), bf16(64)):  # odd width; one row not given as [1, 2 * hidden]
        for fn in (lambda x: swiglu_fp8(x, None), swiglu):
            with pytest.raises(ValueError, match="2 \\* hidden"):
                fn(x)
    # A static scale is one per tensor: per-row scales passed as one are refused, not read as row 0's.
    per_row = torch.full((2,), 0.02, device=DEVICE)
    with pytest.raises(ValueError, match="one number per tensor"):
        rmsnorm_fp8(bf16(2, 64), bf16(64), 1e-5, per_row)
    with pytest.raises(ValueError, match="one number per tensor"):
        add_rmsnorm_fp8(bf16(2, 64), bf16(2, 64), bf16(64), 1e-5, per_row)
    with pytest.raises(ValueError, match="one number per tensor"):
        swiglu_fp8(bf16(2, 128), per_row)


def test_rows_of_no_elements_are_refused() -> None:
    """The row kernels hold a row in registers: a row of zero columns gets one line, not a Triton error
    from a block of size 0."""
    for fn in (
        lambda: quantize_per_token(bf16(3, 0)),
        lambda: rmsnorm_fp8(bf16(3, 0), bf16(0), 1e-5, None),
        lambda: swiglu(bf16(3, 0)),
    ):
        with pytest.raises(ValueError, match="rows must have at least one element, got rows of 0"):
            fn()


def test_no_rows_give_an_empty_product() -> None:
    """M = 0 (an empty batch) is an empty [0, N] product, not a crash: the empty per-token a_scale
    once passed for a per-tensor one and was read."""
    a, a_scale = quantize_per_token(bf16(4, 64))
    b, b_scale = quantize_weight_per_channel(bf16(32, 64))
    out = fp8_gemm(a[:0], a_scale[:0], b, b_scale)
    assert out.shape == (0, 32) and out.dtype == torch.bfloat16
    assert bf16_gemm(bf16(0, 64), bf16(32, 64)).shape == (0, 32)


@pytest.mark.parametrize("m", [3, 64, 100])
def test_no_k_or_no_columns_give_zeros(poisoned: None, m: int) -> None:
    """K = 0 sums nothing (zeros, as torch.matmul), N = 0 has no columns: neither divides by zero."""
    a, b = torch.empty(m, 0, dtype=FP8, device=DEVICE), torch.empty(32, 0, dtype=FP8, device=DEVICE)
    zeros = torch.zeros(m, 32, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(fp8_gemm(a, torch.ones(m, device=DEVICE), b, torch.ones(32, device=DEVICE)), zeros)
    assert torch.equal(bf16_gemm(bf16(m, 0), bf16(32, 0)), zeros)
    a, a_scale = quantize_per_token(bf16(m, 64))
    b, b_scale = quantize_weight_per_channel(bf16(0, 64))
    assert fp8_gemm(a, a_scale, b, b_scale).shape == (m, 0)
    assert bf16_gemm(bf16(m, 64), bf16(0, 64)).shape == (m, 0)


def test_strided_scales_are_refused() -> None:
    """Per-row scales that are a column of a wider tensor: the kernel reads scales at consecutive
    addresses, so it would take its neighbours' as this row's; refused rather than mis-scaled."""
    a, a_scale = quantize_per_token(bf16(4, 64))
    b, b_scale = quantize_weight_per_channel(bf16(32, 64))
    wide_a = torch.stack([a_scale, torch.full_like(a_scale, 100.0)], dim=1)
    wide_b = torch.stack([b_scale, torch.full_like(b_scale, 100.0)], dim=1)
    for scales in ((wide_a[:, 0], b_scale), (a_scale, wide_b[:, 0]), (wide_a[:, :1], b_scale)):
        with pytest.raises(ValueError, match="contiguous scales"):
            fp8_gemm(a, scales[0], b, scales[1])


# Realistic decode shapes on the GPU: one program per row and persistent launches, with and without
# programmatic dependent launch, called back to back inside a CUDA graph (as served).


def _graph_calls(fn, calls: int = 3):
    """Run `fn` `calls` times back to back in one CUDA graph; return the outputs of the last call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn() for _ in range(calls)]
    graph.replay()
    torch.cuda.synchronize()
    return outs[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("rows", [1, 64, 1000])
def test_row_kernels_realistic(poisoned: None, monkeypatch: pytest.MonkeyPatch, pdl: bool, rows: int) -> None:
    from kernels import fp8

    monkeypatch.setattr(fp8, "USE_PDL", pdl)
    hidden, inter = 16384 - 40, 14336 + 24  # ragged: not multiples of the block
    x, weight = bf16(rows, hidden), bf16(hidden, scale=0.5) + 1
    residual = bf16(rows, hidden, scale=3.0)
    original = residual.clone()
    q, scales, got_residual = add_rmsnorm_fp8(x, residual, weight, 1e-5, None)
    ref_q, ref_scales, new_residual = add_rmsnorm_fp8_reference(x, original, weight, 1e-5, None)
    assert torch.equal(got_residual, new_residual)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)
    assert rel_err(dequantize(q, scales), dequantize(ref_q, ref_scales)) < 2e-2
    gate_up = bf16(rows, 2 * inter, scale=2.0)
    q, scales = _graph_calls(lambda: swiglu_fp8(gate_up, None))
    ref_q, ref_scales = swiglu_fp8_reference(gate_up, None)
    torch.testing.assert_close(scales, ref_scales, rtol=1e-4, atol=0)
    assert rel_err(dequantize(q, scales), dequantize(ref_q, ref_scales)) < 2e-2

    # Chained in a graph: each call's residual feeds the next call (PDL must order them).
    def chain(calls: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
        res = original
        for _ in range(calls):
            out, res = add_rmsnorm(x, res, weight, 1e-5)
        return out, res

    graph_out, graph_res = _graph_calls(chain, calls=1)
    ref_res = original
    for _ in range(3):
        ref_out, ref_res = add_rmsnorm_reference(x, ref_res, weight, 1e-5)
    assert torch.equal(graph_res, ref_res)
    assert_rounded_alike(graph_out, ref_out)


@pytest.mark.gpu
def test_split_k_workspace_is_not_grown_inside_capture(
    poisoned: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gemm_module, "_WORKSPACES", {})
    a, a_scale = quantize_per_token(bf16(16, 4096))
    b, b_scale = quantize_weight_per_channel(bf16(512, 4096))
    config = GemmConfig(64, 128, 4, swap_ab=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"), torch.cuda.graph(graph):
        skinny_fp8_gemm(a, a_scale, b, b_scale, config)
    out = _graph_calls(lambda: skinny_fp8_gemm(a, a_scale, b, b_scale, config))  # warmed up first: fine
    assert rel_err(out, fp8_gemm_reference(a, a_scale, b, b_scale)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("m", [1, 8, 16, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(2304, 16384), (6144, 4096), (4096, 14336), (1000, 3000)])
def test_gemm_realistic(
    poisoned: None, monkeypatch: pytest.MonkeyPatch, pdl: bool, m: int, n: int, k: int
) -> None:
    from kernels import fp8

    monkeypatch.setattr(fp8, "USE_PDL", pdl)
    a, a_scale = quantize_per_token(bf16(m, k))
    b, b_scale = quantize_weight_per_channel(bf16(n, k, scale=0.02))
    ref = fp8_gemm_reference(a, a_scale, b, b_scale)
    assert rel_err(_graph_calls(lambda: fp8_gemm(a, a_scale, b, b_scale)), ref) < 1e-2
    b_tensor_scale = b_scale.max().reshape(1)
    ref = fp8_gemm_reference(a, a_scale, b, b_tensor_scale)
    assert rel_err(fp8_gemm(a, a_scale, b, b_tensor_scale), ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64, 100])
@pytest.mark.parametrize(
    ("n", "k", "groups"),
    [(4096, 4096, 8), (8192, 8192, 8), (4096, 2048, 4), (8192, 1024, 1)],  # wo: 8B, 70B, 8B tp 2, 70B tp 8
)
def test_gemm_group_scales_realistic(poisoned: None, m: int, n: int, k: int, groups: int) -> None:
    """wo's GEMM on the decode attention's output, scaled per token and kv head ([M, groups]), at
    Llama-3 shapes in a CUDA graph: the tuned configs' tiles inside the groups, and past M = 64 the
    re-quantized stock path."""
    x = bf16(m, k) * torch.logspace(-1, 1, groups, device=DEVICE).repeat_interleave(k // groups)
    a, a_scale = quantize_groups(x.to(torch.bfloat16), groups)
    b, b_scale = quantize_weight_per_channel(bf16(n, k, scale=0.02))
    ref = fp8_gemm_reference(a, a_scale, b, b_scale)
    # Past M = 64, A re-quantized per token rounds each value a second time.
    assert rel_err(_graph_calls(lambda: fp8_gemm(a, a_scale, b, b_scale)), ref) < (1e-2 if m <= 64 else 4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("m", [1, 8, 16, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096), (1000, 3000)])
def test_bf16_gemm_realistic(
    poisoned: None, monkeypatch: pytest.MonkeyPatch, pdl: bool, m: int, n: int, k: int
) -> None:
    """bf16_gemm at Llama-3-8B decode shapes (and a ragged one) in a CUDA graph, the skinny kernel up
    to M = 64 and F.linear beyond."""
    from kernels import fp8

    monkeypatch.setattr(fp8, "USE_PDL", pdl)
    a, b = bf16(m, k), bf16(n, k, scale=0.02)
    assert rel_err(_graph_calls(lambda: bf16_gemm(a, b)), bf16_gemm_reference(a, b)) < 1e-2


def test_a_meta_input_is_refused() -> None:
    """A meta tensor among an op's inputs sends the call to its fake implementation, which would return
    empty tensors on the other inputs' device (garbage, without a word): the fakes run the ops' checks,
    so a static scale on another device than x is named. An op of one input on meta gives meta outputs
    (shapes only), checked as the real call is."""
    x, scale = bf16(3, 128), torch.tensor([0.05], device=DEVICE)
    with pytest.raises(ValueError, match=f"scale must be on x's device {x.device}, got meta"):
        swiglu_fp8(x, scale.to("meta"))
    with pytest.raises(ValueError, match=f"scale must be on x's device meta, got {x.device}"):
        swiglu_fp8(x.to("meta"), scale)
    values, scales = swiglu_fp8(x.to("meta"), scale.to("meta"))
    assert values.device.type == scales.device.type == "meta" and values.shape == (3, 64)
    assert swiglu(x.to("meta")).shape == (3, 64)
    values, scales = quantize_per_token(x.to("meta"))
    assert values.device.type == "meta" and values.shape == (3, 128) and scales.shape == (3,)
    with pytest.raises(ValueError, match="2 \\* hidden"):
        swiglu(bf16(3, 63).to("meta"))
    with pytest.raises(ValueError, match="one number per tensor"):
        swiglu_fp8(x.to("meta"), torch.ones(3, device="meta"))
    with pytest.raises(ValueError, match=r"row-contiguous \[M, K\]"):
        quantize_per_token(bf16(64).to("meta"))

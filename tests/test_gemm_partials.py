"""Split-K partials handed to the norm (kernels.fp8_gemm.fp8_gemm_partials / bf16_gemm_partials, summed
by kernels.fp8_norm's add_rmsnorm / add_rmsnorm_fp8): the same values, bit for bit, as the GEMM summing
them itself and the norm reading its bf16 output; on CPU through Triton's interpreter, on a GPU natively."""

import pytest
import torch
import triton

from kernels import fp8_gemm as gemm_module
from kernels.fp8 import quantize_per_token, quantize_weight_per_channel
from kernels.fp8_gemm import (
    GemmConfig,
    bf16_gemm,
    bf16_gemm_partials,
    fp8_gemm,
    fp8_gemm_partials,
    partial_count,
    skinny_bf16_gemm,
    skinny_fp8_gemm,
)
from kernels.fp8_norm import add_rmsnorm, add_rmsnorm_fp8, add_rmsnorm_reference
from tests.test_fp8_kernels import assert_rounded_alike, poisoned  # noqa: F401 (a fixture)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(m: int, n: int, k: int) -> tuple[torch.Tensor, ...]:
    a = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    b = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    return a, b


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 96, 512), (5, 200, 384), (16, 64, 1000)])
def test_partials_sum_to_the_gemm_output(poisoned: None, split_k: int, m: int, n: int, k: int) -> None:  # noqa: F811
    a, b = operands(m, n, k)
    config = GemmConfig(64, 128, split_k, swap_ab=True)
    q, scale = quantize_per_token(a)
    wq, wscale = quantize_weight_per_channel(b)
    for partials, whole in (
        (skinny_bf16_gemm(a, b, config, partials=True), skinny_bf16_gemm(a, b, config)),
        (
            skinny_fp8_gemm(q, scale, wq, wscale, config, partials=True),
            skinny_fp8_gemm(q, scale, wq, wscale, config),
        ),
    ):
        slices = triton.cdiv(k, triton.cdiv(triton.cdiv(k, split_k), 128) * 128)  # the launcher's
        assert partials.shape == (slices, m, n) and partials.dtype == torch.float32
        total = partials[0]
        for part in partials[1:]:
            total = total + part
        assert torch.equal(total.to(torch.bfloat16), whole)
        residual = torch.randn(m, n, device=DEVICE).to(torch.bfloat16)
        weight = torch.rand(n, device=DEVICE).to(torch.bfloat16) + 0.5
        # The norm sums the partials as it loads them: equal to the norm of the GEMM's bf16 output.
        got, got_residual = add_rmsnorm(partials, residual, weight, 1e-5)
        expected, expected_residual = add_rmsnorm(whole, residual, weight, 1e-5)
        assert torch.equal(got, expected) and torch.equal(got_residual, expected_residual)
        reference, reference_residual = add_rmsnorm_reference(partials, residual, weight, 1e-5)
        assert torch.equal(reference_residual, expected_residual)
        assert_rounded_alike(got, reference.float())
        got_q, got_scales, got_residual = add_rmsnorm_fp8(partials, residual, weight, 1e-5, None)
        want_q, want_scales, want_residual = add_rmsnorm_fp8(whole, residual, weight, 1e-5, None)
        assert torch.equal(got_q.float(), want_q.float()) and torch.equal(got_scales, want_scales)
        assert torch.equal(got_residual, want_residual)


def test_partials_ops_and_their_slice_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' slices are partial_count's (what their fake tells torch.compile); past M = 64 one slice
    of the stock path's product."""
    monkeypatch.setattr(gemm_module, "config_for", lambda *args: GemmConfig(64, 128, 2, swap_ab=True))
    a, b = operands(3, 64, 512)
    assert partial_count(a, None, b) == 2
    assert bf16_gemm_partials(a, b, 2).shape == (2, 3, 64)
    q, scale = quantize_per_token(a)
    wq, wscale = quantize_weight_per_channel(b)
    assert partial_count(q, scale, wq) == 2 == fp8_gemm_partials(q, scale, wq, wscale, 2).shape[0]
    with pytest.raises(ValueError, match=r"asked for 3 split-K partials .* whose config splits K into 2"):
        bf16_gemm_partials(a, b, 3)
    big = torch.randn(80, 512, device=DEVICE).to(torch.bfloat16)
    assert partial_count(big, None, b) == 1
    assert torch.equal(bf16_gemm_partials(big, b, 1)[0].to(torch.bfloat16), bf16_gemm(big, b))
    qbig, sbig = quantize_per_token(big)
    assert torch.equal(
        fp8_gemm_partials(qbig, sbig, wq, wscale, 1)[0].to(torch.bfloat16), fp8_gemm(qbig, sbig, wq, wscale)
    )


def test_partials_of_the_wrong_form_are_refused() -> None:
    residual = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match=r"x as split-K partials must be a contiguous fp32"):
        add_rmsnorm(torch.zeros(2, 3, 64, dtype=torch.bfloat16, device=DEVICE), residual, weight, 1e-5)
    with pytest.raises(ValueError, match=r"residual shape \(3, 64\) must equal x's rows \(4, 64\)"):
        add_rmsnorm(torch.zeros(2, 4, 64, device=DEVICE), residual, weight, 1e-5)


def test_a_meta_input_or_a_bad_eps_is_refused() -> None:
    """A call with a meta tensor among its inputs goes to the op's fake implementation, which checks the
    inputs as the op does (it returned uninitialized memory on the other inputs' device)."""
    a, b = operands(3, 64, 512)
    q, scale = quantize_per_token(a)
    wq, wscale = quantize_weight_per_channel(b)
    residual = torch.zeros(3, 64, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    meta = "meta"
    calls = [
        (lambda: bf16_gemm(a, b.to(meta)), "b must be on a's device"),
        (lambda: bf16_gemm_partials(a.to(meta), b, 1), "b must be on a's device"),
        (lambda: fp8_gemm(q, scale, wq, wscale.to(meta)), "b_scale must be on a's device"),
        (lambda: fp8_gemm_partials(q, scale.to(meta), wq, wscale, 1), "a_scale must be on a's device"),
        (lambda: add_rmsnorm(residual, residual, weight.to(meta), 1e-5), "weight must be on x's device"),
        (lambda: add_rmsnorm_fp8(residual, residual, weight, 1e-5, torch.ones(1, device=meta)), "scale must"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(ValueError, match=r"eps must be > 0, got 0.0"):
        add_rmsnorm(residual, residual, weight, 0.0)


def test_a_compiled_step_follows_the_configs_split(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The slice count is a constant of the traced graph, so a step compiled under other GEMM configs (a
    new tune) is a graph of its own, not a cached one whose partials have another shape."""
    from model.args import ModelArgs
    from model.decode import Bf16Kernels, convert_for_decode
    from model.generate import DecodeStep, prefill
    from model.llama import Llama

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # one on-disk cache for both compiles
    args = ModelArgs(dim=128, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=256)
    model = Llama(args).to(DEVICE)
    model.init_weights()
    model = convert_for_decode(model.to(torch.bfloat16).eval(), Bf16Kernels())
    tokens = torch.randint(0, 160, (2, 8), device=DEVICE)
    outputs = []
    for split in (1, 2):
        monkeypatch.setattr(
            gemm_module, "config_for", lambda *a, s=split: GemmConfig(64, 64, s, swap_ab=True)
        )
        torch._dynamo.reset()
        model.setup_caches(2, 16)
        prefill(model, tokens)
        step = DecodeStep(model, 2, torch.device(DEVICE), cuda_graph=False, compile=True)
        outputs.append(step(tokens[:, -1:], 8).float())
    assert torch.equal(outputs[0], outputs[1])  # the partials' sum is the GEMM's, whatever the split

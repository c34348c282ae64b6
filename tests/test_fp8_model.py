"""model.fp8=true: the FP8 decode model (fused kernels, FP8 weights) tracks the bf16 model, with the
KV cache, on CPU through Triton's interpreter and on a GPU; so does its tensor-parallel form (tp=2 on
gloo, on CPU). Compiled decode steps (compile=true) equal the eager ones."""

import copy

import pytest
import torch

from model.args import ModelArgs
from model.decode import DecodeBlock
from model.fp8 import Fp8Weight, check_fp8_device, convert_to_fp8
from model.generate import DecodeStep, prefill
from model.llama import Llama
from tests.test_bf16_decode import residual_moving_model, vary_norm_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tie", [False, True])
def test_fp8_model_tracks_bf16(tie: bool) -> None:
    args = ModelArgs(
        dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=200, tie_embeddings=tie
    )
    model = Llama(args).to(DEVICE)
    model.init_weights()
    vary_norm_weights(model)
    with torch.no_grad():
        # Untied, the embedding's std of 1 would drown the blocks' outputs and a dropped residual add
        # would go unseen: at std 0.02, dropping one moves the logits by >= 12%, FP8 by <= 6%.
        model.tok_embeddings.weight.normal_(std=0.02)
    model = model.to(torch.bfloat16).eval()
    tokens = torch.randint(0, 160, (2, 12), device=DEVICE)
    model.setup_caches(2, 16)
    expected = prefill(model, tokens).float()
    with torch.no_grad():
        expected_step = model(tokens[:, -1:], torch.tensor([12], device=DEVICE))[:, -1].float()
    model.clear_caches()

    args.fp8 = True
    convert_to_fp8(model)
    assert all(isinstance(layer, DecodeBlock) and isinstance(layer.qkv, Fp8Weight) for layer in model.layers)
    model.setup_caches(2, 16)
    got = prefill(model, tokens).float()
    with torch.no_grad():
        step = model(tokens[:, -1:], torch.tensor([12], device=DEVICE))[:, -1].float()
    # e4m3 keeps 3 mantissa bits: a few percent, not more, in the prefill and in a step over the cache.
    for ours, bf16 in ((got, expected), (step, expected_step)):
        rel = ((ours - bf16).norm() / bf16.norm()).item()
        assert rel < 0.08, rel


def test_compiled_fp8_decode_step_matches_eager() -> None:
    """compile=true with model.fp8=true: every kernel is an opaque custom op to torch.compile, and the
    compiled (on a GPU also CUDA-graphed) decode step gives the eager step's logits."""
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=200)
    model = Llama(args).to(DEVICE)
    model.init_weights()
    model = convert_to_fp8(model.to(torch.bfloat16).eval())
    tokens = torch.randint(0, 160, (2, 12), device=DEVICE)
    model.setup_caches(2, 16)
    prefill(model, tokens)
    with torch.no_grad():
        eager = model(tokens[:, -1:], torch.tensor([12], device=DEVICE))[:, -1].float()
    step = DecodeStep(model, 2, torch.device(DEVICE), cuda_graph=True, compile=True)
    compiled = step(tokens[:, -1:], 12).float()
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-2


def test_fp8_needs_a_gpu_with_fp8() -> None:
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        check_fp8_device(torch.device("cpu"))
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        if torch.cuda.get_device_capability(gpu) >= (8, 9):
            check_fp8_device(gpu)
        else:
            with pytest.raises(ValueError, match="has no FP8 tensor cores"):
                check_fp8_device(gpu)


def _tp_fp8_tracks_bf16(rank: int, world: int) -> None:
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import ParallelizeConfig, fp8_decode_hooks, parallelize_llama

    torch.manual_seed(0)  # the same weights and tokens on every rank
    reference = residual_moving_model()
    tokens = torch.randint(0, 160, (2, 12))
    reference.setup_caches(2, 16)
    expected = prefill(reference, tokens).float()

    model = copy.deepcopy(reference)
    model.clear_caches()
    mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=world), "cpu")
    parallelize_llama(model, mesh, ParallelizeConfig(sequence_parallel=False, fsdp=False))
    convert_to_fp8(model, **fp8_decode_hooks(model))
    assert model.layers[0].qkv.weight.shape[0] == (4 + 2 + 2) * 32 // world  # this rank's heads only
    model.setup_caches(2, 16)
    got = prefill(model, tokens).float()
    assert got.shape == expected.shape  # the vocabulary shards gathered
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel < 0.1, rel
    with torch.no_grad():
        step = model(tokens[:, -1:], torch.tensor([12]))[:, -1].float()
    assert torch.isfinite(step).all()
    # compile=true under tensor parallelism: the hooks' collectives trace into the compiled step.
    compiled = DecodeStep(model, 2, torch.device("cpu"), cuda_graph=False, compile=True)(tokens[:, -1:], 12)
    assert ((compiled.float() - step).norm() / step.norm()).item() < 1e-2


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU (gloo + interpreter) form of the tensor-parallel test")
def test_tensor_parallel_fp8_model_tracks_bf16() -> None:
    from tests.multiprocess import run_ranks

    run_ranks(_tp_fp8_tracks_bf16, 2)


def test_compile_registers_weft_ops_with_inductor_up_front() -> None:
    """compile=true gives every weft op its inductor fallback before anything is compiled, with the
    layout constraint inductor would choose (model.generate.register_weft_ops_with_inductor: torch
    2.11 would otherwise print a deep IR description of each op's first call, for minutes)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=200)
    model = convert_to_fp8(Llama(args).to(DEVICE, torch.bfloat16).eval())
    ops = [
        getattr(getattr(torch.ops.weft, n), o)
        for n in torch.ops.weft
        for o in getattr(torch.ops.weft, n).overloads()
    ]
    assert {"add_rmsnorm_fp8", "fp8_gemm", "swiglu_fp8", "quantize_per_token"} <= set(torch.ops.weft)
    for op in ops:  # as in a fresh process: earlier compiles in this one registered them on first sight
        lowering.lowerings.pop(op, None)
    DecodeStep(model, 1, torch.device(DEVICE), cuda_graph=False, compile=True)
    assert all(op in lowering.lowerings for op in ops)
    for op in ops:
        expected = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert lowering.maybe_layout_constraints(op) is expected, op

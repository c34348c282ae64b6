"""model.decode_kernels: the bf16 decode model (model/decode.py: fused projections on weft's skinny GEMM,
fused norms and SwiGLU) decodes as the stock model does, eager and compiled, and in its tensor-parallel
form (tp=2 on gloo); on CPU through Triton's interpreter, on a GPU natively.

"As the stock model does" is checked teacher-forced: both models are fed the stock model's greedy tokens
and must give logits within 1e-2 and the same next token wherever the stock model's top two logits are
further apart than the two paths' rounding can move them. Free-running token equality is no property of
any reordering of bf16 arithmetic on a random-weight model: its top two logits tie exactly at some steps
(an untied 4-layer model here: gap 0 within 64 steps), where one rounding picks the other token and the
continuations part.
"""

import copy

import pytest
import torch

from model.args import ModelArgs
from model.decode import Bf16Kernels, Bf16Weight, DecodeBlock, convert_for_decode, runs_bf16_decode_kernels
from model.generate import DecodeStep, generate, prefill
from model.llama import Llama, RMSNorm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ARGS = dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=200)


def vary_norm_weights(model: Llama) -> None:
    """Every RMSNorm weight drawn from [0.5, 1.5): initialised to ones, a norm applied with another
    norm's weight, or with none, would compute the same."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.uniform_(0.5, 1.5)


def tiny_model(tie: bool = False) -> Llama:
    model = Llama(ModelArgs(**ARGS, tie_embeddings=tie)).to(DEVICE)
    model.init_weights()
    vary_norm_weights(model)
    with torch.no_grad():
        # The untied embedding's std of 1 would drown the blocks' outputs, and a block that computed
        # nothing would go unseen in the tokens.
        model.tok_embeddings.weight.normal_(std=0.02)
    return model.to(torch.bfloat16).eval()


def residual_moving_model() -> Llama:
    """The tiny model (ARGS) on the CPU in bf16, its wo and w2 scaled up 30x so that the blocks move the
    residual stream and a missing all-reduce of their tensor-parallel shards shows in the logits."""
    model = Llama(ModelArgs(**ARGS))
    model.init_weights()
    vary_norm_weights(model)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wo.weight.mul_(30)
            layer.feed_forward.w2.weight.mul_(30)
    return model.to(torch.bfloat16).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# Top-two logit gaps above this (logits of std ~1; bf16's spacing there is 1/64 to 1/128) are decided
# the same way by both paths.
CLEAR_GAP = 0.05


def forced_logits(model: Llama, prompt: torch.Tensor, tokens: torch.Tensor, **step_options) -> torch.Tensor:
    """Logits [steps, B, V] (fp32) of `model` fed `prompt` [B, S] and then `tokens` [B, steps] one at a
    time on DecodeStep(**step_options): the first from the prefill, each next after one more token."""
    batch, prompt_len = prompt.shape
    steps = tokens.shape[1]
    model.setup_caches(batch, prompt_len + steps)
    step = DecodeStep(model, batch, prompt.device, **step_options)
    logits = [prefill(model, prompt).float()]
    for i in range(steps - 1):
        logits.append(step(tokens[:, i : i + 1], prompt_len + i).float().clone())
    model.clear_caches()
    return torch.stack(logits)


def assert_decodes_alike(
    got: torch.Tensor, ref: torch.Tensor, min_clear: float = 0.5, tol: float = 1e-2
) -> None:
    """Forced logits `got` as the stock model's `ref`: within `tol` at every step, the same argmax at every
    clear step, and most steps clear (the check is not vacuous)."""
    for i in range(ref.shape[0]):
        assert rel(got[i], ref[i]) < tol, f"step {i}: logits off by {rel(got[i], ref[i]):.3g}"
    top = ref.topk(2, dim=-1).values
    clear = top[..., 0] - top[..., 1] > CLEAR_GAP
    assert clear.float().mean() >= min_clear, f"only {clear.float().mean():.0%} of the steps are clear"
    differ = (got.argmax(-1) != ref.argmax(-1)) & clear
    assert not differ.any(), f"other tokens at clear (step, row): {differ.nonzero().tolist()}"


@pytest.mark.parametrize("tie", [False, True])
def test_bf16_decode_model_decodes_the_stock_tokens(tie: bool) -> None:
    """The stock model's greedy tokens, teacher-forced into its bf16 decode form (module docstring).
    The prompt (2 x 40 tokens) goes beyond the skinny GEMM's 64 rows (F.linear), the decode steps stay
    on it."""
    stock = tiny_model(tie)
    prompt = torch.randint(0, 160, (2, 40), device=DEVICE)
    tokens = generate(stock, prompt, 8, cuda_graph=False)
    expected = forced_logits(stock, prompt, tokens, cuda_graph=False)

    model = convert_for_decode(copy.deepcopy(stock), Bf16Kernels())
    assert all(isinstance(layer, DecodeBlock) for layer in model.layers)
    assert model.layers[0].qkv.weight.shape == (4 * 32 + 2 * 2 * 32, 128)  # wq|wk|wv fused
    assert model.layers[0].w13.weight.shape == (2 * 200, 128)
    if tie:  # the output projection reads the embedding itself, not a copy
        assert model.output.proj.weight is model.tok_embeddings.weight
    assert_decodes_alike(forced_logits(model, prompt, tokens, cuda_graph=False), expected)


def test_compiled_bf16_decode_step_matches_eager() -> None:
    """compile=true: the skinny GEMM, norm and SwiGLU ops are opaque to torch.compile, and the compiled
    (on a GPU also CUDA-graphed) decode step gives the eager step's logits."""
    model = convert_for_decode(tiny_model(), Bf16Kernels())
    tokens = torch.randint(0, 160, (3, 12), device=DEVICE)
    model.setup_caches(3, 16)
    prefill(model, tokens)
    with torch.no_grad():
        eager = model(tokens[:, -1:], torch.tensor([12], device=DEVICE))[:, -1]
    step = DecodeStep(model, 3, torch.device(DEVICE), cuda_graph=True, compile=True)
    assert rel(step(tokens[:, -1:], 12), eager) < 1e-2


def test_decode_kernels_switch() -> None:
    """serve.build_model takes the bf16 decode path for bf16 models on CUDA GPUs (8.0+) with
    model.decode_kernels on; the switch, another dtype, FP8 or the CPU give the stock modules."""
    args = ModelArgs(**ARGS)
    cuda = torch.device("cuda", 0)
    if torch.cuda.is_available() and torch.cuda.get_device_capability(cuda) >= (8, 0):
        assert runs_bf16_decode_kernels(args, cuda, torch.bfloat16)
        assert not runs_bf16_decode_kernels(args, cuda, torch.float16)
    assert not runs_bf16_decode_kernels(args, torch.device("cpu"), torch.bfloat16)
    for off in (ModelArgs(**ARGS, decode_kernels=False), ModelArgs(**ARGS, fp8=True)):
        assert not runs_bf16_decode_kernels(off, cuda, torch.bfloat16)


def test_bf16_weight_fuses_and_keeps() -> None:
    a, b = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    fused = Bf16Weight(a, b)
    assert torch.equal(fused.weight, torch.cat([a, b])) and not fused.weight.requires_grad
    single = torch.nn.Parameter(a)
    assert Bf16Weight(single).weight is single


def _tp_bf16_decode_tracks_stock(rank: int, world: int) -> None:
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import ParallelizeConfig, decode_hooks, parallelize_llama

    torch.manual_seed(0)  # the same weights and tokens on every rank
    reference = residual_moving_model()
    prompt = torch.randint(0, 160, (2, 12))
    tokens = generate(reference, prompt, 4, cuda_graph=False)
    expected = forced_logits(reference, prompt, tokens, cuda_graph=False)

    model = copy.deepcopy(reference)
    mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=world), "cpu")
    parallelize_llama(model, mesh, ParallelizeConfig(sequence_parallel=False, fsdp=False))
    convert_for_decode(model, Bf16Kernels(), **decode_hooks(model))
    assert model.layers[0].qkv.weight.shape[0] == (4 + 2 + 2) * 32 // world  # this rank's heads only
    assert_decodes_alike(forced_logits(model, prompt, tokens, cuda_graph=False), expected)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU (gloo + interpreter) form of the tensor-parallel test")
def test_tensor_parallel_bf16_decode_model_decodes_the_stock_tokens() -> None:
    from tests.multiprocess import run_ranks

    run_ranks(_tp_bf16_decode_tracks_stock, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_bf16_decode_model_on_gpu_decodes_the_stock_tokens(compile: bool) -> None:
    """64 greedy steps of serve.build_model's bf16 model on the stock modules (model.decode_kernels=false),
    teacher-forced into the one on weft's kernels, both stepped in CUDA graphs (compiled or not)."""
    from serve import build_model

    args = ModelArgs(**{**ARGS, "n_layers": 4, "max_seq_len": 256})
    device = torch.device("cuda", torch.cuda.current_device())
    prompt = torch.randint(0, 160, (3, 20), device=device)
    logits, tokens = {}, None
    for kernels in (False, True):
        args.decode_kernels = kernels
        torch.manual_seed(0)  # the same random weights
        model = build_model(args, None, device, torch.bfloat16)
        assert isinstance(model.layers[0], DecodeBlock) == kernels
        if tokens is None:
            tokens = generate(model, prompt, 64, cuda_graph=True, compile=compile)
        logits[kernels] = forced_logits(model, prompt, tokens, cuda_graph=True, compile=compile)
    assert_decodes_alike(logits[True], logits[False])

"""serve.build_model with model.fp8=true materialises and quantizes one block at a time (so that
Llama-3-70B in FP8 fits on one H200): the FP8 model it builds equals, bit for bit, the one today's
materialise-everything-then-convert path gives, from the same seed or the same checkpoint (weft's or a
Hugging Face directory), plain and tensor-parallel (tp=2 on gloo), while no more than one block is ever
held in bf16. On CPU: the FP8 conversion is plain torch (kernels.fp8.quantize_weight_per_channel)."""

from pathlib import Path

import pytest
import torch

import serve
from model.args import ModelArgs
from model.checkpoint import copy_state_into, load_model_state, save_checkpoint
from model.fp8 import convert_to_fp8
from model.hf import export_hf, load_hf_checkpoint
from model.llama import Llama
from model.loading import resolve_init_weights
from parallel.checkpoint import init_parallel_weights, load_full_model_state

ARGS = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=160, ffn_hidden=96)
CPU = torch.device("cpu")


def fp8_args(tie: bool = False) -> ModelArgs:
    return ModelArgs(**ARGS, tie_embeddings=tie, fp8=True)


def comparable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with e4m3 tensors as their bytes (torch.equal has no float8 kernel on CPU)."""
    return {
        name: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        for name, t in model.state_dict().items()
    }


def assert_identical(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    got, expected = comparable(got), comparable(expected)
    assert got.keys() == expected.keys()
    assert any(t.dtype == torch.uint8 for t in got.values())  # it is the FP8 model
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def converted_after_materialising(args: ModelArgs, seed: int, checkpoint: Path | None = None) -> Llama:
    """Today's path: the whole model materialised in bf16 (random weights, then a checkpoint's full
    state), then converted to FP8."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Llama(args)
    model.to(torch.bfloat16)
    model.to_empty(device=CPU)
    model.init_weights()
    if checkpoint is not None:
        hf = (checkpoint / "config.json").is_file()
        state = load_hf_checkpoint(checkpoint)[1] if hf else load_model_state(checkpoint)
        copy_state_into(model, state, source=str(checkpoint))
    return convert_to_fp8(model)


def streamed(
    monkeypatch: pytest.MonkeyPatch, args: ModelArgs, seed: int, checkpoint: Path | None = None
) -> tuple[Llama, list[int]]:
    """serve.build_model on the CPU (its GPU check lifted), and the bf16 bytes the model held each
    time a block was converted."""
    held: list[int] = []
    convert = serve.convert_block

    def recording(model: Llama, index: int, *hooks) -> None:
        held.append(sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta))
        convert(model, index, *hooks)

    monkeypatch.setattr(serve, "check_fp8_device", lambda device: None)
    monkeypatch.setattr(serve, "convert_block", recording)
    torch.manual_seed(seed)
    return serve.build_model(args, checkpoint, CPU, torch.bfloat16), held


def one_block_at_a_time(held: list[int], args: ModelArgs) -> None:
    """When block i is converted the model holds, in bf16, the embedding, the norms of the blocks before
    it (their linear weights are FP8 buffers by then) and block i: never the other blocks."""
    embedding = 2 * args.vocab_size * args.dim
    block = 2 * (args.layer_matmul_params() + 2 * args.dim)
    assert held == [embedding + block + i * 2 * 2 * args.dim for i in range(args.n_layers)]


@pytest.mark.parametrize("tie", [False, True])
def test_streamed_fp8_build_draws_todays_random_weights(monkeypatch: pytest.MonkeyPatch, tie: bool) -> None:
    model, held = streamed(monkeypatch, fp8_args(tie), seed=5)
    assert_identical(model, converted_after_materialising(fp8_args(tie), seed=5))
    one_block_at_a_time(held, fp8_args(tie))
    assert model.rope.dtype == torch.float32


def saved_model(tmp_path: Path, hf: bool) -> Path:
    """A bf16 model of other weights than seed 5 draws, saved as a weft or Hugging Face checkpoint."""
    args = ModelArgs(**ARGS)
    torch.manual_seed(11)
    model = Llama(args).to(torch.bfloat16)
    if hf:
        return export_hf(model, args, tmp_path / "hf")
    return save_checkpoint(tmp_path / "run", 1, model)


@pytest.mark.parametrize("hf", [False, True], ids=["weft", "hugging-face"])
def test_streamed_fp8_build_loads_a_checkpoint_block_by_block(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf: bool
) -> None:
    path = saved_model(tmp_path, hf)
    checkpoint, args = resolve_init_weights(str(path), fp8_args())
    model, held = streamed(monkeypatch, args, seed=5, checkpoint=checkpoint)
    assert_identical(model, converted_after_materialising(args, seed=5, checkpoint=checkpoint))
    one_block_at_a_time(held, args)


def test_a_checkpoint_of_another_shape_is_refused_before_anything_is_allocated(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = saved_model(tmp_path, hf=False)
    wider = ModelArgs(**{**ARGS, "ffn_hidden": 128}, fp8=True)
    with pytest.raises(ValueError, match=r"does not fit the model \(mis-shaped: layers\.0\.feed_forward"):
        streamed(monkeypatch, wider, seed=5, checkpoint=path)


def _tp_streamed_build_is_todays(rank: int, world: int, checkpoint: str) -> None:
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import ParallelizeConfig, fp8_decode_hooks, parallelize_llama

    serve.check_fp8_device = lambda device: None  # this process only: the FP8 conversion runs on CPU
    mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=world), "cpu")
    for path in (None, Path(checkpoint)):
        args = fp8_args()
        torch.manual_seed(5)
        model = serve.build_model(args, path, CPU, torch.bfloat16, mesh, "torch")

        torch.manual_seed(5)
        with torch.device("meta"):
            expected = Llama(args)
        parallelize_llama(expected, mesh, ParallelizeConfig(sequence_parallel=False, fsdp=False))
        expected.to(torch.bfloat16)
        expected.to_empty(device=CPU)
        init_parallel_weights(expected)
        if path is not None:
            load_full_model_state(expected, load_model_state(path), source=str(path))
        convert_to_fp8(expected, **fp8_decode_hooks(expected))
        assert model.layers[0].qkv.weight.shape[0] == (4 + 2 + 2) * 16 // world  # this rank's heads
        assert_identical(model, expected)


def test_tensor_parallel_streamed_fp8_build_is_todays(tmp_path: Path) -> None:
    """tp=2: each rank's shards, the row-parallel ones quantized with the unsplit weights' scales
    (channel_amax), equal those of the model converted after materialising."""
    from tests.multiprocess import run_ranks

    run_ranks(_tp_streamed_build_is_todays, 2, str(saved_model(tmp_path, hf=False)))


@pytest.mark.parametrize("row_parallel", [False, True])
def test_weights_quantized_in_slices_equal_one_piece(
    monkeypatch: pytest.MonkeyPatch, row_parallel: bool
) -> None:
    """Fp8Weight quantizes a few rows at a time (small fp32 copies for the 70B output projection): the
    same e4m3 values and scales as the concatenated weight in one piece, with a row-parallel shard's
    amax over the ranks (here: doubled) too."""
    from kernels.fp8 import quantize_weight_per_channel
    from model import fp8

    monkeypatch.setattr(fp8, "QUANTIZE_SLICE_ELEMENTS", 3 * 40)  # 3 rows of 40
    torch.manual_seed(0)
    w1, w3 = torch.randn(7, 40, dtype=torch.bfloat16), torch.randn(5, 40, dtype=torch.bfloat16)
    whole = torch.cat([w1, w3])
    full_amax = (lambda amax: 2 * amax) if row_parallel else None
    expected_q, expected_scale = quantize_weight_per_channel(
        whole, 2 * whole.float().abs().amax(dim=-1) if row_parallel else None
    )
    assert len(fp8.row_slices((w1, w3))) == 5
    got = fp8.Fp8Weight(w1, w3, full_amax=full_amax)
    assert torch.equal(got.weight.view(torch.uint8), expected_q.view(torch.uint8))
    assert torch.equal(got.scale, expected_scale)


def test_llama3_70b_fp8_build_and_its_decode_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The streamed build at Llama-3-70B's shapes (80 layers, 64 query and 8 key/value heads), a dry run
    on the meta device: bench_decode's roofline bytes are the memory estimate's FP8 weights less the
    bf16 embedding (decode reads only its rows), plus the scales, plus the KV cache the estimate counts."""
    from omegaconf import OmegaConf

    from model.memory import serving_memory
    from tests.test_user_errors import composed

    args = OmegaConf.to_object(composed("serve", "model=llama3_70b").model)
    args.fp8 = True
    monkeypatch.setattr(serve, "check_fp8_device", lambda device: None)
    model = serve.build_model(args, None, torch.device("meta"), torch.bfloat16)
    assert model.layers[79].qkv.weight.shape == ((64 + 8 + 8) * 128, 8192)
    assert model.layers[79].w13.weight.dtype == torch.float8_e4m3fn
    assert model.output.proj.weight.shape == (128256, 8192)
    estimate = serving_memory(args, 1, "bfloat16", batch=8, prompt_len=512, cache_len=640)
    assert serve.kv_cache_bytes(model, 8, 640) == estimate.parts["KV cache"]
    scales = sum(b.numel() * 4 for name, b in model.named_buffers() if name.endswith(".scale"))
    embedding = 2 * args.vocab_size * args.dim
    expected = estimate.parts["weights"] - embedding + scales + estimate.parts["KV cache"]
    assert serve.decode_bytes_per_step(model, 8, 639, 640) == expected  # the step at the last position
    assert 69e9 < expected < 72e9  # about 70 GB a decode step reads: an H200 (4.8 TB/s) at ~15 ms


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not fp8_gpu(), reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_streamed_fp8_build_peaks_at_the_estimate_on_a_gpu() -> None:
    """On a GPU the streamed build's peak allocation stays within the estimate's loading peak (FP8
    weights, one bf16 block, one quantize slice), far below the model in bf16."""
    from model.memory import serving_memory

    args = ModelArgs(
        dim=1024, n_layers=24, n_heads=8, n_kv_heads=4, vocab_size=4096, ffn_hidden=4096, fp8=True
    )
    device = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = serve.build_model(args, None, device, torch.bfloat16)
    peak = torch.cuda.max_memory_allocated() - before
    estimate = serving_memory(args, 1, "bfloat16", batch=1, prompt_len=1, cache_len=1)
    assert "one block in bfloat16 while quantizing" in estimate.parts
    rope = model.rope.numel() * model.rope.element_size()
    assert peak <= 1.02 * estimate.total + rope, (peak, estimate.describe())
    assert peak < 0.75 * 2 * args.num_params()


def test_decode_roofline_counts_the_kv_cache_up_to_each_timed_step() -> None:
    """bench_decode's roofline for Llama-3-8B in bf16: the weights but the embedding table, and per step
    the KV cache up to its position (weft's decode attention reads no further). The steps at positions
    512 .. 639 read 513 .. 640 positions, 576.5 on average, not the whole 640-position cache each."""
    from omegaconf import OmegaConf

    from tests.test_user_errors import composed

    args = OmegaConf.to_object(composed("serve", "model=llama3_8b").model)
    model = serve.build_model(args, None, torch.device("meta"), torch.bfloat16)
    weights = 2 * (args.num_params() - args.vocab_size * args.dim)
    position = 2 * 32 * 8 * 8 * 128 * 2  # keys and values of 32 layers, batch 8, 8 kv heads, in bf16
    assert serve.decode_bytes_per_step(model, 8, 512, 640) == weights + 576.5 * position
    assert serve.decode_bytes_per_step(model, 8, 512, 513) == weights + 513 * position

"""The memory estimates of model/memory.py held against what is allocated: the tensors autograd saves for
the backward, the KV cache, the weights; and the one-line refusal of a model too large (llama3_8b in
24 GiB)."""

import pytest
import torch
from omegaconf import OmegaConf

from model import memory
from model.args import ModelArgs
from model.llama import Llama
from parallel.checkpoint import materialize
from parallel.loss import cross_entropy
from parallel.mesh import ParallelDims
from tests.multiprocess import run_ranks
from tests.test_user_errors import composed

GIB = 2**30


TINY = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden=192)


def saved_activation_bytes(model: Llama, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for the backward of the training loss (weights, a DTensor's
    local shard included, excepted)."""
    weights = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(model, model(tokens), tokens)
    return sum(saved.values())


def test_training_estimate_matches_what_autograd_saves() -> None:
    batch, seq = 4, 64
    measured = saved_activation_bytes(Llama(TINY), torch.randint(0, TINY.vocab_size, (batch, seq)))
    estimate = memory.training_memory(TINY, ParallelDims(1, 1, 1), batch, seq, 4, False, sharded=False)
    assert 0.8 * measured <= estimate.parts["activations"] <= 1.25 * measured
    assert estimate.parts["weights"] == 4 * sum(p.numel() for p in Llama(TINY).parameters())
    assert estimate.parts["AdamW state"] == 2 * estimate.parts["weights"]
    # tp splits the weights; FSDP2 over every rank splits them further; DDP replicas keep gradient buckets.
    tp = memory.training_memory(TINY, ParallelDims(2, 1, 2), batch, seq, 4, False, sharded=True)
    assert tp.parts["weights"] == estimate.parts["weights"] / 4
    # HSDP: each of two replicas shards over its half of the ranks.
    replicas = ParallelDims(4, 1, 2, dp_replicate=2)
    hsdp = memory.training_memory(TINY, replicas, batch, seq, 4, False, sharded=True)
    assert hsdp.parts["weights"] == tp.parts["weights"]
    ddp = memory.training_memory(TINY, ParallelDims(2, 1, 1), batch, seq, 4, False, sharded=False)
    assert ddp.parts["gradients"] == 2 * estimate.parts["gradients"]
    recompute = memory.training_memory(TINY, ParallelDims(1, 1, 1), batch, seq, 4, True, sharded=False)
    assert recompute.parts["activations"] < estimate.parts["activations"] / 1.5
    # The fused loss (GPUs) keeps no float32 softmax beside the logits.
    fused = memory.training_memory(TINY, ParallelDims(1, 1, 1), batch, seq, 4, False, False, fused_loss=True)
    assert estimate.parts["activations"] - fused.parts["activations"] == 4 * batch * seq * TINY.vocab_size


def _tp_saved_activations(rank: int, world: int) -> None:
    """A rank of train.py's tensor-parallel plan (gloo, comm torch): what autograd saves against the
    estimate, which must count the gathered inputs the all-gather-matmuls keep whole over tp."""
    from parallel.mesh import build_mesh
    from parallel.parallelize import ParallelizeConfig, parallelize_llama

    args = ModelArgs(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=64, ffn_hidden=256)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(args)
    dims = ParallelDims(1, 1, world)
    parallelize_llama(model, build_mesh(dims, "cpu"), ParallelizeConfig(fsdp=False))
    materialize(model, torch.device("cpu"))
    batch, seq = 4, 128
    measured = saved_activation_bytes(model, torch.randint(0, args.vocab_size, (batch, seq)))
    estimate = memory.training_memory(args, dims, batch, seq, 4, False, sharded=True).parts["activations"]
    assert 0.95 * measured <= estimate <= 1.25 * measured, (world, estimate, measured)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_estimate_matches_what_autograd_saves(world: int) -> None:
    run_ranks(_tp_saved_activations, world)


def test_bf16_autocast_estimate_matches_what_autograd_saves() -> None:
    """Under bf16 autocast (train.py on a GPU; the CPU's autocast saves the same tensors) the residual
    stream and the norms stay float32, and every matmul weight is saved as a bf16 copy."""
    batch, seq = 4, 64
    model = Llama(TINY)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_activation_bytes(model, torch.randint(0, TINY.vocab_size, (batch, seq)))
    estimate = memory.training_memory(TINY, ParallelDims(1, 1, 1), batch, seq, 2, False, sharded=False)
    counted = estimate.parts["activations"] + estimate.parts["autocast weight copies"]
    assert 0.8 * measured <= counted <= 1.25 * measured, (counted, measured)
    # FSDP2 gathers the blocks in bf16 instead (no autocast copies), two at a time, whatever the model's
    # depth; the embedding gathered in fp32 and the output projection in bf16. Only tp splits them.
    fsdp = memory.training_memory(TINY, ParallelDims(4, 1, 2), batch, seq, 2, False, sharded=True)
    assert "autocast weight copies" not in fsdp.parts
    table = TINY.vocab_size * TINY.dim
    block = TINY.layer_matmul_params() + 2 * TINY.dim
    assert fsdp.parts["gathered weights"] == (4 * table + 2 * table + 2 * 2 * block) / 2
    # tp alone (no FSDP2: one dp rank) keeps autocast's copies, split over tp.
    tp_only = memory.training_memory(TINY, ParallelDims(1, 1, 2), batch, seq, 2, False, sharded=True)
    assert tp_only.parts["autocast weight copies"] == estimate.parts["autocast weight copies"] / 2
    deeper = ModelArgs(**{**TINY.__dict__, "n_layers": 4 * TINY.n_layers})
    deep = memory.training_memory(deeper, ParallelDims(4, 1, 2), batch, seq, 2, False, sharded=True)
    assert deep.parts["gathered weights"] == fsdp.parts["gathered weights"]


def test_serving_estimate_matches_the_kv_cache() -> None:
    model = Llama(TINY).to(torch.bfloat16)
    model.setup_caches(batch=16, max_len=64)
    cache = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "kv_cache" in n)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    estimate = memory.serving_memory(TINY, 1, "bfloat16", batch=16, prompt_len=8, cache_len=64)
    assert estimate.parts["KV cache"] == cache
    assert estimate.parts["weights"] == weights
    # In FP8, a large model with a small cache peaks while it is quantized, one bf16 block at a time.
    big = ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336)
    big.fp8 = True
    loading = memory.serving_memory(big, 2, "bfloat16", batch=1, prompt_len=8, cache_len=64)
    assert list(loading.parts) == ["weights", "one block in bfloat16 while quantizing"]
    assert loading.total < 2 * big.num_params() / 2  # below this rank's half of the model in bf16


@pytest.mark.parametrize("tie", [False, True])
def test_fp8_serving_estimate_matches_the_built_model(monkeypatch: pytest.MonkeyPatch, tie: bool) -> None:
    """The FP8 weights the estimate counts are the bytes serve.build_model allocates for them (e4m3
    weights, bf16 embedding and norms; the scales are below its precision)."""
    from tests.test_streamed_build import streamed

    args = ModelArgs(**{**TINY.__dict__, "tie_embeddings": tie, "fp8": True})
    model, _ = streamed(monkeypatch, args, seed=0)
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if t is not model.rope}
    allocated = sum(t.numel() * t.element_size() for t in tensors.values())
    scales = sum(b.numel() * b.element_size() for name, b in model.named_buffers() if name.endswith(".scale"))
    estimate = memory.serving_memory(args, 1, "bfloat16", batch=1, prompt_len=8, cache_len=64)
    assert estimate.parts["weights"] == allocated - scales


def test_llama3_70b_in_fp8_fits_one_h200_and_in_bf16_not_one_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_decode's 70B rows: batch 8, prompt 512 + 128 decode steps."""
    args = OmegaConf.to_object(composed("serve", "model=llama3_70b").model)
    args.fp8 = True
    monkeypatch.setattr(memory, "available_memory", lambda device: 139 * GIB)  # an H200's free memory
    memory.check_serving_fits(args, 1, "bfloat16", 8, 512, 640, torch.device("cuda"), "lower it")
    assert 66 * GIB < memory.serving_memory(args, 1, "bfloat16", 8, 512, 640).total < 72 * GIB
    args.fp8 = False
    monkeypatch.setattr(memory, "available_memory", lambda device: 79 * GIB)  # an H100's
    with pytest.raises(ValueError) as caught:
        memory.check_serving_fits(args, 1, "bfloat16", 8, 512, 640, torch.device("cuda"), "lower it")
    message = str(caught.value)
    assert message.startswith("serving model llama3_70b needs about 134.6 GiB per rank (weights 131.4,")
    assert "split the model over more GPUs (torchrun --nproc_per_node=N serve.py parallel.tp=N)" in message
    assert "set model.fp8=true" in message


def test_serving_advice_lowers_what_the_mode_sets(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """serve.py's refusal advises lowering the settings of its mode (mode=generate has no batch_size),
    and only where the KV cache and the prefill are a fair share of the estimate."""
    from serve import run

    monkeypatch.setattr(memory, "available_memory", lambda device: 2**20)
    long = ["mode=generate", "device=cpu", "model.max_seq_len=100000", "max_new_tokens=90000"]
    with pytest.raises(ValueError, match=r"per rank: shorten the prompt or lower max_new_tokens; or run on"):
        run(composed("serve", *long), tmp_path)
    with pytest.raises(
        ValueError, match=r"per rank: lower batch_size, prompt_len or decode_steps; or run on"
    ):
        run(composed("serve", "device=cpu", "batch_size=4096"), tmp_path)
    # The weights alone are too large: fewer tokens cannot help.
    with pytest.raises(ValueError, match=r"per rank: run on GPUs; or pick a smaller model$"):
        run(composed("serve", "mode=generate", "device=cpu", "max_new_tokens=4"), tmp_path)


def test_serving_weights_are_allocated_in_the_serving_dtype() -> None:
    """materialize allocates no float32 weights before casting them (twice bf16's memory): the float32
    bytes it allocates stay below one weight's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    allocators = (torch.ops.aten.empty_strided, torch.ops.aten.empty, torch.ops.aten.empty_like)

    class Float32Allocations(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in allocators and out.dtype == torch.float32:
                self.bytes += out.numel() * out.element_size()
            return out

    with torch.device("meta"):
        model = Llama(TINY)
    largest = max(p.numel() for p in model.parameters()) * 4
    with Float32Allocations() as allocations:
        materialize(model, torch.device("cpu"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert allocations.bytes < largest, (allocations.bytes, largest)


def test_llama3_8b_does_not_fit_24_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda device: 24 * GIB)
    args = OmegaConf.to_object(composed("train", "model=llama3_8b").model)
    training = composed("train").training
    with pytest.raises(ValueError) as caught:
        memory.check_training_fits(args, ParallelDims(1, 1, 1), training, False, torch.device("cpu"))
    message = str(caught.value)
    assert message.startswith("training model llama3_8b needs about 146.4 GiB per rank (weights 29.9,")
    assert "but cpu has 24.0 GiB available per rank: run on GPUs" in message
    debug = OmegaConf.to_object(composed("train").model)
    memory.check_training_fits(debug, ParallelDims(1, 1, 1), training, False, torch.device("cpu"))
    # Activations too large on a GPU: the batch and activation checkpointing come first in the advice.
    monkeypatch.setattr(memory, "available_memory", lambda device: 0.1 * GIB)
    with pytest.raises(ValueError, match=r"lower training\.batch_size .*activation_checkpointing=true"):
        memory.check_training_fits(debug, ParallelDims(1, 1, 1), training, False, torch.device("cuda"))


def test_available_memory_on_cpu_is_shared_by_the_node_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    one = memory.available_memory(torch.device("cpu"))
    assert one is not None and one > 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert memory.available_memory(torch.device("cpu")) == pytest.approx(one / 4, rel=0.2)

"""How much memory a rank needs to train or serve a model, checked against what its device has free
before the model is built, so that a model too large fails with a line saying what to change instead
of in the allocator.

The estimates count what is certain to be allocated (weights, gradients, AdamW's moments, the tensors
saved for the backward, the KV cache, prefill's logits) and leave out the allocator's slack and short
transient buffers: a run they refuse cannot fit, one they pass can still be tight.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs.schema import TrainingConfig
from model.args import ModelArgs
from parallel.mesh import ParallelDims

GIB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes one rank needs at its peak, by part (name -> bytes)."""

    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = ", ".join(f"{name} {size / GIB:.1f}" for name, size in self.parts.items() if size >= GIB / 20)
        return f"about {self.total / GIB:.1f} GiB per rank ({parts} GiB)"


def block_activation_bytes(args: ModelArgs, activation_bytes: int) -> int:
    """Bytes one transformer block saves for its backward, per token: the norms' inputs and outputs,
    q/k/v before and after the rotary embedding, the attention output, the residuals, and the MLP's
    w1 and w3 outputs, their SwiGLU product and w2's output (tests/test_memory.py holds it against the
    tensors autograd saves). Under bf16 autocast (`activation_bytes` 2) the residual stream and the
    norms stay float32 (the weights are), and each linear layer saves its own bf16 copy of its input."""
    kv_dim = args.n_kv_heads * args.head_dim
    if activation_bytes == 4:
        return 4 * (10 * args.dim + 3 * kv_dim + 4 * args.ffn_hidden)
    return 4 * 4 * args.dim + activation_bytes * (7 * args.dim + 2 * kv_dim + 4 * args.ffn_hidden)


def training_memory(
    args: ModelArgs,
    dims: ParallelDims,
    batch_size: int,
    seq_len: int,
    activation_bytes: int,
    activation_checkpointing: bool,
    sharded: bool,
    fused_loss: bool = False,
) -> MemoryEstimate:
    """A training rank's peak: fp32 weights, gradients and AdamW's two moments (split over tp, and over
    a replica's ranks when FSDP2 shards them: `sharded`), DDP's gradient buckets when replicated over
    several ranks, and one micro-batch's activations (`activation_bytes` per element: 2 under bf16 autocast).
    Unsharded, autocast makes a bf16 copy of every matmul weight, which the backward keeps where it saved
    them: every block's without activation checkpointing, with it the recomputed block's and the output
    projection's. FSDP2 holds gathered weights instead (parallel/parallelize.py): the embedding in fp32
    through the step, the output projection in the compute dtype (a tied one: autocast's copy of the
    embedding), and two blocks' weights in the compute dtype, the running one's and the next one's."""
    params = args.num_params() / (dims.world // dims.dp_replicate if sharded else dims.tp)
    ddp_buckets = 4 * params if not sharded and dims.world > 1 else 0
    split = dims.tp * dims.cp  # sequence parallelism splits every activation over tp * cp
    tokens = batch_size * seq_len
    block = tokens * block_activation_bytes(args, activation_bytes) / split
    # but the inputs of the all-gather-matmuls (a block's wq|wk|wv and w1|w3, and the output
    # projection), which train.py's plan saves gathered over tp (parallel/layers.py, save_gathered): a
    # whole [B, S / cp, dim] each.
    gathered_input = tokens * args.dim * activation_bytes * (1 / dims.cp - 1 / split)
    block += 2 * gathered_input
    if activation_checkpointing:  # each block keeps its input (float32); one block's are recomputed
        activations = args.n_layers * tokens * args.dim * 4 / split + block
    else:
        activations = args.n_layers * block
    # The output projection's logits, kept by the loss, and the stock loss's float32 softmax (the fused
    # one on GPUs, kernels/cross_entropy.py, keeps none: `fused_loss`).
    logits = tokens * args.vocab_size * (activation_bytes + (0 if fused_loss else 4)) / split + gathered_input
    parts = {
        "weights": 4 * params,
        "gradients": 4 * params + ddp_buckets,
        "AdamW state": 8 * params,
        "activations": activations + logits,
    }
    if sharded and dims.dp * dims.cp > 1:  # parallelize_llama's FSDP2 (tp alone keeps autocast's copies)
        table = args.vocab_size * args.dim / dims.tp
        block = (args.layer_matmul_params() + 2 * args.dim) / dims.tp
        output = 0 if args.tie_embeddings and activation_bytes == 4 else activation_bytes * table
        parts["gathered weights"] = 4 * table + output + 2 * activation_bytes * block
    elif activation_bytes < 4:
        blocks = 1 if activation_checkpointing else args.n_layers
        matmul_params = blocks * args.layer_matmul_params() + args.vocab_size * args.dim
        parts["autocast weight copies"] = activation_bytes * matmul_params / dims.tp
    return MemoryEstimate(parts)


def serving_memory(
    args: ModelArgs, tp: int, dtype: str, batch: int, prompt_len: int, cache_len: int
) -> MemoryEstimate:
    """A decoding rank's peak: its slice of the weights in `dtype` with the static KV cache and the
    prefill's full-vocabulary logits. With model.fp8 the linear weights hold one byte each (the embedding
    stays in `dtype`), and the peak may come earlier, while serve.py quantizes the model block by block:
    the FP8 weights, one block or the output projection still in `dtype` (under tensor parallelism also
    the full tensor each rank draws its random slice from) and one slice being quantized."""
    params = args.num_params() / tp
    element = getattr(torch, dtype).itemsize
    kv_cache = 2 * args.n_layers * batch * (args.n_kv_heads // tp) * args.head_dim * cache_len * element
    prefill = batch * prompt_len * (args.vocab_size * element + 3 * args.ffn_hidden // tp * element)
    if not args.fp8:
        return MemoryEstimate({"weights": element * params, "KV cache": kv_cache, "prefill": prefill})
    from model.fp8 import QUANTIZE_BYTES_PER_ELEMENT, QUANTIZE_SLICE_ELEMENTS  # loads Triton: FP8 only

    table = args.vocab_size * args.dim
    embedding = table / tp
    norms = (2 * args.n_layers + 1) * args.dim
    # One byte per linear weight (a tied output projection gets an FP8 copy of the embedding); the
    # embedding and the norms stay in `dtype`.
    linear = args.n_layers * args.layer_matmul_params() / tp + embedding
    weights = linear + element * (embedding + norms)
    block = args.layer_matmul_params() / tp + 2 * args.dim
    drawn_in_full = table if tp > 1 else 0
    # The largest weight quantized at once: [w1|w3], [wq|wk|wv] or the output projection.
    largest = max(2 * args.ffn_hidden, (args.n_heads + 2 * args.n_kv_heads) * args.head_dim, args.vocab_size)
    quantizing = QUANTIZE_BYTES_PER_ELEMENT * min(QUANTIZE_SLICE_ELEMENTS, largest * args.dim / tp)
    loading = element * (max(block, embedding) + drawn_in_full) + quantizing
    if loading >= kv_cache + prefill:
        return MemoryEstimate({"weights": weights, f"one block in {dtype} while quantizing": loading})
    return MemoryEstimate({"weights": weights, "KV cache": kv_cache, "prefill": prefill})


def available_memory(device: torch.device) -> float | None:
    """Bytes this rank may use on `device`: the GPU's free memory, or the host's available memory; shared
    by the ranks on it (ranks sharing a GPU, or every rank of a node on CPU). None where unknown."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / max(1, local_ranks // torch.cuda.device_count())
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo)
        except OSError:
            return None
        return int(fields["MemAvailable"].split()[0]) * 1024 / local_ranks
    return None


def agreed_minimum(value: float) -> float:
    """The smallest `value` over all ranks, so that every rank takes the same decision."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor.item()


def check_fits(estimate: MemoryEstimate, device: torch.device, what: str, advice: list[str]) -> None:
    """Raise a one-line ValueError, ending in `advice`, when `estimate` exceeds the memory `device` has
    for this rank (the least any rank has, so that all ranks decide alike)."""
    available = available_memory(device)
    available = agreed_minimum(available if available is not None else float("inf"))
    if estimate.total > available:
        raise ValueError(
            f"{what} needs {estimate.describe()} but {device.type} has {available / GIB:.1f} GiB "
            f"available per rank: {'; or '.join([*advice, 'pick a smaller model'])}"
        )


def split_advice(device: torch.device, script: str) -> str:
    """More ranks only help where each has its own memory (on CPU the ranks of a host share it)."""
    if device.type == "cpu":
        return "run on GPUs"
    return f"split the model over more GPUs (torchrun --nproc_per_node=N {script} parallel.tp=N)"


def check_training_fits(
    args: ModelArgs, dims: ParallelDims, training: TrainingConfig, sharded: bool, device: torch.device
) -> None:
    """train.py's check: `training` is the config's training group; `sharded`: the model is planned by
    parallelize_llama (tensor / context parallel, or FSDP2 asked for)."""
    activation_bytes = 2 if device.type == "cuda" and training.dtype == "bfloat16" else 4
    estimate = training_memory(
        args,
        dims,
        training.batch_size,
        training.seq_len,
        activation_bytes,
        training.activation_checkpointing,
        sharded,
        fused_loss=device.type == "cuda",
    )
    advice = [split_advice(device, "train.py")]
    if device.type == "cuda" and not sharded and dims.world > 1:
        advice.append("set parallel.fsdp=true to shard it over the data-parallel ranks")
    if estimate.parts["activations"] > estimate.total / 4:
        advice.insert(0, "lower training.batch_size (raise training.grad_accum to keep the batch)")
        if not training.activation_checkpointing:
            advice.insert(1, "set training.activation_checkpointing=true")
    check_fits(estimate, device, f"training model {args.name}", advice)


def check_serving_fits(
    args: ModelArgs,
    tp: int,
    dtype: str,
    batch: int,
    prompt_len: int,
    cache_len: int,
    device: torch.device,
    shrink: str,
) -> None:
    """serve.py's check, for `batch` sequences of `prompt_len` prompt tokens in a cache of `cache_len`;
    `shrink` is the advice that lowers those, in the caller's settings (a mode of serve.py sets only
    some of them)."""
    estimate = serving_memory(args, tp, dtype, batch, prompt_len, cache_len)
    advice = [split_advice(device, "serve.py")]
    if "KV cache" in estimate.parts:  # past loading, the cache and the prefill may be what is too large
        # Only advised where they are a fair share: beside weights that fill the device it cannot help.
        if estimate.parts["KV cache"] + estimate.parts["prefill"] > estimate.total / 4:
            advice.insert(0, shrink)
        if not args.fp8 and device.type == "cuda":
            advice.append("set model.fp8=true")
    check_fits(estimate, device, f"serving model {args.name}", advice)

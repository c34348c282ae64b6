"""parallelize_llama: apply tensor + sequence parallelism, Ulysses context parallelism, activation
checkpointing, torch.compile and FSDP2 to a plain model.Llama (TorchTitan's split of model and plan).

The plan works on a model still on the meta device (train.py, serve.py: each rank then materialises
only its shards with parallel/checkpoint.py's `materialize`, drawing the unsharded model's weights or
loading a checkpoint's), or on a materialised model holding the full (tp = 1) weights, identical on
every rank, of which it keeps each rank's slice (the tests compare it with the plain model). The
model code is untouched: the plan swaps modules (wq/wk/wv/w1/w3/output column-parallel, wo/w2
row-parallel, the embedding vocab-parallel, the norms sequence-parallel) and sets attributes
(Attention.project_qkv, attention_fn, the per-rank head counts). Parameter names, order and tying stay
those of the plain model, so a checkpoint (parallel/checkpoint.py gathers the full tensors) does not
depend on the layout it was saved from.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from model.llama import Llama, TransformerBlock
from parallel.comm import Comm, make_comm
from parallel.layers import (
    ColumnParallelLinear,
    ParallelFeedForward,
    ParallelQKV,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    TPContext,
    VocabParallelEmbedding,
    VocabParallelOutput,
)
from parallel.mesh import data_parallel_mesh, tensor_parallel_ops


@dataclass
class ParallelizeConfig:
    # torch | symm_mem | triton (parallel.comm).
    comm: str = "torch"
    # Training: shard the residual stream on the sequence between blocks. Decode: False (replicated
    # activations, all-reduce after row-parallel layers, full logits gathered for sampling).
    sequence_parallel: bool = True
    # Keep AG-matmul's gathered input for the weight gradient (False: re-gather in the backward).
    save_gathered: bool = True
    # Recompute each block in the backward (torch.utils.checkpoint, non-reentrant).
    activation_checkpointing: bool = False
    # torch.compile each block (in place: parameter names do not change).
    compile: bool = False
    # FSDP2 (fully_shard) over the data-parallel ranks (dp, and cp folded in) when there are several.
    # False leaves gradients unsynchronised over dp / cp: for decode, or a caller that syncs them.
    fsdp: bool = True
    # Under FSDP2, the dtype in which the blocks and an untied output projection gather their weights and
    # compute (train.py: the autocast dtype); None: the weights' own (float32).
    fsdp_param_dtype: torch.dtype | None = None


@dataclass
class ParallelState:
    """What the plan leaves on the model (`model.parallel`), for the loss, clipping and checkpoints."""

    mesh: DeviceMesh
    tp_ctx: TPContext | None
    # State-dict name -> the dimension its tensor-parallel shard splits (absent: replicated over tp).
    tp_shard_dims: dict[str, int] = field(default_factory=dict)
    # Group over which FSDP2 splits the parameters (dp, and cp; under HSDP one replica's ranks), None
    # for a single rank.
    dp_group: dist.ProcessGroup | None = None
    fsdp: bool = False

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.tp_ctx.comm.group if self.tp_ctx is not None else None

    @property
    def tp_rank(self) -> int:
        return self.tp_ctx.rank if self.tp_ctx is not None else 0

    @property
    def tp_size(self) -> int:
        return self.tp_ctx.size if self.tp_ctx is not None else 1


def _shard(param: nn.Parameter, dim: int, tp: int, rank: int) -> nn.Parameter:
    size = param.shape[dim] // tp
    return nn.Parameter(param.detach().narrow(dim, rank * size, size).clone(), param.requires_grad)


def apply_tensor_parallel(
    model: Llama, comm: Comm, cfg: ParallelizeConfig
) -> tuple[TPContext, dict[str, int]]:
    ctx = TPContext(comm, sequence_parallel=cfg.sequence_parallel, save_gathered=cfg.save_gathered)
    tp, rank = ctx.size, ctx.rank
    shard_dims: dict[str, int] = {}

    def column(module: nn.Linear | nn.Embedding, name: str) -> nn.Parameter:
        shard_dims[f"{name}.weight"] = 0
        return _shard(module.weight, 0, tp, rank)

    for i, block in enumerate(model.layers):
        prefix = f"layers.{i}"
        attn = block.attention
        for proj in ("wq", "wk", "wv"):
            setattr(
                attn,
                proj,
                ColumnParallelLinear(column(getattr(attn, proj), f"{prefix}.attention.{proj}"), ctx),
            )
        shard_dims[f"{prefix}.attention.wo.weight"] = 1
        attn.wo = RowParallelLinear(_shard(attn.wo.weight, 1, tp, rank), ctx)
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
        attn.project_qkv = ParallelQKV(attn, ctx)
        ff = block.feed_forward
        shard_dims[f"{prefix}.feed_forward.w2.weight"] = 1
        block.feed_forward = ParallelFeedForward(
            ColumnParallelLinear(column(ff.w1, f"{prefix}.feed_forward.w1"), ctx),
            RowParallelLinear(_shard(ff.w2.weight, 1, tp, rank), ctx),
            ColumnParallelLinear(column(ff.w3, f"{prefix}.feed_forward.w3"), ctx),
        )
        if cfg.sequence_parallel:
            block.attention_norm = SequenceParallelRMSNorm(block.attention_norm, ctx)
            block.ffn_norm = SequenceParallelRMSNorm(block.ffn_norm, ctx)
    if cfg.sequence_parallel:
        model.norm = SequenceParallelRMSNorm(model.norm, ctx)

    tied = model.args.tie_embeddings
    embedding = VocabParallelEmbedding(column(model.tok_embeddings, "tok_embeddings"), ctx)
    out_weight = embedding.weight if tied else column(model.output, "output")
    if tied:
        shard_dims["output.weight"] = 0
    model.tok_embeddings = embedding
    # Without sequence parallelism (decode) sampling needs the logits of the whole vocabulary.
    model.output = VocabParallelOutput(out_weight, ctx, gather_output=not cfg.sequence_parallel)
    return ctx, shard_dims


def apply_context_parallel(model: Llama, mesh: DeviceMesh, comm_path: str) -> None:
    """Ulysses attention over the cp group. Each cp rank is given the tokens of its sequence chunk
    (chunks in cp-rank order); a forward pre-hook supplies their positions for the rotary table."""
    from parallel.ulysses import ULYSSES_OPS, ulysses_attention

    group = mesh["cp"].get_group()
    cp_rank = mesh["cp"].get_local_rank()
    comm = make_comm(comm_path, group, require=ULYSSES_OPS)
    for block in model.layers:
        block.attention.attention_fn = ulysses_attention(block.attention.attention_fn, group, comm)

    def positions(module: nn.Module, args: tuple, kwargs: dict):
        tokens = args[0] if args else kwargs["tokens"]
        if len(args) > 1 or kwargs.get("input_pos") is not None:
            raise ValueError("context parallelism (parallel.cp > 1) serves training only; decode with cp=1")
        seq = tokens.shape[1]
        kwargs = {
            **kwargs,
            "input_pos": torch.arange(cp_rank * seq, (cp_rank + 1) * seq, device=tokens.device),
        }
        return args[:1], kwargs

    model.register_forward_pre_hook(positions, with_kwargs=True)


def _checkpointed_forward(block: TransformerBlock, *args, **kwargs):
    return checkpoint(TransformerBlock.forward, block, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: Llama) -> None:
    """Recompute each block in the backward (non-reentrant torch.utils.checkpoint); parameter names
    are unchanged (the block's forward is replaced, the module is not wrapped)."""
    for block in model.layers:
        block.forward = functools.partial(_checkpointed_forward, block)


def parallelize_llama(model: Llama, mesh: DeviceMesh, cfg: ParallelizeConfig | None = None) -> Llama:
    """Apply the layout of `mesh` (parallel/mesh.build_mesh's: dims "dp", "cp", "tp", or under HSDP
    "dp_replicate", "dp_shard", "cp", "tp") to `model` in place and return it. The model is on the meta
    device or holds its full weights (identical on every rank)."""
    cfg = cfg or ParallelizeConfig()
    tp, cp = mesh["tp"].size(), mesh["cp"].size()
    tp_ctx, shard_dims = None, {}
    if tp > 1:
        comm = make_comm(cfg.comm, mesh["tp"].get_group(), require=tensor_parallel_ops(cfg.sequence_parallel))
        tp_ctx, shard_dims = apply_tensor_parallel(model, comm, cfg)
    elif cfg.comm != "torch":
        make_comm(cfg.comm, mesh["tp"].get_group())  # device checks even when tp = 1
    if cp > 1:
        apply_context_parallel(model, mesh, cfg.comm)

    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.compile:
        for block in model.layers:
            block.compile()

    dp_mesh = data_parallel_mesh(mesh)
    use_fsdp = cfg.fsdp and dp_mesh.size() > 1
    if use_fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Gathered in bf16, a block's weights cross the links in half the bytes, and its matmuls save
        # those gathered weights, which FSDP2 frees after the block's forward and gathers again for its
        # backward; autocast's own bf16 copies of float32 weights lived, unsharded, from every block's
        # forward to its backward. Inputs are not cast: the residual stream stays float32, as in the
        # unsharded model under autocast. The embedding (and a tied output projection) stays float32.
        low = MixedPrecisionPolicy(
            param_dtype=cfg.fsdp_param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        for i, block in enumerate(model.layers):
            # The last block's parameters are needed again at once by the backward: keep them gathered.
            fully_shard(block, mesh=dp_mesh, mp_policy=low, reshard_after_forward=i < len(model.layers) - 1)
        if model.output.weight is not model.tok_embeddings.weight:
            fully_shard(model.output, mesh=dp_mesh, mp_policy=low, reshard_after_forward=False)
        fully_shard(model, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    shard_dim = dp_mesh.ndim - 1  # HSDP: its second dim
    model.parallel = ParallelState(
        mesh=mesh,
        tp_ctx=tp_ctx,
        tp_shard_dims=shard_dims,
        dp_group=dp_mesh.get_group(shard_dim) if dp_mesh.size(shard_dim) > 1 else None,
        fsdp=use_fsdp,
    )
    return model


def decode_hooks(model: Llama) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """model.decode.convert_for_decode's hooks for a model planned for tensor-parallel decode: the
    all-reduce of the row-parallel outputs and the all-gather of the vocabulary-sharded logits, as the
    registered ops of the tp comm path (capturable in CUDA graphs). None needed without tensor
    parallelism."""
    state: ParallelState | None = getattr(model, "parallel", None)
    if state is None or state.tp_ctx is None:
        return {}
    if state.tp_ctx.sequence_parallel:
        raise ValueError(
            "weft's decode kernels run on the decode plan: parallelize with sequence_parallel=False"
        )
    name = state.tp_ctx.comm.group_name
    return {
        "reduce": lambda x: torch.ops.weft.tp_all_reduce(x, name),
        "gather_logits": lambda x: torch.ops.weft.tp_all_gather(x, x.dim() - 1, name),
    }


def fp8_decode_hooks(model: Llama) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """model.fp8.convert_to_fp8's hooks: decode_hooks, and the per-channel amax of the row-parallel
    weights over the ranks (so that each shard is quantized as the unsplit weight is)."""
    hooks = decode_hooks(model)
    if not hooks:
        return {}
    group = model.parallel.tp_ctx.comm.group

    def channel_amax(amax: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # once, at conversion: no graph
        return amax

    return {**hooks, "channel_amax": channel_amax}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a parallelized model (tp shards counted once each, tp-replicated
    parameters once, FSDP shards summed over one replica's ranks) and return the norm before clipping.
    Like torch.nn.utils.clip_grad_norm_, with foreach kernels: a few launches and one read of each
    gradient, not a squared copy of it and four launches per parameter."""
    state: ParallelState | None = getattr(model, "parallel", None)
    params = [p for p in model.parameters() if p.grad is not None]
    if state is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    names = {id(p): n for n, p in model.named_parameters()}
    grads = [_local(p.grad) for p in params]
    device = grads[0].device if grads else torch.device("cpu")

    def squared_norm(group: list[torch.Tensor]) -> torch.Tensor:
        if not group:
            return torch.zeros((), device=device, dtype=torch.float32)
        return torch.stack(torch._foreach_norm(group)).float().pow(2).sum()

    in_shards = [names[id(p)] in state.tp_shard_dims for p in params]
    sharded = squared_norm([g for g, shard in zip(grads, in_shards, strict=True) if shard])
    replicated = squared_norm([g for g, shard in zip(grads, in_shards, strict=True) if not shard])
    if state.tp_group is not None:
        dist.all_reduce(sharded, group=state.tp_group)
    total = sharded + replicated
    if state.fsdp and state.dp_group is not None:
        dist.all_reduce(total, group=state.dp_group)
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for dtype in {g.dtype for g in grads}:
        torch._foreach_mul_([g for g in grads if g.dtype == dtype], scale.to(dtype))
    return norm

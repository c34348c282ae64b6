"""Checkpoints of a parallelized model in weft's one layout-free format.

Saving (and exporting a Hugging Face directory: export_parallel_hf) gathers every tensor to its full
(tp = 1, unsharded) shape, one at a time, each written into rank 0's file before the next is gathered
(neither a GPU nor rank 0's host memory holds more than one full tensor): FSDP shards with an all-gather
over dp, tensor-parallel shards with an all-gather over tp along the dimension the plan recorded. A
checkpoint written at tp = 2 therefore holds what one written at tp = 1 holds, and loads at any tp; so
do Hugging Face directories. Loading reads the full tensors on every rank, one at a time from the
memory-mapped files, and keeps each rank's slice: `materialize` (a model's first weights: serving,
train.py's init_from) and `load_parallel_checkpoint` (resuming training: weights and AdamW's moments).

Every rank must call these functions (they communicate); only rank 0 needs to write the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from model.checkpoint import (
    LazyTensors,
    TensorSpec,
    check_model_args,
    check_optimizer_state,
    checkpoint_meta,
    load_optimizer_state,
    open_checkpoint,
    optimizer_tensors,
    restore_schedule_and_rng,
    rng_tensors,
    state_mismatch,
    write_checkpoint,
    write_tensors,
)
from model.hf import MAX_SHARD_BYTES, WeightStream, export_hf
from model.tokenizer import Tokenizer
from parallel.comm import all_gather

if TYPE_CHECKING:  # parallel/parallelize.py imports this module
    from parallel.parallelize import ParallelState

_T = TypeVar("_T")


def _state(model: nn.Module) -> ParallelState | None:
    return getattr(model, "parallel", None)


def _unshard(t: torch.Tensor) -> torch.Tensor:
    """An FSDP DTensor at its full shape. FSDP2's layout (Shard(0) over a 1-D mesh, or over the second
    dim of HSDP's after Replicate; torch.chunk sizes, so only the last shards can be short) is gathered
    with the plain collectives: DTensor.full_tensor() runs functional collectives, which crash on gloo
    with CUDA tensors (torch 2.11), the backend of ranks sharing a GPU."""
    from torch.distributed.tensor import Replicate, Shard

    if tuple(t.placements) not in ((Shard(0),), (Replicate(), Shard(0))):
        return t.full_tensor()
    group = t.device_mesh.get_group(t.device_mesh.ndim - 1)
    local = t.to_local()
    rows = -(-t.shape[0] // dist.get_world_size(group))
    padded = local.new_zeros((rows, *local.shape[1:]))
    padded[: local.shape[0]].copy_(local)
    return all_gather(padded, 0, group)[: t.shape[0]]


def _full(t: torch.Tensor, name: str, state: ParallelState | None) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = _unshard(t)
    if state is not None and name in state.tp_shard_dims and state.tp_group is not None:
        t = all_gather(t.contiguous(), state.tp_shard_dims[name], state.tp_group)
    return t.detach()


def _slice(full: torch.Tensor, name: str, state: ParallelState | None) -> torch.Tensor:
    if state is not None and name in state.tp_shard_dims and state.tp_size > 1:
        dim = state.tp_shard_dims[name]
        size = full.shape[dim] // state.tp_size
        full = full.narrow(dim, state.tp_rank * size, size)
    return full


def _full_shape(t: torch.Tensor, name: str, state: ParallelState | None) -> tuple[int, ...]:
    """The unsharded shape of a model tensor: FSDP's global shape, times tp on the tp-sharded dim."""
    shape = list(t.shape)
    if state is not None and name in state.tp_shard_dims:
        shape[state.tp_shard_dims[name]] *= state.tp_size
    return tuple(shape)


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` (this rank's tp slice, unsharded over dp) into a parameter/state tensor, which may
    be an FSDP DTensor holding only this rank's dp shard."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=target.device, dtype=target.dtype)
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(full)


def _model_tensors(model: nn.Module) -> list[tuple[str, str | None, torch.Tensor]]:
    """What a checkpoint stores of a model, as (key, parameter name, tensor): its state dict without a
    tied output weight (model/checkpoint.py stores it once)."""
    args = getattr(model, "args", None)
    tied = args is not None and args.tie_embeddings
    return [
        (name, name, t) for name, t in model.state_dict().items() if not (tied and name == "output.weight")
    ]


def _optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[tuple[str, str | None, torch.Tensor]], dict[str, Any]]:
    """The optimizer's tensors as (key, the parameter name they shard like, or None for a scalar such as
    AdamW's step, tensor), and the plain values model/checkpoint.py keeps in meta.json."""
    tensors, meta = optimizer_tensors(optimizer.state_dict())
    names = _param_names(model, optimizer)
    items = [(key, names[int(key.split(".")[1])] if t.dim() > 0 else None, t) for key, t in tensors.items()]
    return items, meta


def _specs(
    items: list[tuple[str, str | None, torch.Tensor]], state: ParallelState | None
) -> list[TensorSpec]:
    return [
        TensorSpec(key, t.dtype, _full_shape(t, name, state) if name else tuple(t.shape))
        for key, name, t in items
    ]


def _gathered(
    items: list[tuple[str, str | None, torch.Tensor]],
    state: ParallelState | None,
    keep: bool,
    dtype: torch.dtype | None = None,
) -> Iterator[torch.Tensor | None]:
    """Each tensor at its full shape in turn (a collective: every rank, in the same order), cast to
    `dtype` where given (on its device: an export's bf16 crosses to the host at half fp32's bytes) and
    moved to the CPU before the next is gathered, so a GPU never holds more than one full tensor (and its
    cast copy); None where not `keep` (every rank but the writer takes part in the gathers and keeps
    nothing)."""
    for _, name, t in items:
        full = _full(t, name, state) if name else t.detach()
        out = full.to(dtype or full.dtype).to("cpu").contiguous() if keep else None
        del full  # let go on the GPU before the writer takes its time with `out`
        yield out
        del out  # not held while the next is gathered


def full_model_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor at its full shape, on the CPU (a tied output weight left
    out), gathered one tensor at a time (`keep=False`: gathered and dropped, an empty dict)."""
    items = _model_tensors(model)
    gathered = _gathered(items, _state(model), keep)
    return {key: t for (key, _, _), t in zip(items, gathered, strict=True) if t is not None}


@torch.no_grad()
def load_full_model_state(
    model: nn.Module, full: Mapping[str, torch.Tensor], source: str = "checkpoint"
) -> None:
    """Copy full-shape tensors into a parallelized model, each rank keeping its slice (from a file's
    LazyTensors, one full tensor read at a time)."""
    state = _state(model)
    targets = model.state_dict()
    args = getattr(model, "args", None)
    tied = args is not None and args.tie_embeddings
    expected = {k for k in targets if not (tied and k == "output.weight")}
    missing, unexpected = sorted(expected - set(full)), sorted(set(full) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not fit the model (missing: {', '.join(missing[:4]) or '-'}; "
            f"unexpected: {', '.join(unexpected[:4]) or '-'}): check the model preset"
        )
    # Every shape is checked before any tensor is read (a file's from its header).
    shapes = full.shapes if isinstance(full, LazyTensors) else {k: tuple(v.shape) for k, v in full.items()}
    for name in expected:
        want = _full_shape(targets[name], name, state)
        if shapes[name] != want:
            raise ValueError(f"{source}: {name} has shape {shapes[name]}, the model needs {want}")
    for name in expected:
        _copy_into(targets[name], _slice(full[name], name, state))


def _draw(
    target: torch.Tensor, name: str, state: ParallelState | None, init: Callable[[torch.Tensor], object]
) -> None:
    """Draw a weight by its initialiser: at its full (unsharded) shape on its device, this rank keeping
    its slice, so that every layout gets the unsharded model's weights; a plain model draws in place."""
    if state is None:
        init(target)
        return
    local = target.to_local() if hasattr(target, "to_local") else target
    full = local.new_empty(_full_shape(target, name, state))
    init(full)
    _copy_into(target, _slice(full, name, state))


@torch.no_grad()
def init_parallel_weights(model: nn.Module) -> None:
    """Llama.init_weights for a parallelized model (after `to_empty`): each weight is drawn at its full
    shape on the model's device, one tensor at a time and in model.llama.init_plan's order, and this
    rank keeps its slice. Every rank, and an unsharded model seeded alike on the same device, gets the
    same weights, while no rank ever holds more than one full tensor beyond its shards."""
    from model.llama import init_plan, rope_table

    state = _state(model)
    model.rope = rope_table(model.args, device=model.rope.device)
    if model.args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # to_empty() untied them
    for name, init in init_plan(model.args):
        _draw(model.get_parameter(name), name, state, init)


def _owner(name: str) -> str:
    """The module a weight is materialised with: its block ('layers.3') or a top-level module."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    checkpoint: Path | None = None,
    dtype: torch.dtype | None = None,
    block_done: Callable[[int], None] | None = None,
) -> None:
    """Storage and weights for a model built on the meta device, parallelized there or not: a
    checkpoint's weights (model/loading.py resolves the path; read one tensor at a time, each rank
    keeping its slices), or random ones drawn by model.llama.init_plan (a parallelized model keeps its
    slices of the unsharded model's). Each rank only ever holds its own shards plus one full tensor.

    With `block_done`, the model is materialised module by module in the plan's order (the embedding,
    each block, the final norm, the output projection) and `block_done(i)` is called once block i has
    its weights, before the next block gets storage: it may replace model.layers[i] (serve.py quantizes
    it to FP8), so that the whole model never exists in `dtype` at once. The random weights are the
    same either way (drawn in the same order on the same device)."""
    from model.llama import init_plan, rope_table
    from model.loading import open_weights

    state = _state(model)
    plan = init_plan(model.args)
    weights = None
    if checkpoint is not None:  # names and shapes checked before any memory is allocated
        weights = open_weights(checkpoint)
        expected = {name: _full_shape(model.get_parameter(name), name, state) for name, _ in plan}
        details = state_mismatch(expected, weights.shapes)
        if details is not None:
            raise ValueError(
                f"checkpoint {checkpoint} does not fit the model ({details}): check the model preset"
            )
    if dtype is not None:  # cast on the meta device: the weights are allocated in `dtype` directly
        model.to(dtype)
    if block_done is None:
        model.to_empty(device=device)
    model.rope = rope_table(model.args, device=device)
    by_owner: dict[str, list[tuple[str, Callable[[torch.Tensor], object]]]] = {}
    for name, init in plan:
        by_owner.setdefault(_owner(name), []).append((name, init))
    for owner, entries in by_owner.items():
        if block_done is not None:
            model.get_submodule(owner).to_empty(device=device)
        if owner == "tok_embeddings" and model.args.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight  # to_empty() gave each its own
        for name, init in entries:
            target = model.get_parameter(name)
            if weights is None:
                _draw(target, name, state, init)
            else:
                _copy_into(target, _slice(weights.read(name), name, state))
        if block_done is not None and owner.startswith("layers."):
            block_done(int(owner.removeprefix("layers.")))
    # (On the meta device itself, a dry run that builds the shapes only, everything stays meta.)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left and torch.device(device).type != "meta":
        raise RuntimeError(f"model.llama.init_plan gives no value to {', '.join(left[:4])}")


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """Optimizer state index -> parameter name (state_dict numbers parameters in group order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    index, out = 0, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            out[index] = names[id(p)]
            index += 1
    return out


def full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, keep: bool = True
) -> dict[str, Any]:
    """optimizer.state_dict() with every per-parameter tensor (AdamW's moments) at full shape, on the
    CPU, gathered one at a time as full_model_state's are (`keep=False`: gathered and dropped)."""
    items, meta = _optimizer_tensors(model, optimizer)
    gathered = _gathered(items, _state(model), keep)
    state: dict[int, dict[str, Any]] = {}
    for (key, _, _), t in zip(items, gathered, strict=True):
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = t
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]} if keep else {}


def is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _written_by_rank_0(write: Callable[[], _T], streams: list[Iterator[torch.Tensor | None]]) -> _T | None:
    """`write()` on rank 0 (which writes the tensors of `streams`, _gathered's, as they come); None
    elsewhere. Every rank then gathers whatever the streams have left (off rank 0, all of them), so that
    the collectives line up whether or not rank 0's write failed: a full disk raises on rank 0 once every
    tensor is gathered."""
    try:
        return write() if is_writer() else None
    finally:
        for stream in streams:
            for _ in stream:
                pass


def save_parallel_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    data_state: dict[str, Any] | None,
    keep: int,
    config: dict[str, Any] | None = None,
    hf_tokenizer: bool = False,
) -> Path | None:
    """model/checkpoint.save_checkpoint for a parallelized model, the same layout-free checkpoint:
    every rank gathers each tensor in turn (collective) and rank 0 writes it into its file as it comes,
    so that neither a GPU nor rank 0's host memory holds more than one full tensor. Returns the
    directory on rank 0, None elsewhere; rank 0's failed write (a full disk) raises CheckpointWriteError
    once every rank has gathered everything."""
    state, writer = _state(model), is_writer()
    optimizer_items, optimizer_meta = (
        _optimizer_tensors(model, optimizer) if optimizer is not None else ([], None)
    )
    rng = [(key, None, t) for key, t in rng_tensors().items()]
    files = {"model.safetensors": _model_tensors(model), "train_state.safetensors": rng + optimizer_items}
    streams = {file: (_specs(items, state), _gathered(items, state, writer)) for file, items in files.items()}

    def write() -> Path:
        def write_tensor_files(directory: Path) -> None:
            for file, (specs, tensors) in streams.items():
                write_tensors(directory / file, specs, tensors)

        meta = checkpoint_meta(step, model.args, scheduler, data_state, config, hf_tokenizer, optimizer_meta)
        return write_checkpoint(run_dir, step, write_tensor_files, meta, keep)

    return _written_by_rank_0(write, [tensors for _, tensors in streams.values()])


def export_parallel_hf(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path | None:
    """model/hf.export_hf for a parallelized model, the same directory: every rank gathers each weight
    in turn (collective) and rank 0 converts and writes it as it comes, so that neither a GPU nor rank
    0's host memory holds more than one full tensor (and its converted copy). Returns the directory on
    rank 0, None elsewhere; rank 0's failed write (a full disk) raises CheckpointWriteError once every
    rank has gathered everything, leaving `out_dir` as it was."""
    items, state = _model_tensors(model), _state(model)
    shapes = {spec.name: spec.shape for spec in _specs(items, state)}
    tensors = _gathered(items, state, is_writer(), dtype)
    weights = WeightStream(shapes, tensors)

    def write() -> Path:
        return export_hf(weights, model.args, out_dir, tokenizer, dtype, max_shard_bytes, overwrite)

    return _written_by_rank_0(write, [tensors])


def load_parallel_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """model/checkpoint.load_checkpoint for a parallelized model, with its checks: every file is opened
    before anything is restored, then each rank reads the full tensors one at a time from the
    memory-mapped files (whose pages the ranks of a node share) and keeps its slices."""
    path = Path(path)
    meta, weights, train = open_checkpoint(path)
    check_model_args(path, meta.get("model_args"), model)
    state = _state(model)
    if optimizer is not None:  # its one-line error before any weight is replaced
        names = _param_names(model, optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        shapes = [_full_shape(p, names[i], state) for i, p in enumerate(params)]
        keys = check_optimizer_state(path, optimizer, meta, train, full_shapes=shapes)
    load_full_model_state(model, weights, source=str(path))
    if optimizer is not None:

        def shard(index: int, full: torch.Tensor) -> torch.Tensor:
            target = torch.zeros_like(params[index])
            _copy_into(target, _slice(full, names[index], state))
            return target

        load_optimizer_state(optimizer, meta, train, keys, place=shard)
    restore_schedule_and_rng(meta, train, scheduler)
    return meta

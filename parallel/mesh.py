"""The (dp, cp, tp) device mesh and the checks that run before any work.

Ranks are laid out with tp innermost: the tp ranks of a group are consecutive global ranks (hence on
one node when the node's rank count is a multiple of tp), cp next, dp outermost (it may cross nodes).
dp is whatever the world leaves: world = dp * cp * tp. With dp_replicate > 1 (HSDP) dp splits into
dp_replicate replicas (outermost: across nodes) of dp / dp_replicate ranks that FSDP2 shards over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model.args import ModelArgs

if TYPE_CHECKING:
    from configs.schema import ParallelConfig
from parallel.comm import COMM_PATHS, SYMM_MEM_SHARED_GPU
from parallel.distributed import shared_gpu


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    cp: int
    tp: int
    comm: str = "torch"
    # Data-parallel replicas of the FSDP2-sharded model (HSDP); each shards over dp / dp_replicate ranks.
    dp_replicate: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def model_parallel(self) -> bool:
        """True when the model itself is split (tensor or context parallel)."""
        return self.tp * self.cp > 1


def parallel_dims(parallel: ParallelConfig, world: int) -> ParallelDims:
    """dp, cp, tp from the `parallel` config (tp, cp, comm, dp_replicate) and the world size; one-line
    errors."""
    tp, cp, comm = int(parallel.tp), int(parallel.cp), str(parallel.comm)
    replicas = int(parallel.dp_replicate)
    if tp < 1 or cp < 1 or replicas < 1:
        raise ValueError(
            f"parallel.tp={tp}, parallel.cp={cp} and parallel.dp_replicate={replicas} must be >= 1"
        )
    if world % (tp * cp) != 0:
        raise ValueError(
            f"world size {world} is not a multiple of parallel.tp * parallel.cp = {tp}*{cp}: "
            "change --nproc_per_node or the parallel degrees"
        )
    dp = world // (tp * cp)
    if dp % replicas != 0:
        raise ValueError(
            f"parallel.dp_replicate={replicas} does not divide the {dp} data-parallel ranks (world {world} / "
            f"(tp * cp = {tp}*{cp})): set it to the number of nodes, or a divisor of {dp}"
        )
    if comm not in COMM_PATHS:
        raise ValueError(f"parallel.comm={comm!r} is not one of {', '.join(COMM_PATHS)}")
    return ParallelDims(dp=dp, cp=cp, tp=tp, comm=comm, dp_replicate=replicas)


def validate_model(
    dims: ParallelDims, args: ModelArgs, seq_len: int | None = None, seq_key: str = "training.seq_len"
) -> None:
    """Raise a one-line ValueError when the model's shape is inconsistent or cannot be split this way.

    tp splits query heads, key/value heads, the MLP hidden size and the vocabulary; sequence
    parallelism (training, `seq_len` given, set by `seq_key`) splits the sequence over tp * cp. Ulysses
    (cp) then splits each tp rank's heads again (key/value heads may instead be replicated when there
    are fewer than cp of them). Weights loaded from a checkpoint fix the model's shape, so each message
    names the parallel degree to change first."""
    args.validate()
    tp, cp = dims.tp, dims.cp

    def indivisible(key: str, value: int, by: str, change: str, product: int) -> str:
        return (
            f"{key}={value} is not divisible by {by}: choose {change} dividing {value} (or, for a model not "
            f"loaded from weights, a {key} that {product} divides)"
        )

    checks = [
        (
            args.n_heads % tp == 0,
            indivisible("model.n_heads", args.n_heads, f"parallel.tp={tp}", "a parallel.tp", tp),
        ),
        (
            args.n_kv_heads % tp == 0,
            indivisible("model.n_kv_heads", args.n_kv_heads, f"parallel.tp={tp}", "a parallel.tp", tp),
        ),
        (
            args.ffn_hidden % tp == 0,
            indivisible("model.ffn_hidden", args.ffn_hidden, f"parallel.tp={tp}", "a parallel.tp", tp),
        ),
        (
            args.vocab_size % tp == 0,
            indivisible("model.vocab_size", args.vocab_size, f"parallel.tp={tp}", "a parallel.tp", tp),
        ),
    ]
    if cp > 1:
        kv = args.n_kv_heads // tp
        checks += [
            (
                args.n_heads % (tp * cp) == 0,
                indivisible(
                    "model.n_heads",
                    args.n_heads,
                    f"parallel.tp*parallel.cp={tp}*{cp}",
                    "a parallel.tp and parallel.cp with a product",
                    tp * cp,
                ),
            ),
            (
                kv % cp == 0 or cp % max(kv, 1) == 0,
                f"model.n_kv_heads={args.n_kv_heads} over parallel.tp={tp} leaves {kv} key/value heads per "
                f"tp rank, which neither divide nor are divisible by parallel.cp={cp}: choose a "
                f"parallel.cp that divides {kv} or is a multiple of it",
            ),
        ]
    if seq_len is not None:
        checks.append(
            (
                seq_len % (tp * cp) == 0,
                f"{seq_key}={seq_len} is not divisible by parallel.tp*parallel.cp={tp}*{cp}: set "
                f"{seq_key} to a multiple of {tp * cp}",
            )
        )
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def validate_device(dims: ParallelDims, device: torch.device) -> None:
    """The comm path must run on this device, and symmetric memory needs the tp (and cp) group on one
    node: checked from torchrun's LOCAL_WORLD_SIZE here; SymmMemComm checks host names and peer
    access again when its group is built. Ranks sharing a GPU run weft's kernels, not PyTorch's."""
    if dims.comm == "torch":
        return
    if device.type != "cuda":
        raise ValueError(
            f"parallel.comm={dims.comm} needs CUDA GPUs; on {device.type} use parallel.comm=torch"
        )
    if dims.comm == "symm_mem" and shared_gpu():
        raise ValueError(SYMM_MEM_SHARED_GPU)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(dims.world)))
    span = dims.tp * dims.cp if dims.cp > 1 else dims.tp
    if local % span != 0:
        raise ValueError(
            f"parallel.comm={dims.comm} needs each tp{'*cp' if dims.cp > 1 else ''} group ({span} ranks) "
            f"on one node, but a node runs {local} ranks: use parallel.comm=torch or fewer ranks per group"
        )


def validate_decode_graphs(dims: ParallelDims, cuda_graphs: bool) -> None:
    """A CUDA graph of the decode step captures its collectives: NCCL's or weft's kernels, not gloo's,
    which is what the stock path has when ranks share a GPU."""
    if cuda_graphs and dims.tp > 1 and dims.comm == "torch" and shared_gpu():
        raise ValueError(
            "cuda_graphs=true with ranks sharing a GPU needs parallel.comm=triton: the stock collectives "
            "run on gloo there, which CUDA graphs cannot capture (or set cuda_graphs=false)"
        )


def tensor_parallel_ops(sequence_parallel: bool) -> list[str]:
    """The dispatched ops tensor parallelism calls: AG-matmul, matmul-RS and the all-reduce (the
    weight gradients of the sequence-parallel norms) in training, the all-reduce in decode."""
    if sequence_parallel:
        return ["all_gather_matmul", "matmul_reduce_scatter", "all_reduce"]
    return ["all_reduce"]


def validate_comm_ops(dims: ParallelDims, training: bool) -> None:
    """The comm path must implement every op the layout calls (triton: its kernels must exist):
    training with tp > 1 calls AG-matmul, matmul-RS and the all-reduce, decode with tp > 1 the
    all-reduce, Ulysses (cp > 1) the all-to-alls seq_to_heads and heads_to_seq."""
    from parallel.comm import check_ops
    from parallel.ulysses import ULYSSES_OPS

    if dims.tp > 1:
        check_ops(dims.comm, tensor_parallel_ops(sequence_parallel=training))
    if dims.cp > 1 and training:
        check_ops(dims.comm, ULYSSES_OPS)


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The global DeviceMesh of shape (dp, cp, tp), dims named "dp", "cp", "tp". Under HSDP its dims are
    "dp_replicate", "dp_shard", "cp", "tp" (data_parallel_rank: a rank's index among the dp ranks)."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs an initialised process group (torchrun)")
    if dist.get_world_size() != dims.world:
        raise ValueError(f"world size {dist.get_world_size()} != dp*cp*tp = {dims.dp}*{dims.cp}*{dims.tp}")
    if dims.dp_replicate == 1:
        return init_device_mesh(device_type, (dims.dp, dims.cp, dims.tp), mesh_dim_names=("dp", "cp", "tp"))
    return init_device_mesh(
        device_type,
        (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
        mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"),
    )


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the dp ranks (which slice of the batch it trains on). Under HSDP the
    replicas are outermost; torch deprecates slicing a flattened "dp" dim from the root mesh, so the
    index is computed from the two dims."""
    if "dp_replicate" not in (mesh.mesh_dim_names or ()):
        return mesh["dp"].get_local_rank()
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's mesh: the ranks holding different data for the same model shard, dp, and cp too
    (Ulysses ranks see different tokens, so their gradients are averaged like data parallel ones). Under
    HSDP a 2-D mesh: the replicas, then the ranks sharding one replica (dp_shard, and cp)."""
    if "dp_replicate" not in (mesh.mesh_dim_names or ()):
        if mesh["cp"].size() == 1:
            return mesh["dp"]
        return mesh["dp", "cp"]._flatten("dp_cp")
    if mesh["cp"].size() == 1:
        return mesh["dp_replicate", "dp_shard"]
    # torch deprecates slicing a flattened dim out of the root mesh: flatten the three data dims
    # (consecutive, replicas outermost) and split them again as (replicas, the rest).
    data = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_all")
    replicas = mesh["dp_replicate"].size()
    return data._unflatten(0, (replicas, data.size() // replicas), ("dp_replicate", "dp_shard_cp"))

"""Process-group start-up shared by train.py and serve.py.

The group is created before Hydra composes the config, so that every rank can agree on one run
directory (rank 0's launch time, broadcast) and only rank 0 writes Hydra's logs and config copies.
"""

from __future__ import annotations

import datetime as dt
import os

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def init_distributed() -> None:
    """Join the torchrun group if launched by torchrun (WORLD_SIZE > 1): gloo for CPU tensors and,
    where GPUs exist, NCCL for CUDA tensors, each rank on the GPU of its LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", device_id=torch.device("cuda", local_rank))
    else:
        # More ranks per node than GPUs (or none): CPU only, on every rank alike.
        dist.init_process_group(backend="gloo")


def agreed_launch_time() -> dt.datetime:
    """Rank 0's clock, the same on every rank (names the run directory)."""
    stamp = torch.tensor([dt.datetime.now().timestamp()], dtype=torch.float64)
    if dist.is_initialized():
        dist.broadcast(stamp, src=0)
    return dt.datetime.fromtimestamp(stamp.item())


def hydra_overrides_for_rank() -> list[str]:
    """Extra Hydra overrides: ranks other than 0 write no log file and no config copy."""
    if rank() == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def validate_parallel(parallel, world: int, device: torch.device):
    """Fail before any work when the parallel layout cannot run on this world and device; returns
    the layout (parallel/mesh.py's ParallelDims: dp inferred). The model's shape is checked by
    parallel.mesh.validate_model once it is known."""
    from parallel.mesh import parallel_dims, validate_device

    dims = parallel_dims(parallel, world)
    validate_device(dims, device)
    return dims

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


def validate_parallel(parallel, world: int, device: torch.device) -> None:
    """Fail before any work when the parallel layout cannot run this model on this world."""
    tp, cp = parallel.tp, parallel.cp
    if tp < 1 or cp < 1:
        raise ValueError(f"parallel.tp={tp} and parallel.cp={cp} must be >= 1")
    if world % (tp * cp) != 0:
        raise ValueError(
            f"world size {world} is not a multiple of parallel.tp * parallel.cp = {tp * cp}: "
            "change --nproc_per_node or the parallel degrees"
        )
    if parallel.comm not in ("torch", "symm_mem", "triton"):
        raise ValueError(f"parallel.comm={parallel.comm!r} is not one of torch, symm_mem, triton")
    if parallel.comm != "torch" and device.type != "cuda":
        raise ValueError(
            f"parallel.comm={parallel.comm} needs CUDA GPUs; on {device.type} use parallel.comm=torch"
        )
    if tp * cp > 1:
        raise ValueError(
            f"parallel.tp={tp} parallel.cp={cp}: this build trains with data parallelism only; "
            "set parallel.tp=1 parallel.cp=1"
        )

"""Process-group start-up and each rank's device, shared by train.py and serve.py.

The group is created before Hydra composes the config, so that every rank can agree on one run
directory (rank 0's launch time, broadcast) and only rank 0 writes Hydra's logs and config copies.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from configs.schema import ParallelConfig
    from parallel.mesh import ParallelDims

# Seconds a failing rank waits, without the GIL, before destroying its group (`shutdown_after`).
WORKERS_SETTLE_S = 0.1


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def resolve_device(name: str) -> torch.device:
    """auto | cpu | cuda -> this rank's device (under torchrun, the GPU parallel.distributed gave it)."""
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={name!r} is not one of auto, cpu, cuda")
    has_gpu = torch.cuda.is_available()
    if name == "auto":
        name = "cuda" if has_gpu else "cpu"
    if name == "cuda" and not has_gpu:
        raise ValueError("device=cuda but no CUDA GPU is visible: use device=cpu")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def gpu_of_rank(local_rank: int, local_world: int, gpus: int) -> int:
    """The GPU of a local rank: its own while the node has a GPU per rank; with more ranks than GPUs
    (shared-GPU mode, to test multi-rank kernels on one GPU) consecutive ranks share one."""
    return local_rank if local_world <= gpus else local_rank * gpus // local_world


def init_process_group(rank: int, world: int, local_rank: int, local_world: int) -> None:
    """This rank's process group and device: gloo for CPU tensors and, where GPUs exist, the rank on
    its GPU (`gpu_of_rank`) with NCCL for CUDA tensors; NCCL refuses two ranks on one GPU, so in
    shared-GPU mode gloo serves the CUDA tensors too (it runs every collective weft calls on them)."""
    gpus = torch.cuda.device_count()
    if gpus == 0:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return
    device = torch.device("cuda", gpu_of_rank(local_rank, local_world, gpus))
    torch.cuda.set_device(device)
    if local_world <= gpus:
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world, device_id=device)
    else:
        # No device_id: with it, DeviceMesh splits the group, which fails on gloo (torch 2.11).
        dist.init_process_group("gloo", rank=rank, world_size=world)


def shared_gpu() -> bool:
    """True when this node runs more ranks than it has GPUs (set by torchrun's LOCAL_WORLD_SIZE)."""
    gpus = torch.cuda.device_count()
    return 0 < gpus < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


TORCHRUN_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed() -> None:
    """Join the torchrun group if launched by torchrun (WORLD_SIZE > 1): see `init_process_group`.
    ValueError where WORLD_SIZE is set without the rest of torchrun's variables (a shell's leftover)."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit():
        raise ValueError(
            f"WORLD_SIZE={world!r} is not a number of processes: launch with torchrun, or unset it"
        )
    if int(world) <= 1 or dist.is_initialized():
        return
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
            "launch with torchrun (torchrun --nproc_per_node=N ...), or unset WORLD_SIZE"
        )
    init_process_group(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )


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


# Module registries holding process groups or symmetric buffers (each module is looked at only where
# it was loaded: importing the kernels costs seconds).
_REGISTRIES = (
    ("parallel.comm", ("_BY_GROUP",)),
    ("kernels.ag_matmul", ("_PLANS",)),
    ("kernels.custom_all_reduce", ("_REGISTRY",)),
    ("kernels.matmul_rs", ("_STATES",)),
    ("kernels.symm_mem", ("_CACHE", "_CHECKED")),
)


def release_groups() -> None:
    """Drop every registry entry that holds a process group or a symmetric buffer. A group still
    referenced when `destroy_process_group` runs is destroyed at interpreter exit instead, where gloo's
    threads can abort the process; and with ranks sharing a GPU, a rank's buffer must outlive its
    peers' CUDA IPC mappings of it, so on success every rank releases, then all meet (`leave`)."""
    for module, names in _REGISTRIES:
        loaded = sys.modules.get(module)
        for name in names if loaded is not None else ():
            getattr(loaded, name).clear()
    gc.collect()


def leave() -> None:
    """The way out of a run that succeeded on every rank: release, meet, destroy the group."""
    if dist.is_initialized():
        release_groups()
        dist.barrier()
    shutdown()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown_after(error: BaseException) -> None:
    """The way out of a run that failed or was stopped on this rank (no meeting: the peers may be gone).
    The failed run's frames, which the error's traceback holds, keep its model, and DDP's reducer in it
    keeps the group alive past destroy_process_group: destroyed only at interpreter exit, gloo's worker
    thread, still releasing a finished collective's tensors, waits for the GIL while the exiting thread
    holds it to join that worker, and the rank hangs (seen on CPU after a non-finite loss, about 1 exit
    in 8). So the frames are cleared and collected, the workers get a moment without the GIL, and the
    group is destroyed here."""
    traceback.clear_frames(error.__traceback__)
    gc.collect()
    time.sleep(WORKERS_SETTLE_S)
    shutdown()


def print_error_once(message: str, wait_s: float = 10.0) -> None:
    """Print a user error to stderr once for all ranks, before leaving the group. Every rank usually meets
    the same error at the same point: rank 0 prints it and says so in the group's store, and the others
    wait for that word before exiting (torchrun stops the ranks left once one exits, rank 0 included).
    A rank that hears nothing within `wait_s` met an error of its own and prints it, naming itself."""
    if not dist.is_initialized():
        print(message, file=sys.stderr, flush=True)
        return
    store = dist.distributed_c10d._get_default_store()
    if rank() == 0:
        print(message, file=sys.stderr, flush=True)
        store.set("weft_error_printed", "1")
        return
    try:
        store.wait(["weft_error_printed"], dt.timedelta(seconds=wait_s))
    except dist.DistStoreError:
        print(f"[rank {rank()}] {message}", file=sys.stderr, flush=True)


def validate_parallel(parallel: ParallelConfig, world: int, device: torch.device) -> ParallelDims:
    """Fail before any work when the parallel layout cannot run on this world and device; returns
    the layout (parallel/mesh.py's ParallelDims: dp inferred). The model's shape is checked by
    parallel.mesh.validate_model once it is known."""
    from parallel.mesh import parallel_dims, validate_device

    dims = parallel_dims(parallel, world)
    validate_device(dims, device)
    return dims

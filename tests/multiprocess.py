"""Run a test body on several processes, one rank each: gloo on CPU, or NCCL with one GPU per rank.

    run_ranks(body, world, *args)               # body(rank, world, *args), gloo
    run_ranks(body, world, *args, backend="nccl")   # rank r on cuda:r (gloo beside it for CPU tensors)

    @pytest.mark.parametrize("world", GPU_WORLDS)   # 2, 4 and 8 GPUs, each skipped where too few exist

A failure on any rank fails the test with every failing rank's traceback. Teardown matters: weft keeps
per-group state in module registries (the comm paths, the custom all-reduce objects, symmetric
buffers), and a process group still referenced there when `destroy_process_group` runs is destroyed
at interpreter exit instead, where gloo's worker threads can abort the process ("terminate called
without an active exception"). `close_group` clears those registries first.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# The world sizes of the multi-GPU tests; each runs only where that many GPUs are visible.
GPU_WORLDS = [pytest.param(w, marks=pytest.mark.multigpu(n=w)) for w in (2, 4, 8)]
# The bounded wait of the GPU timeout tests. Triton compiles a kernel again when an integer argument
# changes type: 3 s is, like the default 30 s, an int64 of nanoseconds (0.5 s would be an int32), so the
# present ranks run the kernels compiled by earlier calls and none waits on a peer still compiling.
TIMEOUT_TEST_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close_group() -> None:
    """Drop every registry entry that holds a process group, then destroy the default group."""
    for module, names in (
        ("parallel.comm", ("_BY_GROUP",)),
        ("kernels.custom_all_reduce", ("_REGISTRY",)),
        ("kernels.symm_mem", ("_CACHE", "_CHECKED")),
    ):
        loaded = sys.modules.get(module)  # only what the body imported: importing costs seconds
        for name in names if loaded is not None else ():
            getattr(loaded, name).clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, backend: str, body: Callable, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    torch.set_num_threads(1)
    try:
        body(rank, world, *args)
        # Only after success: a rank whose peer failed mid-collective would wait here forever.
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        close_group()


def run_ranks(body: Callable, world: int, *args, backend: str = "gloo") -> None:
    """Run `body(rank, world, *args)` on `world` fresh processes inside an initialised default group."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry,
            args=(world, free_port(), backend, body, args, errors),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    except Exception:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("\n".join(messages) or "a rank failed without a traceback") from None

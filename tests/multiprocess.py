"""Run a test body on several processes, one rank each: gloo on CPU, or on GPUs.

    run_ranks(body, world, *args)               # body(rank, world, *args), gloo
    run_ranks(body, world, *args, backend="nccl")   # each rank on its GPU (parallel.distributed decides)

    @pytest.mark.parametrize("world", GPU_WORLDS)   # 2, 4 and 8 ranks, each skipped where they cannot run

On GPUs a rank gets the device `parallel.distributed.init_process_group` gives it (a body uses
`torch.cuda.current_device()`): one GPU per rank with NCCL where there are enough, otherwise ranks
share GPUs on gloo (shared-GPU mode: start pytest through `python -m parallel.shared_gpu`, which
says how many ranks may share the GPUs). A failure on any rank fails the test with every failing
rank's traceback; teardown releases weft's registries first (`parallel.distributed.release_groups`).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel import distributed

# The world sizes of the multi-GPU tests; each runs only where that many ranks can run (tests/conftest.py).
GPU_WORLDS = [pytest.param(w, marks=pytest.mark.multigpu(n=w)) for w in (2, 4, 8)]
# The bounded wait of the GPU timeout tests. Triton compiles a kernel again when an integer argument
# changes type: 3 s is, like the default 30 s, an int64 of nanoseconds (0.5 s would be an int32), so the
# present ranks run the kernels compiled by earlier calls and none waits on a peer still compiling.
TIMEOUT_TEST_S = 3.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_gpu() -> torch.device:
    """This rank's GPU: its own, or the one it shares with other ranks."""
    return torch.device("cuda", torch.cuda.current_device())


def _entry(rank: int, world: int, port: int, backend: str, body: Callable, args: tuple, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    if backend == "nccl":
        distributed.init_process_group(rank, world, rank, world)
    else:
        dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        body(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}: {traceback.format_exc()}")
        distributed.release_groups()
        distributed.shutdown()  # no meeting: a rank whose peer failed mid-collective would wait forever
        raise
    distributed.leave()


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

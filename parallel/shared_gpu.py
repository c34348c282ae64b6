"""Run W ranks on one GPU (or on fewer GPUs than ranks), to test and develop weft's multi-rank
kernels without a node:

    python -m parallel.shared_gpu --ranks 4 train.py parallel.tp=2 parallel.cp=2 parallel.comm=triton
    python -m parallel.shared_gpu --ranks 2 serve.py parallel.tp=2 parallel.comm=triton model.fp8=true
    python -m parallel.shared_gpu --ranks 4 -- python -m pytest -m multigpu

A `.py` script runs under torchrun with W ranks on this node. Any other command (after `--`) runs as
given, with WEFT_SHARED_GPU_RANKS=W telling the tests how many ranks may share the GPUs
(tests/multiprocess.py spawns them).

What it arranges:
- MPS. Without it the GPU time-slices between processes and every cross-rank barrier costs
  milliseconds to half a second; under the MPS daemon the ranks' kernels run side by side. It starts
  the daemon (with its own pipe and log directories) when `nvidia-cuda-mps-control` exists and none
  runs, and stops it afterwards.
- An SM share per rank (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / ranks per GPU). weft's persistent
  kernels size their grids from the SMs a rank sees and spin on their peers' flags: a grid that took
  every SM would keep a peer's grid from starting, and the spin would end only at its timeout.

The ranks then use gloo for the stock collectives (NCCL refuses two ranks on one GPU) and map their
symmetric buffers with CUDA IPC (kernels/symm_mem.py). Timings taken this way say nothing about
NVLink: they are no communication figures.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

RANKS_ENV = "WEFT_SHARED_GPU_RANKS"
MPS_CONTROL = "nvidia-cuda-mps-control"


def shared_gpu_ranks() -> int:
    """How many ranks the launcher lets share this machine's GPUs (0 outside it)."""
    return int(os.environ.get(RANKS_ENV, "0"))


def sm_percentage(ranks: int, gpus: int) -> int:
    """Each rank's share of its GPU's SMs, in percent: the GPU split evenly among its ranks."""
    return 100 // math.ceil(ranks / gpus)


def command_for(ranks: int, command: list[str]) -> list[str]:
    """The command to run: a `.py` script under torchrun with `ranks` ranks, anything else as given."""
    if not command:
        raise ValueError("give a script (train.py ...) or a command after -- (-- python -m pytest ...)")
    if command[0].endswith(".py"):
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            *command,
        ]
    return command


def check_layout(ranks: int, gpus: int) -> None:
    """One-line errors for a layout with nothing to share or nothing to share it on."""
    if gpus < 1:
        raise ValueError("no CUDA GPU is visible: ranks sharing a GPU need one (on CPU, torchrun uses gloo)")
    if ranks <= gpus:
        raise ValueError(
            f"--ranks {ranks} on {gpus} GPUs: every rank has a GPU of its own, nothing to share; "
            f"run torchrun --nproc_per_node={ranks} directly"
        )


def _mps_running(pipe_dir: Path) -> bool:
    pid_file = pipe_dir / f"{MPS_CONTROL}.pid"
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


@contextlib.contextmanager
def mps_daemon(env: dict[str, str]) -> Iterator[str]:
    """Run the MPS daemon for the duration, unless one already runs (then use it) or MPS is missing.
    Updates `env` with the daemon's pipe directory; yields a line saying what was done."""
    pipe_dir = Path(env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if _mps_running(pipe_dir):
        yield f"MPS already runs (pipe directory {pipe_dir})"
        return
    if shutil.which(MPS_CONTROL) is None:
        yield f"no MPS ({MPS_CONTROL} not found): the ranks time-slice the GPU, cross-rank waits are slow"
        return
    home = Path(tempfile.mkdtemp(prefix="weft-mps-"))
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(home / "pipe")
    env["CUDA_MPS_LOG_DIRECTORY"] = str(home / "log")
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        Path(env[key]).mkdir()
    started = subprocess.run([MPS_CONTROL, "-d"], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
            del env[key]
        why = (started.stderr or started.stdout).strip() or f"exit status {started.returncode}"
        yield f"MPS did not start ({why}): the ranks time-slice the GPU, cross-rank waits are slow"
        return
    try:
        yield f"started the MPS daemon (pipe directory {env['CUDA_MPS_PIPE_DIRECTORY']})"
    finally:
        subprocess.run([MPS_CONTROL], input="quit\n", env=env, capture_output=True, text=True)
        shutil.rmtree(home, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m parallel.shared_gpu",
        description="Run several ranks on one GPU (MPS, an SM share per rank, torchrun for .py scripts).",
    )
    parser.add_argument("--ranks", type=int, required=True, help="number of ranks (processes)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="script.py [overrides] | -- command ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        command = command_for(args.ranks, command)
    except ValueError as err:
        parser.error(str(err))
    env = dict(os.environ)
    with mps_daemon(env) as what:
        import torch  # counted once the daemon runs: nothing here touches CUDA before MPS is up

        gpus = torch.cuda.device_count()
        try:
            check_layout(args.ranks, gpus)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        share = sm_percentage(args.ranks, gpus)
        env.update({RANKS_ENV: str(args.ranks), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)})
        print(
            f"shared_gpu: {args.ranks} ranks on {gpus} GPU(s), {share}% of the SMs each; {what}", flush=True
        )
        return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())

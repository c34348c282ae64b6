"""What a run directory records about its launches, and what a resume may change.

Each launch's config is kept by Hydra under <run dir>/launches/<launch time>/ (config.yaml, the
overrides, Hydra's settings), and each checkpoint's meta.json holds the config of the run that wrote
it, so nothing that describes a checkpoint is ever overwritten. A launch that fails before its first
step leaves nothing behind: its record and the files it wrote are removed, and so is a run directory
left empty.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from configs.validate import override_key
from model.checkpoint import list_checkpoints
from model.tokenizer import HF_TOKENIZER_FILES
from parallel import distributed

# Values that define the learning-rate schedule and the optimizer's hyper-parameters: a checkpoint's
# optimizer state was built with them, so a resume that changes them must be asked for
# (training.allow_schedule_change=true).
SCHEDULE_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "beta1", "beta2")
# Values that change what the next steps compute without breaking the saved state: a resume says so.
RECIPE_KEYS = (
    *(f"training.{k}" for k in ("batch_size", "seq_len", "grad_accum", "grad_clip", "seed", "dtype")),
    "data.path",
    "data.jsonl_field",
)
# Held by the launch training in a run directory (`run_directory_lock`).
LOCK_FILE = ".lock"
# What weft writes in a run directory before any step is trained.
PRE_TRAINING_FILES = ("train.log", "metrics.jsonl", "tensorboard", "launches", LOCK_FILE, *HF_TOKENIZER_FILES)


def _value(config: Any, dotted: str) -> Any:
    """config["a"]["b"] for "a.b"; None where absent."""
    for part in dotted.split("."):
        if not isinstance(config, dict):
            return None
        config = config.get(part)
    return config


def resume_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(schedule changes, other changes) between the config a checkpoint was saved with and the one
    resuming it, each as 'training.lr 0.003 -> 0.001'; nothing when the checkpoint records no config."""
    if saved is None:
        return [], []

    def changed(keys: tuple[str, ...]) -> list[str]:
        return [
            f"{key} {_value(saved, key)} -> {_value(current, key)}"
            for key in keys
            if _value(saved, key) != _value(current, key)
        ]

    return changed(tuple(f"training.{k}" for k in SCHEDULE_KEYS)), changed(RECIPE_KEYS)


def data_parallel_change(saved: dict[str, Any] | None, data: dict[str, Any], ranks: int) -> list[str]:
    """'data-parallel ranks 2 -> 1' when a resume runs over another number of data-parallel ranks than
    the checkpoint's (its data position's windows per step over its training.batch_size): no config
    value holds it, yet it changes the batch every step trains on."""
    batch, per_step = _value(saved, "training.batch_size"), data.get("windows_per_step")
    if not batch or per_step is None or per_step // batch == ranks:
        return []
    return [f"data-parallel ranks {per_step // batch} -> {ranks}"]


def data_windows_change(
    saved: dict[str, Any] | None, current: dict[str, Any], data: dict[str, Any], windows: int
) -> list[str]:
    """'data windows 10 -> 11 (the corpus changed: this epoch's order is a new one)' when the
    checkpoint's data position was taken in an epoch of another number of windows than this launch's
    `windows`: the resume goes as many windows into an order drawn anew, so that some of the epoch's
    windows come twice and others not at all. Nothing for a checkpoint that records no windows (saved
    before weft recorded them)."""
    before = data.get("windows")
    if before is None or before == windows:
        return []
    seq_len = "training.seq_len"
    new_seq_len = saved is not None and _value(saved, seq_len) != _value(current, seq_len)
    cause = f"{seq_len} changed" if new_seq_len else "the corpus changed"
    return [f"data windows {before} -> {windows} ({cause}: this epoch's order is a new one)"]


def shown(path: Path) -> str:
    """A path as a user would type it: relative to the working directory when inside it (symbolic links
    kept: a virtual environment's python is one)."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(Path.cwd()))
    except ValueError:
        return str(absolute)


def resume_command(run_dir: Path, step: int, sweep_job: Sequence[str] | None = None) -> str:
    """The command line that resumes this run from its checkpoint of `step`: this launch's own, pinned to
    its run directory, less a training.stop_at it has reached (a resume refuses one). For a job of a
    multirun sweep, `sweep_job` (the job's own overrides): the sweep's command line would start a new
    sweep, every job from step 0, in a new sweep directory."""
    args = sys.argv[1:] if sweep_job is None else sweep_job
    overrides = [arg for arg in args if override_key(arg) != "hydra.run.dir" and not _reached_stop(arg, step)]
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world > 1:
        nodes = [f"--nnodes={world // local}"] if world != local else []
        launcher = ["torchrun", *nodes, f"--nproc_per_node={local}"]
    else:
        launcher = [shown(Path(sys.executable))]
    return shlex.join([*launcher, sys.argv[0], *overrides, f"hydra.run.dir={hydra_value(shown(run_dir))}"])


def _reached_stop(override: str, step: int) -> bool:
    """Whether `override` (`training.stop_at=`, `+` / `++` forms, or `~training.stop_at`) sets a
    training.stop_at at or before `step`, to null, or deletes it."""
    value = override.partition("=")[2]
    return override_key(override) == "training.stop_at" and not (value.isdigit() and int(value) > step)


def hydra_value(text: str) -> str:
    """`text` as an override's value that Hydra reads back as this string: in Hydra's single quotes
    where it has characters Hydra parses otherwise (spaces, non-ASCII letters, brackets, commas)."""
    try:
        if OverridesParser.create().parse_override(f"key={text}").value() == text:
            return text
    except HydraException:  # (what it says of a non-ASCII letter)
        pass
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


class RunDirectoryInUse(ValueError):
    """Another launch holds the run directory."""


@contextmanager
def run_directory_lock(run_dir: Path) -> Iterator[None]:
    """Hold the run directory for this launch: another launch into it meanwhile is refused
    (RunDirectoryInUse) rather than both training, each resuming from and pruning the other's
    checkpoints. Rank 0 holds an flock on <run dir>/.lock (released however the process ends) and every
    rank learns the answer; a file system without flock goes unguarded."""
    handle, busy = None, False
    if distributed.rank() == 0:
        handle = open(run_dir / LOCK_FILE, "a")  # noqa: SIM115 (closed below)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = True
        except OSError:
            pass
    if dist.is_initialized():
        flag = torch.tensor([int(busy)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        busy = bool(flag.item())
    try:
        if busy:
            raise RunDirectoryInUse(
                f"{shown(run_dir)} is in use by another launch training there: wait for it to end, or "
                "choose another hydra.run.dir"
            )
        yield
    finally:
        if handle is not None:
            handle.close()


def trained_any(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return bool(list_checkpoints(run_dir)) or (metrics.is_file() and metrics.stat().st_size > 0)


class LaunchRecord:
    """This launch's config files (`subdir` of the run directory, None where Hydra writes none), which
    of weft's files the run directory held before the launch, and whether the launch has trained a step
    (set by the training loop). Made first thing in the task function: Hydra has made the run directory,
    this launch's record and an empty log file by then, and nothing else of this launch's."""

    def __init__(self, run_dir: Path, subdir: str | None) -> None:
        self.run_dir = run_dir
        self.files = run_dir / subdir if subdir else None
        self.trained = False
        self.found = {name for name in PRE_TRAINING_FILES if self._held_before(run_dir / name)}

    def _held_before(self, path: Path) -> bool:
        if path.name == "train.log":  # Hydra's log file of this launch, empty unless it was there before
            return path.is_file() and path.stat().st_size > 0
        if path.name == "launches":  # holds this launch's record
            return path.is_dir() and any(entry != self.files for entry in path.iterdir())
        return path.exists() or path.is_symlink()

    def forget(self, writer: bool = True, in_use: bool = False) -> None:
        """Undo a launch that failed before its first step: remove its record and, if the run
        directory never trained, the files of weft's that this launch wrote there, and the directory
        itself when nothing else is (`in_use`: refused for a run directory another launch holds, whose
        files those are). Files the run directory held before the launch stay.
        Under torchrun only the writer (rank 0) removes files; every rank removes the run directory if
        it is empty (Hydra makes it on each rank, and a peer may make it after rank 0 removed it)."""
        if not writer:
            _remove_if_empty(self.run_dir)
            return
        if self.files is not None:
            shutil.rmtree(self.files, ignore_errors=True)
            _remove_if_empty(self.files.parent)
        if in_use or trained_any(self.run_dir):
            return
        for name in set(PRE_TRAINING_FILES) - self.found:
            path = self.run_dir / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink()
        _remove_if_empty(self.run_dir)


def _remove_if_empty(directory: Path) -> None:
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()

"""Where each logged step's numbers go: a row of <run dir>/metrics.jsonl, a line through `logging`
(train.log, and the console), and TensorBoard's event files when `logging.tensorboard=true`."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

TENSORBOARD_MISSING = (
    "logging.tensorboard=true needs the tensorboard package: pip install -e '.[tensorboard]' "
    "(or set logging.tensorboard=false)"
)


def require_tensorboard() -> type:
    """TensorBoard's SummaryWriter class, or a ValueError saying how to install it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(TENSORBOARD_MISSING) from None
    return SummaryWriter


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl."""
    return read_rows(Path(run_dir) / "metrics.jsonl")


def read_rows(file: Path) -> list[dict[str, Any]]:
    """The JSON rows of a .jsonl file (a line cut short by a crash is skipped)."""
    rows = []
    for line in file.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def drop_rows_after(file: Path, step: int) -> None:
    """Keep only the rows of steps <= `step`: a resumed run replays the steps after its checkpoint and
    logs them again (rewritten under a temporary name, then renamed)."""
    if not file.is_file():
        return
    rows = [row for row in read_rows(file) if row.get("step", 0) <= step]
    tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, file)


def step_line(record: dict[str, Any], total_steps: int) -> str:
    parts = [
        f"step {record['step']}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3e}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"tokens/s {record['tokens_per_s']:.0f}",
    ]
    if "eval_loss" in record:
        parts.insert(2, f"eval_loss {record['eval_loss']:.4f}")
    if "memory_gb" in record:
        parts.append(f"memory {record['memory_gb']:.2f} GB")
    if "mfu" in record:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    return "  ".join(parts)


class MetricsLog:
    """Rank 0's metrics of one launch. On a resume from `start_step`, rows (and TensorBoard points) of
    later steps, written before the run was stopped, are dropped when this launch logs its first step:
    every step appears once, and a launch that fails before it logs anything leaves the rows as they were."""

    def __init__(self, run_dir: Path, start_step: int, total_steps: int, tensorboard: bool) -> None:
        self.run_dir, self.start_step, self.total_steps = run_dir, start_step, total_steps
        self.summary_writer = require_tensorboard() if tensorboard else None
        self.file: TextIO | None = None
        self.tensorboard = None

    def _open(self) -> None:
        """At the launch's first row: drop the later steps' rows, then open the files it appends to."""
        path = self.run_dir / "metrics.jsonl"
        drop_rows_after(path, self.start_step)
        self.file = open(path, "a")  # noqa: SIM115 (closed by __exit__)
        if self.summary_writer is not None:
            log_dir = str(self.run_dir / "tensorboard")
            self.tensorboard = self.summary_writer(log_dir=log_dir, purge_step=self.start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            self._open()
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        log.info(step_line(record, self.total_steps))
        if self.tensorboard is not None:
            for name, value in record.items():
                if name != "step":
                    tag = "eval/loss" if name == "eval_loss" else f"train/{name}"
                    self.tensorboard.add_scalar(tag, value, record["step"])
            self.tensorboard.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

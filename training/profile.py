"""A trace of a few training steps (logging.profile_at, logging.profile_steps): torch.profiler records
what each rank's CPU and GPU ran during those steps (weft's comm kernels beside the GEMMs they overlap
with, the collectives, the optimizer) and writes one trace per rank that Perfetto (ui.perfetto.dev) or
chrome://tracing opens."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


def trace_path(run_dir: Path, first: int, last: int, rank: int) -> Path:
    return run_dir / "profile" / f"steps_{first}-{last}" / f"rank{rank}.json.gz"


class StepProfiler:
    """Profiles steps first .. first + steps - 1 (None: none), or up to the launch's last step if that
    comes sooner; `begin(step)` before a step runs, `end(step, last_of_launch)` after it."""

    def __init__(self, run_dir: Path, first: int | None, steps: int, rank: int, device: torch.device) -> None:
        self.run_dir, self.first, self.steps, self.rank = run_dir, first, steps, rank
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self.profiler: profile | None = None

    def begin(self, step: int) -> None:
        if step != self.first:
            return
        self.profiler = profile(activities=self.activities, record_shapes=True, acc_events=True)
        self.profiler.start()

    def end(self, step: int, last_of_launch: bool) -> None:
        if self.profiler is None or not (step == self.first + self.steps - 1 or last_of_launch):
            return
        self.profiler.stop()
        out = trace_path(self.run_dir, self.first, step, self.rank)
        out.parent.mkdir(parents=True, exist_ok=True)
        self.profiler.export_chrome_trace(str(out))  # (a .gz name writes it compressed)
        self.profiler = None
        if self.rank == 0:
            log.info(f"profiled steps {self.first}-{step}: a trace per rank in {out.parent}")

"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's notice).

The first signal only raises a flag: the training loop finishes its step, every rank agrees on
stopping (torchrun forwards the signal to each rank, which may receive it during different steps),
then the loop saves a checkpoint and returns. A second signal ends the process at once, as its
default action would, leaving the last complete checkpoint as it was; before the first step it
raises KeyboardInterrupt instead, so that the launch's records are cleaned up on the way out.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)

log = logging.getLogger(__name__)


class StopRequest:
    """Use as a context manager around training: inside it, SIGINT/SIGTERM set `signal` instead of
    interrupting; `agreed()` tells whether any rank got one."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._training = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def training_started(self) -> None:
        """From now on a second signal kills the process (no unwinding through a step's collectives)."""
        self._training = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            print(
                f"\n{signal.Signals(signum).name} again: exiting without saving", file=sys.stderr, flush=True
            )
            if not self._training:
                raise KeyboardInterrupt
            # No save, no clean-up: the process dies of the signal as it would by default.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signal = signal.Signals(signum)
        log.info(f"{self.signal.name}: stopping after this step to save a checkpoint (again: exit at once)")

    def agreed(self) -> bool:
        """True on every rank when any rank was signalled (a one-integer all-reduce per call, on the CPU:
        gloo serves CPU tensors in every process group weft creates)."""
        if not dist.is_initialized():
            return self.signal is not None
        flag = torch.tensor([0 if self.signal is None else int(self.signal)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        # The answer is the reduced flag alone: a signal that lands while the all-reduce runs counts at
        # the next step on every rank, not at this one on this rank only.
        agreed = int(flag.item())
        if agreed and self.signal is None:
            self.signal = signal.Signals(agreed)
        return agreed != 0

    @property
    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + int(self.signal) if self.signal is not None else 0

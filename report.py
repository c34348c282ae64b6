"""Result tables and the environment they were measured in, shared by serve.py's decode benchmark and
the scripts in benchmarks/."""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Sequence

import torch


def environment() -> dict[str, str]:
    """Versions and device, recorded beside every result."""
    env = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["cuda"] = str(torch.version.cuda)
        # The GPUs the run used (its ranks, one each), not those the node has: a one-GPU benchmark on
        # an eight-GPU node says 1, as its file name does.
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        env["gpus"] = str(ranks)
    return env


def markdown_table(rows: Sequence[dict[str, object]]) -> str:
    """Rows as a markdown table, a column per key of any row (in the order they first appear; a row
    without one leaves its cell empty); floats printed with 4 significant digits."""
    if not rows:
        return "(no rows)\n"
    keys = list(dict.fromkeys(key for row in rows for key in row))

    def fmt(v: object) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"

"""Persistent per-device workspaces: buffers that a kernel leaves as it found them (it re-arms what it
used before it ends), so that every call, and every replay of a CUDA graph that captured one, can
reuse the same memory without clearing it first.
"""

from __future__ import annotations

import torch

Workspaces = dict[torch.device, list[torch.Tensor]]


def persistent_workspace(
    workspaces: Workspaces,
    device: torch.device,
    numel: int,
    fill: int,
    min_numel: int,
    what: str,
    dtype: torch.dtype = torch.int32,
) -> torch.Tensor:
    """A workspace of `device` at least `numel` long, from `workspaces` (one registry per kind of
    workspace), every element the 32-bit pattern `fill` when allocated, viewed as `dtype` (4 bytes).
    Grown outside CUDA-graph capture only (doubling, at least `min_numel`), and a grown-out workspace
    is kept alive: graphs captured earlier still point at it. Calls on concurrent streams must not
    share one."""
    held = workspaces.setdefault(device, [])
    if not held or held[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"the {what} needs {numel} elements while a CUDA graph is being captured: run the same "
                "call once before capture (a warm-up call) so it is allocated outside"
            )
        size = max(numel, min_numel, 2 * (held[-1].numel() if held else 0))
        held.append(torch.full((size,), fill, dtype=torch.int32, device=device).view(dtype))
    return held[-1]

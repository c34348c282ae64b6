"""The communication dispatch of tensor/sequence/context parallelism: one interface, one
implementation per `parallel.comm` value.

    torch     torch.distributed collectives + a separate matmul (gloo and NCCL alike)
    symm_mem  PyTorch's fused symmetric-memory ops (`torch.ops.symm_mem.*`), CUDA only
    triton    weft's own kernels in kernels/, each op available once its kernel exists

Every op works on one process group (a tensor- or context-parallel group). Matrices follow
`torch.matmul`'s convention: `a @ b` with `b` of shape [K, N]; an nn.Linear weight [N, K] is passed as
`weight.t()`. `dim` is the tensor dimension that is gathered or scattered (the sequence dimension,
1 for the model's [B, S, D] activations).

    all_gather_matmul(a_shard, [b0, b1, ...], dim) -> (a, [a @ b0, a @ b1, ...]), a = all_gather(a_shard, dim)
    matmul_reduce_scatter(a, b, dim)              -> reduce_scatter(a @ b, dim)  (sum)
    all_reduce(x)                                 -> sum over the group (a new tensor)
    seq_to_heads([q, k, v])                       -> each [B, H, S/W, D] -> [B, max(H, W)/W, S, D] (Ulysses)
    heads_to_seq([x, ...])                        -> each [B, H/W, S, D] -> [B, H, S/W, D]
    all_gather(x, dim), reduce_scatter(x, dim)    -> the plain collectives (no matmul)
    decode_all_gather(x, dim)                     -> all_gather at decode (triton: through weft's all-reduce)

The plain all-gather / reduce-scatter are the stock collectives on every path: the model's layers only
use them where no fused op is attached (the embedding, the gathered logits without sequence
parallelism under autograd, and the re-gather of `save_gathered=False`); decode's logits gather is
`decode_all_gather`; the gradient of the sequence-parallel norms is summed by the dispatched all-reduce.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

COMM_PATHS = ("torch", "symm_mem", "triton")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_reduce", "seq_to_heads", "heads_to_seq")

# torch >= 2.13 renames the tensor collectives; the old names still work on 2.11 (the GPU hosts).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CommUnavailable(RuntimeError):
    """A comm path cannot run an op here (no kernel yet, or the wrong device / topology)."""


def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order (no gradient flows through it)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    # Detached: gloo stages CUDA tensors through the host and copies them back in place, which autograd
    # refuses for an input that requires grad.
    x = x.detach().contiguous()
    # Rank-major [W * x.shape[0], ...] (the collectives' layout), then [..., W * n, ...].
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    dim = dim % x.dim()
    if dim == 0:
        return out
    return out.unflatten(0, (world, -1)).movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's chunk of `dim` (chunks in rank order)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()  # a negative dim would be counted again after the unflatten below
    if x.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {world} ranks")
    # [..., W * n, ...] -> [W, ..., n, ...] contiguous, so rank i's chunk is the i-th block.
    send = x.unflatten(dim, (world, -1)).movedim(dim, 0).contiguous()
    out = torch.empty(send.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, send.flatten(0, 1), group=group)
    return out


class Comm:
    """The ops over one group. Subclasses override what their path does differently; an op a path
    lacks raises CommUnavailable naming the op (see `require`)."""

    name = "base"

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.group_name: str = group.group_name
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # The registered ops below find this group's comm path by the group's name.
        _BY_GROUP[self.group_name] = self

    def available(self, op: str) -> str | None:
        """None when `op` runs on this path, else a reason."""
        return None

    def check(self) -> None:
        """Raise if an op of this path gave up waiting for a peer. weft's kernels record a timed-out
        wait on the device (then skip their later waits) instead of hanging; the stock collectives
        raise their own errors, so here there is nothing to do."""

    def require(self, ops: Sequence[str]) -> None:
        """Fail at set-up (before any work) when an op the model will call is missing."""
        for op in ops:
            if op not in OPS:
                raise ValueError(f"no comm op is named {op!r}; the ops are {', '.join(OPS)}")
            reason = self.available(op)
            if reason is not None:
                raise CommUnavailable(f"parallel.comm={self.name}: {op} {reason}")

    # Plain collectives (stock on every path).
    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return all_gather(x, dim, self.group)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return reduce_scatter(x, dim, self.group)

    def decode_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The all-gather inside the decode step (vocabulary-sharded logits), captured in its CUDA graph."""
        return self.all_gather(x, dim)

    # The dispatched ops; the base class holds the stock (torch) versions.
    def all_gather_matmul(
        self, a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        a = self.all_gather(a_shard, dim)
        return a, [torch.matmul(a, b) for b in bs]

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
        return self.reduce_scatter(torch.matmul(a, b), dim)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        if self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out

    def seq_to_heads(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # The stock path (permute, all_to_all_single, permute) lives beside the kernel it is measured
        # against; imported here so the torch path does not load Triton until Ulysses runs.
        from kernels.all_to_all import seq_to_heads_reference

        return seq_to_heads_reference(xs, self.group)

    def heads_to_seq(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        from kernels.all_to_all import heads_to_seq_reference

        return heads_to_seq_reference(xs, self.group)


class TorchComm(Comm):
    """torch.distributed collectives, then (or before) a plain matmul: runs on gloo and NCCL."""

    name = "torch"


# group name -> the Comm built last for that group (what the registered ops dispatch to).
_BY_GROUP: dict[str, Comm] = {}


@torch.library.custom_op("weft::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Registered form of `Comm.all_reduce` (sum over the group, new tensor) on the group's comm path:
    opaque to torch.compile (full graphs of the decode step) and capturable in CUDA graphs when the
    path is."""
    comm = _BY_GROUP[group_name]
    return comm.all_reduce(x) if comm.world > 1 else x.clone()


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("weft::tp_all_gather", mutates_args=())
def tp_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Registered form of `Comm.decode_all_gather` (ranks' chunks concatenated along `dim`)."""
    comm = _BY_GROUP[group_name]
    return comm.decode_all_gather(x, dim) if comm.world > 1 else x.clone()


@tp_all_gather.register_fake
def _(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= _BY_GROUP[group_name].world
    return x.new_empty(shape)


def _check_cuda_peers(group: dist.ProcessGroup, path: str) -> None:
    """Symmetric memory needs every rank of the group on one node with peer access between their GPUs;
    weft's kernels also run with ranks sharing a GPU (buffers mapped by CUDA IPC), PyTorch's fused ops
    do not. Raise a one-line error otherwise."""
    if not torch.cuda.is_available():
        raise CommUnavailable(f"parallel.comm={path} needs CUDA GPUs; on CPU use parallel.comm=torch")
    from kernels.symm_mem import SymmMemError, check_group

    try:
        shared_gpu = check_group(group)
    except SymmMemError as err:
        raise CommUnavailable(f"parallel.comm={path}: {err}") from None
    if shared_gpu and path == "symm_mem":
        raise CommUnavailable(SYMM_MEM_SHARED_GPU)


SYMM_MEM_SHARED_GPU = (
    "parallel.comm=symm_mem cannot run with ranks sharing a GPU (PyTorch's rendezvous refuses "
    "allocations from overlapping devices): use parallel.comm=triton (weft's kernels map the buffers "
    "with CUDA IPC) or parallel.comm=torch"
)


class SymmMemComm(Comm):
    """PyTorch's fused symmetric-memory ops. The Ulysses all-to-all has no fused op in PyTorch and stays
    on the stock path (`all_to_all_single` on NCCL); the plain all-gather / reduce-scatter likewise."""

    name = "symm_mem"
    # Up to this many bytes the one-shot all-reduce (every rank reads all peers) rather than the
    # two-shot (reduce-scatter + all-gather in symmetric memory): faster at 64-128 KiB, within 0.6 us
    # below, in the torch columns of benchmarks/results/all_reduce-h200-x4.md (4x H200).
    ONE_SHOT_MAX_BYTES = 128 * 1024

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        _check_cuda_peers(group, self.name)
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.symm_mem import enable_symm_mem

        self._symm_mem = symm_mem
        enable_symm_mem(self.group_name)
        # Symmetric input buffers of the all-reduce, one per (numel, dtype), allocated on first use and
        # reused (so a CUDA graph captured after a warm-up call allocates nothing).
        self._buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def all_gather_matmul(
        self, a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        a, outs = torch.ops.symm_mem.fused_all_gather_matmul(
            a_shard, list(bs), dim % a_shard.dim(), self.group_name, return_A=True
        )
        return a, list(outs)

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", dim % a.dim(), self.group_name)
        # Some torch versions hand back the fp32 accumulation; every path returns the inputs' dtype.
        return out.to(a.dtype)

    def _buffer(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.numel(), x.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._symm_mem.empty(x.numel(), dtype=x.dtype, device=x.device)
            self._symm_mem.rendezvous(buf, self.group_name)
            self._buffers[key] = buf
        return buf

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self._buffer(x)
        out = torch.empty_like(x)
        ops = torch.ops.symm_mem
        if x.numel() * x.element_size() <= self.ONE_SHOT_MAX_BYTES:
            if hasattr(ops, "one_shot_all_reduce_copy_out"):
                # The copy into the symmetric buffer happens inside the kernel, after its entry barrier.
                ops.one_shot_all_reduce_copy_out(buf, x.reshape(-1), "sum", self.group_name, out.view(-1))
            else:
                buf.copy_(x.reshape(-1))
                ops.one_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        else:
            buf.copy_(x.reshape(-1))
            ops.two_shot_all_reduce_out(buf, "sum", self.group_name, out.view(-1))
        return out


# The triton path: op -> (module in kernels/, function name). The function takes the same arguments
# as the Comm method after `self`, plus `group=`. Ops missing from kernels/ give a clear error.
TRITON_KERNELS: dict[str, tuple[str, str]] = {
    "all_reduce": ("kernels.custom_all_reduce", "all_reduce"),
    "all_gather_matmul": ("kernels.ag_matmul", "all_gather_matmul"),
    "matmul_reduce_scatter": ("kernels.matmul_rs", "matmul_reduce_scatter"),
    "seq_to_heads": ("kernels.all_to_all", "seq_to_heads"),
    "heads_to_seq": ("kernels.all_to_all", "heads_to_seq"),
}


def _no_kernel(op: str) -> str:
    module, attr = TRITON_KERNELS[op]
    return (
        f"has no Triton kernel yet ({module}.{attr} does not exist): "
        "use parallel.comm=torch or parallel.comm=symm_mem"
    )


def _find_kernel(op: str) -> Callable[..., Any] | None:
    module_name, attr = TRITON_KERNELS[op]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        return None
    return getattr(module, attr, None)


class TritonComm(Comm):
    """weft's own kernels, looked up in kernels/ when the path is built."""

    name = "triton"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        _check_cuda_peers(group, self.name)
        self._kernels = {op: _find_kernel(op) for op in TRITON_KERNELS}
        if self._kernels["all_reduce"] is not None:
            # Allocate and rendezvous the all-reduce's symmetric buffer now (collective over the group),
            # not at the first call, which may be inside a CUDA graph capture.
            from kernels.custom_all_reduce import get_custom_all_reduce

            get_custom_all_reduce(group)

    def available(self, op: str) -> str | None:
        return None if self._kernels.get(op) is not None else _no_kernel(op)

    def check(self) -> None:
        for module in sorted({module for module, _ in TRITON_KERNELS.values()}):
            importlib.import_module(module).check(self.group)

    def _kernel(self, op: str) -> Callable[..., Any]:
        self.require([op])
        return self._kernels[op]

    def all_gather_matmul(
        self, a_shard: torch.Tensor, bs: Sequence[torch.Tensor], dim: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self._kernel("all_gather_matmul")(a_shard, list(bs), dim, group=self.group)

    def matmul_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
        return self._kernel("matmul_reduce_scatter")(a, b, dim, group=self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel("all_reduce")(x, group=self.group)

    def decode_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Through weft's all-reduce: this rank's chunk in a zeroed [W, ...] tensor, summed (x + 0 is
        exact). W times the bytes of a gather, a few hundred KiB for decode's logits, in one kernel that
        CUDA graphs capture on any backend; the stock gather is capturable only on NCCL, which ranks
        sharing a GPU cannot use."""
        chunks = x.new_zeros((self.world, *x.shape))
        chunks[self.rank].copy_(x)
        dim %= x.dim()
        return self.all_reduce(chunks).movedim(0, dim).flatten(dim, dim + 1).contiguous()

    def seq_to_heads(self, xs):
        return self._kernel("seq_to_heads")(list(xs), group=self.group)

    def heads_to_seq(self, xs):
        return self._kernel("heads_to_seq")(list(xs), group=self.group)


_PATHS: dict[str, type[Comm]] = {"torch": TorchComm, "symm_mem": SymmMemComm, "triton": TritonComm}


def check_comms() -> None:
    """`Comm.check` of every comm path built in this process: raises SymmMemTimeout naming the rank,
    op and missing peer after a kernel's bounded wait gave up. It reads small status words from the
    device, so call it where the host waits for the device anyway (train.py: after reading the loss)."""
    for comm in {id(c): c for c in _BY_GROUP.values()}.values():
        comm.check()


def check_ops(path: str, ops: Sequence[str]) -> None:
    """Raise CommUnavailable (one line, naming the op) when `path` has no implementation of one of
    `ops`; needs no process group, so it runs before any work."""
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"no comm op is named {unknown[0]!r}; the ops are {', '.join(OPS)}")
    if path != "triton":
        return
    for op in ops:
        if _find_kernel(op) is None:
            raise CommUnavailable(f"parallel.comm=triton: {op} {_no_kernel(op)}")


def make_comm(path: str, group: dist.ProcessGroup, require: Sequence[str] = ()) -> Comm:
    """The ops of `path` over `group`; raises a one-line error when `path` cannot run here or lacks one
    of the `require`d ops."""
    if path not in _PATHS:
        raise ValueError(f"parallel.comm={path!r} is not one of {', '.join(COMM_PATHS)}")
    comm = _PATHS[path](group)
    comm.require(require)
    return comm

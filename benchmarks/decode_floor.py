"""The floor of a decode step built of one kernel per op: how close to the roofline can such a step get?

    python -m benchmarks.decode_floor --model llama3_8b --batch-sizes 1 8    # one Hopper GPU

Each kernel of serve.py's decode step (model/decode.py's structure) is replaced one for one by a plain
streaming kernel that moves exactly its bytes and does nothing else (bench_fp8_floors' kernels), in the
step's order and with programmatic dependent launch as served:
- a GEMM reads its weight (N * K bytes in e4m3, twice that in bf16), before the PDL wait, as weights are
  no earlier kernel's output;
- attention reads the batch's whole static KV cache (what the roofline counts), also before the wait, as
  earlier steps wrote it; its combine launch, where there is one, reads the fp32 partials after it;
- an add + RMSNorm reads the pending output and the residual and writes the residual and the normalized
  row, SwiGLU reads gate and up and writes their product, both after the wait.
Every layer has buffers of its own (nothing is served from L2 that a real step would read from DRAM).
The chain is one CUDA graph, timed by replays. No kernel doing the real work with this launch
structure can beat it, so roofline / floor is the most of the roofline such a step can reach.

Rows per (dtype, batch), by launch structure:
- "2-launch attention, SwiGLU kernel": per layer add+norm (the first block: norm), qkv, attention split +
  combine, wo, add+norm, w13, SwiGLU, w2; then add+norm and the output projection (weft's step before
  its decode attention ran in one launch);
- "1-launch attention, SwiGLU kernel": the combine folded into the attention kernel (weft's step as it
  runs);
- "1-launch attention, SwiGLU in w13": also no SwiGLU kernel;
- "GEMMs and attention only": every glue kernel gone (norms fused into the GEMMs as well);
- "one kernel": all the step's bytes read by one launch.

What is left above the floor, class by class: under PDL a profile's kernel durations overlap, so the
step's time is not their sum, and the breakdown is by ablation instead. The rows after weft's structure
time its chain with one class of ops launched as weft's own kernels, called as serve.py calls them
(model/decode.py, model/fp8.py: the skinny GEMM, decode_attention, the add + RMSNorm
and SwiGLU kernels) on weights, caches and inputs of their own of the model's shapes and dtypes
(finite random values; attention at the cache's last slot), and every other op still a stand-in:
- "weft's GEMMs": the four GEMMs of each layer and the output projection;
- "weft's attention": rotary, cache write and attention (one launch) of each layer;
- "weft's norms": each layer's two norms and the final one;
- "weft's SwiGLU": each layer's SwiGLU;
- "all weft's kernels": every op, the step as served less the embedding (and argmax): its time
  should come close to serve.py's step.
Their floor_us is that chain's time (the floor of a step with those kernels as they are), and
above_floor_us that less the floor of weft's structure: what the class of weft's kernels costs beyond
streaming its bytes, neighbours' overlap included. The classes' excesses need not add up to
that of "all weft's kernels": how much a kernel overlaps its neighbours under PDL depends on what they are.

The roofline is bench_decode's for the step at the cache's last slot (the one step of its run whose
attention reads the whole cache): weights and KV cache over the measured copy bandwidth (serve.py), here
counted from the model's shapes (the norm weights and FP8 scales, under 0.1%, left out).
Writes benchmarks/results/decode_floor-<model>-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from functools import partial

import torch
import triton
import triton.language as tl

from benchmarks.bench_bf16_gemm import gemms_of, preset_args
from benchmarks.bench_fp8_floors import BLOCKS, WARPS, launch, read_floor, read_kernel
from benchmarks.common import add_decode_shape_args, time_graph, write_results
from kernels.decode_attention import decode_attention, num_splits
from kernels.fp8 import FP8, pdl_wait, quantize_reference
from kernels.fp8_gemm import partial_count
from model.args import ModelArgs
from model.decode import Bf16Kernels
from model.fp8 import Fp8Kernels
from model.llama import rope_table
from serve import memory_bandwidth

ROWS_BLOCK, ROWS_WARPS = 1024, 4  # the row kernels move a few KiB to a few hundred: latency-bound


@triton.jit
def _rows_kernel(
    a_ptr, b_ptr, out_ptr, out2_ptr, n, TWO_OUTPUTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """Reads a and b (the previous kernel's outputs), writes their sum to out (and out2)."""
    pdl_wait(PDL, False)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(a_ptr + offs, mask=mask).to(tl.float32) + tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)
    if TWO_OUTPUTS:
        tl.store(out2_ptr + offs, x.to(out2_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Op:
    """One op of the step: a stand-in kernel that `reads` bytes before the PDL wait (weights, KV cache)
    or a row op, or with `weft` weft's own kernel for it (weft_call)."""

    name: str
    kind: str  # the class of weft's kernels it belongs to: "GEMM", "attention", "norm" or "SwiGLU"
    reads: int = 0  # bytes read before the wait
    rows: int = 0  # elements of each input of a row op (read after the wait)
    row_dtype: torch.dtype = torch.bfloat16  # its (first) output's dtype
    two_outputs: bool = False
    shape: tuple[int, int] = (0, 0)  # a GEMM's weight, N x K
    after: str = ""  # an add+norm's: the GEMM whose output it adds (as split-K partials, weft's)
    weft: bool = False  # launched as weft's own kernels rather than a stand-in


STRUCTURES = [
    "2-launch attention, SwiGLU kernel",
    "1-launch attention, SwiGLU kernel",
    "1-launch attention, SwiGLU in w13",
    "GEMMs and attention only",
]
WEFT_STRUCTURE = STRUCTURES[1]  # serve.py's step
# The ablation rows (module docstring): weft's structure with these classes of ops on weft's kernels.
WEFT_ROWS = {
    "weft's GEMMs": {"GEMM"},
    "weft's attention": {"attention"},
    "weft's norms": {"norm"},
    "weft's SwiGLU": {"SwiGLU"},
    "all weft's kernels": {"GEMM", "attention", "norm", "SwiGLU"},
}


def step_ops(
    args: ModelArgs,
    batch: int,
    cache_len: int,
    fp8: bool,
    structure: str,
    device: torch.device,
    weft_classes: Collection[str] = (),
) -> list[Op]:
    """The kernels of one decode step of `args` on `device` under launch `structure` (module
    docstring), the ops of the classes in `weft_classes` ("GEMM", "attention", "norm", "SwiGLU") marked to run
    on weft's kernels (weft's structure only)."""
    if weft_classes and structure != WEFT_STRUCTURE:
        raise ValueError(
            f"weft's kernels run in weft's launch structure ({WEFT_STRUCTURE!r}), not {structure!r}"
        )
    weight_bytes = 1 if fp8 else 2
    act = FP8 if fp8 else torch.bfloat16
    kv = 2 * batch * args.n_kv_heads * cache_len * args.head_dim * 2
    group = args.n_heads // args.n_kv_heads
    splits = num_splits(batch, args.n_kv_heads, group, args.head_dim, cache_len, device)
    partials = batch * args.n_heads * splits * args.head_dim  # fp32 partial outputs of the splits
    glue = structure != "GEMMs and attention only"
    norm = Op("add+norm", "norm", rows=batch * args.dim, row_dtype=act, two_outputs=True)
    gemm = {name: Op(name, "GEMM", reads=n * k * weight_bytes, shape=(n, k)) for name, n, k in gemms_of(args)}
    after_w2, after_wo = replace(norm, after="w2"), replace(norm, after="wo")
    layer = [after_w2] if glue else []
    layer += [gemm["wqkv"], Op("attention", "attention", reads=kv)]
    if structure.startswith("2-launch"):  # the combine's two bf16 inputs: the fp32 partials' bytes
        layer.append(Op("attention combine", "attention", rows=partials))
    layer.append(gemm["wo"])
    layer += [after_wo] if glue else []
    layer.append(gemm["w13"])
    if structure.endswith("SwiGLU kernel"):
        layer.append(Op("SwiGLU", "SwiGLU", rows=batch * args.ffn_hidden, row_dtype=act))
    layer.append(gemm["w2"])
    ops = layer * args.n_layers + ([after_w2] if glue else []) + [gemm["output"]]
    if glue:
        # The first block norms the embedding output, with no residual to add yet (model/decode.py):
        # weft runs RMSNorm alone there. The stand-in moves an add+norm's few KiB all the same.
        ops[0] = replace(norm, name="norm")
    return [replace(op, weft=True) if op.kind in weft_classes else op for op in ops]


def weft_call(
    op: Op, args: ModelArgs, batch: int, cache_len: int, fp8: bool, rope: torch.Tensor
) -> Callable[[], object]:
    """weft's kernel(s) for `op`, called as serve.py's step calls them (model/decode.py's DecodeKernels:
    Bf16Kernels, or model/fp8.py's Fp8Kernels), on a weight, KV cache and inputs of its own on `rope`'s
    device, finite random values of the model's shapes and dtypes. `rope` is the model's rotary table
    (rope_table), shared by the layers as in the model; attention runs at the cache's last slot."""
    device = rope.device
    kernels = Fp8Kernels() if fp8 else Bf16Kernels()
    bf16 = partial(torch.randn, device=device, dtype=torch.bfloat16)
    if op.kind == "GEMM":
        n, k = op.shape
        # FP8: quantized per channel, as served; wo and w2 leave their split-K partials to the norm.
        weight = kernels.weight(bf16(n, k) * 0.02, partials=op.name in ("wo", "w2"))
        x = bf16(batch, k)
        if not fp8:
            return partial(weight, x)
        # FP8 activations scaled per token; wo's as the attention writes them, per token and kv head.
        groups = args.n_kv_heads if op.name == "wo" else 1
        values, scales = quantize_reference(x.view(batch, groups, -1))
        return partial(weight, (values.view(batch, k), scales if groups > 1 else scales.view(batch)))
    if op.kind == "norm":
        x = bf16(batch, args.dim)
        norm_weight = torch.rand(args.dim, device=device, dtype=torch.bfloat16) + 0.5
        if op.name == "norm":
            return partial(kernels.norm, x, norm_weight, args.norm_eps)
        # The pending input: the split-K partials of the GEMM before it, as many as that GEMM leaves.
        n, k = next((n, k) for name, n, k in gemms_of(args) if name == op.after)
        a = torch.empty(batch, k, device=device, dtype=FP8 if fp8 else torch.bfloat16)
        groups = args.n_kv_heads if op.after == "wo" else 1  # wo's A: a scale per token and kv head
        scales = torch.ones(batch, groups, device=device).squeeze(1) if fp8 else None
        slices = partial_count(a, scales, torch.empty(n, k, device=device, dtype=a.dtype))
        pending = torch.randn(slices, batch, args.dim, device=device)
        return partial(kernels.add_norm, pending, bf16(batch, args.dim), norm_weight, args.norm_eps)
    if op.kind == "SwiGLU":
        return partial(kernels.swiglu, bf16(batch, 2 * args.ffn_hidden))
    if op.kind == "attention":
        # q, k and v as column slices of one qkv output, as DecodeBlock passes them.
        heads, kv_heads = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        q, k, v = bf16(batch, 1, heads + 2 * kv_heads).split([heads, kv_heads, kv_heads], dim=-1)
        caches = [bf16(batch, args.n_kv_heads, cache_len, args.head_dim) for _ in range(2)]
        position = torch.tensor([cache_len - 1], device=device)
        return partial(decode_attention, q, k, v, rope, position, *caches, fp8=fp8)
    raise ValueError(f"no weft kernel for op {op.name!r} of class {op.kind!r}")


def best_read_config(nbytes: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the fastest plain read of `nbytes`, timed alone (bench_fp8_floors)."""
    copies = max(2, -(-(1 << 30) // nbytes))
    words = [torch.empty(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(copies)]
    _, block, warps = read_floor(words)
    return block, warps


def chain(
    ops: list[Op],
    configs: dict[int, tuple[int, int]],
    build_weft: Callable[[Op], Callable[[], object]] | None = None,
) -> Callable[[], None]:
    """One callable launching each op's kernels, each op on buffers of its own: a streaming stand-in,
    or for an op marked `weft` the call `build_weft` makes for it (weft_call)."""
    calls = []
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    for op in ops:
        if op.weft:
            if build_weft is None:
                raise ValueError(f"op {op.name!r} runs on weft's kernels: pass build_weft (weft_call)")
            calls.append(build_weft(op))
        elif op.reads:
            n = op.reads // 4
            block, warps = configs[op.reads]
            src = torch.empty(n, dtype=torch.int32, device="cuda")
            calls.append(
                partial(launch, read_kernel, (triton.cdiv(n, block),), src, sink, n, block=block, warps=warps)
            )
        else:
            a, b = (torch.zeros(op.rows, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            out = torch.empty(op.rows, dtype=op.row_dtype, device="cuda")
            out2 = torch.empty(op.rows, dtype=torch.bfloat16, device="cuda")
            calls.append(
                partial(
                    launch, _rows_kernel, (triton.cdiv(op.rows, ROWS_BLOCK),), a, b, out, out2, op.rows,
                    op.two_outputs, block=ROWS_BLOCK, warps=ROWS_WARPS,
                )
            )  # fmt: skip

    def run() -> None:
        for call in calls:
            call()

    return run


def one_read_us(nbytes: int) -> float:
    """Microseconds of the fastest single plain kernel reading `nbytes`."""
    n = nbytes // 4
    words = torch.empty(n, dtype=torch.int32, device="cuda")
    sink = torch.empty(triton.cdiv(n, min(BLOCKS)), dtype=torch.int32, device="cuda")
    return 1e3 * min(
        time_graph(
            partial(launch, read_kernel, (triton.cdiv(n, b),), words, sink, n, block=b, warps=w), 2, 10
        )
        for b in BLOCKS
        for w in WARPS
    )


def floor_rows(
    args: ModelArgs, batch: int, cache_len: int, fp8: bool, bandwidth: float
) -> list[dict[str, object]]:
    """One row per launch structure (and one for a single read of every byte): the chain's time beside
    the roofline of the same bytes at `bandwidth` (bytes/s); after weft's structure, its ablation rows
    (WEFT_ROWS), the chain with one class of ops on weft's kernels, and what each adds to its floor."""
    cuda = torch.device("cuda")
    ops = {s: step_ops(args, batch, cache_len, fp8, s, cuda) for s in STRUCTURES}
    read_bytes = sum(op.reads for op in ops[WEFT_STRUCTURE])
    configs = {size: best_read_config(size) for size in {op.reads for op in ops[WEFT_STRUCTURE] if op.reads}}
    rope = rope_table(args, cuda)
    build_weft = partial(weft_call, args=args, batch=batch, cache_len=cache_len, fp8=fp8, rope=rope)
    for name, classes in WEFT_ROWS.items():
        ops[name] = step_ops(args, batch, cache_len, fp8, WEFT_STRUCTURE, cuda, classes)
    timed = {}
    for name, o in ops.items():  # one chain at a time: each holds all the step's weights
        run = chain(o, configs, build_weft)
        timed[name] = (len(o), time_graph(run, calls_per_graph=2, replays=10) * 1e3)
        del run
        torch.cuda.empty_cache()
    timed["one kernel"] = (1, one_read_us(read_bytes))
    roofline_us = read_bytes / bandwidth * 1e6
    weft_floor_us = timed[WEFT_STRUCTURE][1]
    rows = []
    others = [s for s in STRUCTURES if s != WEFT_STRUCTURE]
    for name in [WEFT_STRUCTURE, *WEFT_ROWS, *others, "one kernel"]:
        kernels, floor_us = timed[name]
        rows.append(
            {
                "dtype": "fp8" if fp8 else "bf16",
                "batch": batch,
                "structure": name,
                "kernels": kernels,
                "floor_us": floor_us,
                "roofline_us": roofline_us,
                "max_of_roofline": roofline_us / floor_us,
            }
        )
        if name == WEFT_STRUCTURE or name in WEFT_ROWS:
            rows[-1]["above_floor_us"] = floor_us - weft_floor_us
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_decode_shape_args(parser, [1, 8])
    opts = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("decode_floor.py needs a Hopper (or newer) GPU: its kernels launch with PDL")
    args = preset_args(opts.model)
    cache_len = opts.prompt_len + opts.decode_steps
    if cache_len > args.max_seq_len:
        raise SystemExit(
            f"--prompt-len + --decode-steps = {cache_len} positions exceed {opts.model}'s max_seq_len "
            f"{args.max_seq_len} (its rotary table and serve.py stop there): shorten them"
        )
    bandwidth = memory_bandwidth(torch.device("cuda"))
    rows = []
    for fp8 in (False, True):
        for batch in opts.batch_sizes:
            rows += floor_rows(args, batch, cache_len, fp8, bandwidth)
            torch.cuda.empty_cache()
    write_results(
        f"decode_floor-{opts.model}",
        rows,
        notes=(
            f"`python -m benchmarks.decode_floor --model {opts.model} --batch-sizes "
            f"{' '.join(map(str, opts.batch_sizes))}`: cache {cache_len} positions; floor_us: the step's "
            "kernels replaced one for one by plain streaming kernels moving their bytes (module docstring), "
            "one CUDA graph with PDL; in the rows \"weft's ...\", weft's structure with that class of "
            "ops (all: \"all weft's kernels\") launched as weft's own kernels instead, the rest stand-ins; "
            f"roofline_us: weights + KV cache over the copy bandwidth ({bandwidth / 1e12:.2f} TB/s); "
            "max_of_roofline: the most of the roofline a step of that launch structure (with those of weft's "
            f"kernels) can reach; above_floor_us: floor_us less that of {WEFT_STRUCTURE!r} at the same dtype "
            "and batch, what a class of weft's kernels costs beyond moving its bytes (ablation under PDL: "
            "the classes' figures need not add up to all kernels', as overlap with neighbours changes)"
        ),
    )


if __name__ == "__main__":
    main()

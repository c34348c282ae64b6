"""All-gather + matmul (kernels/ag_matmul.py).

CPU (Triton interpreter, gloo):
* the tile schedule of the kernel itself (`_tile_coords`, run in a small kernel): every output tile of
  every weight exactly once, own rank first then arrival order, splits in order inside a rank, and each
  tile's split covering its rows in the host's copy plan;
* the persistent GEMM kernel's math with every flag already set, on a pre-gathered A: ragged rows, K
  and N, 1-3 weights, both weight layouts, several pieces (dim=1 with B > 1). fp16 here: the
  interpreter's tl.dot mishandles bf16 (it multiplies the raw bits); the GPU tests run bf16;
* layout math, input validation and the fallback rules; the reference and the fake op against a plain
  gather with gloo.
GPU (2 and 4 ranks, NCCL beside): the registered op against all_gather_into_tensor + matmul at bf16
tolerance on fresh inputs, ragged shapes, 1 and 3 weights, both layouts, dim=1 with B=2, outputs
poisoned; CUDA-graph capture with replays on fresh inputs mixed with eager calls; a rank that never
enters -> SymmMemTimeout naming it.
"""

import ctypes
import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels import ag_matmul as ag
from kernels.symm_mem import SymmMemTimeout, size_class
from tests.multiprocess import GPU_WORLDS, TIMEOUT_TEST_S, rank_gpu, run_ranks
from tests.sm90 import compile_ptx, run_without_interpreter

# ------------------------------------------------------------------------------------ CPU: schedule


@triton.jit
def _coords_kernel(
    out_ptr, total, tiles_per_rank, tiles_per_piece, nt0, nt1, nt2, nt3,
    RANK: tl.constexpr, WORLD: tl.constexpr, NUM_W: tl.constexpr, SPLITS: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    for start in range(0, total, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        mask = tile < total
        src, q, piece, row_tile, w, n_tile = ag._tile_coords(
            tile, tiles_per_rank, tiles_per_piece, nt0, nt1, nt2, nt3, RANK, WORLD, NUM_W, SPLITS, GROUP_M
        )
        tl.store(out_ptr + tile * 6 + 0, src, mask=mask)
        tl.store(out_ptr + tile * 6 + 1, q, mask=mask)
        tl.store(out_ptr + tile * 6 + 2, piece, mask=mask)
        tl.store(out_ptr + tile * 6 + 3, row_tile, mask=mask)
        tl.store(out_ptr + tile * 6 + 4, w, mask=mask)
        tl.store(out_ptr + tile * 6 + 5, n_tile, mask=mask)


def schedule(
    rank: int, world: int, pieces: int, rows: int, block_m: int, n_tiles: list[int], splits: int, group_m: int
) -> list[list[int]]:
    """(src, split, piece, row tile, weight, column tile) of every tile, in schedule order."""
    per_piece = triton.cdiv(rows, block_m)
    tiles_per_rank = pieces * per_piece
    total = world * tiles_per_rank * sum(n_tiles)
    out = torch.full((total, 6), -1, dtype=torch.int32)
    nts = n_tiles + [0] * (ag.MAX_WEIGHTS - len(n_tiles))
    _coords_kernel[(1,)](
        out, total, tiles_per_rank, per_piece, *nts,
        RANK=rank, WORLD=world, NUM_W=len(n_tiles), SPLITS=splits, GROUP_M=group_m, BLOCK=256,
    )  # fmt: skip
    return out.tolist()


SCHEDULE_CASES = [  # rank, world, pieces, rows, block_m, n_tiles per weight, splits, group_m
    (0, 2, 1, 1000, 128, [5], 4, 8),
    (1, 2, 1, 129, 128, [3, 1, 2], 2, 8),
    (3, 4, 2, 300, 64, [4, 4], 3, 4),
    (2, 4, 3, 17, 16, [7], 1, 8),
    (5, 8, 2, 512, 128, [2, 1, 1, 3], 4, 2),
    (7, 8, 1, 64, 128, [1], 1, 8),
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_tile_schedule(case) -> None:
    rank, world, pieces, rows, block_m, n_tiles, splits, group_m = case
    splits = min(splits, pieces * triton.cdiv(rows, block_m))
    coords = schedule(rank, world, pieces, rows, block_m, n_tiles, splits, group_m)
    per_piece = triton.cdiv(rows, block_m)
    expected = {
        (p, i, w, j)
        for p in range(pieces * world)
        for i in range(per_piece)
        for w, nt in enumerate(n_tiles)
        for j in range(nt)
    }
    seen = [(piece, row_tile, w, j) for _, _, piece, row_tile, w, j in coords]
    assert len(seen) == len(set(seen)) == len(expected) and set(seen) == expected, "every tile exactly once"
    layout = ag.GatherLayout(pieces, rows, 8, world)
    plan = ag.copy_plan(layout, block_m, splits)
    order = []
    for src, q, piece, row_tile, _, _ in coords:
        assert piece % world == src, "a tile's rows come from the rank the tile waits for"
        order.append(((src - rank) % world, q))
        b, lo = piece // world, row_tile * block_m
        hi = min(lo + block_m, rows)
        assert any(pb == b and plo <= lo and hi <= phi for pb, plo, phi in plan[q]), (
            f"split {q}'s copies do not cover rows [{lo}, {hi}) of piece {b}"
        )
    assert order == sorted(order), "own rank first, then rank+1, ...; splits in order inside a rank"


@pytest.mark.parametrize(
    "pieces,rows,block_m,splits", [(1, 1000, 128, 4), (3, 17, 16, 2), (2, 300, 64, 5), (4, 1, 128, 3)]
)
def test_copy_plan_covers_every_row_once(pieces: int, rows: int, block_m: int, splits: int) -> None:
    splits = min(splits, pieces * triton.cdiv(rows, block_m))
    plan = ag.copy_plan(ag.GatherLayout(pieces, rows, 8, 2), block_m, splits)
    assert len(plan) == splits and all(plan), "every split copies something"
    covered = torch.zeros(pieces, rows, dtype=torch.int32)
    for ranges in plan:
        for b, lo, hi in ranges:
            assert lo % block_m == 0 and lo < hi <= rows
            covered[b, lo:hi] += 1
    assert bool((covered == 1).all())
    sizes = [sum(triton.cdiv(hi - lo, block_m) for _, lo, hi in ranges) for ranges in plan]
    assert max(sizes) - min(sizes) <= 1, f"splits unbalanced: {sizes}"


@pytest.mark.parametrize(
    "pieces,rows,k,block_m,splits,world", [(1, 1000, 24, 128, 4, 4), (3, 17, 8, 16, 2, 2)]
)
def test_row_copies_gather_every_rank(
    pieces: int, rows: int, k: int, block_m: int, splits: int, world: int
) -> None:
    """The side stream's copies, run with memmove on CPU tensors' addresses as the copy engines run
    them: every rank's shard lands at its rows of the gathered `a`."""
    layout = ag.GatherLayout(pieces, rows, k, world)
    splits = min(splits, pieces * triton.cdiv(rows, block_m))
    shards = [torch.randn(pieces, rows, k).half() for _ in range(world)]
    gathered = torch.full((pieces, world, rows, k), float("nan")).half()
    for src in range(world):
        for ranges in ag.row_copies(layout, block_m, splits, src, gathered.element_size()):
            for to, start, count in ranges:
                ctypes.memmove(gathered.data_ptr() + to, shards[src].data_ptr() + start, count)
    assert torch.equal(gathered, torch.stack(shards, dim=1))


# ------------------------------------------------------------------------------------ CPU: GEMM math

MATH_CASES = [  # world, rank, pieces, rows, K, Ns, [K, N] layout, splits
    (2, 0, 1, 37, 40, [24], True, 2),
    (2, 1, 1, 16, 16, [8, 40, 16], False, 1),
    (4, 2, 2, 13, 56, [24, 16, 32], True, 3),
    (4, 3, 3, 9, 24, [40, 8], False, 2),
]


@pytest.mark.parametrize("case", MATH_CASES)
def test_gemm_kernel_math(case) -> None:
    world, rank, pieces, rows, k, ns, kn, splits = case
    layout = ag.GatherLayout(pieces, rows, k, world)
    a = torch.randn(pieces, world, rows, k).half()
    own = a[:, rank].clone()
    a_out = a.clone()
    a_out[:, rank] = float("nan")  # the kernel reads this rank's rows from `own` only
    bs = [torch.randn(k, n).half() if kn else torch.randn(n, k).half().t() for n in ns]
    outs = [torch.full((pieces, world, rows, n), float("nan")).half() for n in ns]
    cfg = ag.GemmConfig(16, 16, 16, 2, 4, 2, splits)
    flags = torch.ones(world * splits + 1, dtype=torch.int32)  # every copy already landed
    status = torch.zeros(4, dtype=torch.int32)
    ag.launch_gemm(own, a_out, layout, bs, outs, flags, status, rank, cfg, 5, 10**9)
    assert status.tolist() == [0, 0, 0, 0]
    for i, (b, out) in enumerate(zip(bs, outs, strict=True)):
        ref = a.float() @ b.float()
        assert not out.isnan().any(), f"weight {i}: tiles left unwritten"
        err = (out.float() - ref).norm() / ref.norm()
        assert err < 2e-3, f"weight {i}: relative error {err:.2e}"


def _compile_sm90(world: int, config: ag.GemmConfig, b_kn: bool, num_w: int) -> str:
    """PTX of the GEMM for sm_90, with the signature and specialization a launch gives."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    b_block = f"[{bk},{bn}]" if b_kn else f"[{bn},{bk}]"
    sig = {"own_desc": f"tensordesc<bf16[1,{bm},{bk}]>", "a_desc": f"tensordesc<bf16[1,{bm},{bk}]>"}
    sig.update({f"b{i}_desc": f"tensordesc<bf16{b_block}>" for i in range(num_w)})
    c_block = f"[1,{bm},{bn // config.epilogue_split}]"
    sig.update({f"c{i}_desc": f"tensordesc<bf16{c_block}>" for i in range(num_w)})
    sig.update({"flags_ptr": "*u32", "status_ptr": "*i32", "timeout_ns": "i64"})
    sig.update(dict.fromkeys(["k", "tiles_per_piece", "pieces", "nt0", "nt1", "nt2", "nt3"], "i32"))
    const = {"RANK": world - 1, "WORLD": world, "NUM_W": num_w, "SPLITS": config.splits, "B_KN": b_kn,
             "BM": bm, "BN": bn, "BK": bk, "GROUP_M": config.group_m, "OP_ID": 1, "FENCE": True,
             "FLAT": config.flatten, "EPI": config.epilogue_split}  # fmt: skip
    # A launch passes None for the weight slots past NUM_W (launch_gemm).
    const.update({f"{x}{i}_desc": None for x in "bc" for i in range(num_w, ag.MAX_WEIGHTS)})
    return compile_ptx(
        ag._ag_matmul_kernel, sig, const, ("flags_ptr", "status_ptr"),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def check_sm90_ptx() -> None:
    """Compile the GEMM for sm_90 with the table's configs and every config the benchmark sweeps (one
    weight, nn.Linear layout, as the benchmark runs them), and check the PTX has what the design relies
    on. Runs in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit)."""
    from benchmarks.bench_ag_matmul import SWEEP

    cases = [
        (4, ag.pick_config(n), kn, num_w)
        for n, kn, num_w in [(7168, False, 1), (1000, True, 3), (14336, False, 4)]
    ]
    cases += [(4, cfg, False, 1) for cfg in SWEEP]
    cases.append((8, next(cfg for cfg in SWEEP if cfg.flatten), True, 3))  # several K loops, unflattened
    for world, config, b_kn, num_w in cases:
        ptx = _compile_sm90(world, config, b_kn, num_w)
        what = f"world {world} {config} kn={b_kn} weights {num_w}"
        assert "wgmma" in ptx and "cp.async.bulk.tensor" in ptx, f"{what}: no wgmma / TMA loads"
        assert "ld.acquire.sys" in ptx and "%globaltimer" in ptx, f"{what}: waits must be bounded acquires"
        assert "fence.proxy.async" in ptx, f"{what}: no proxy fence between the flag and the TMA loads"


def test_kernel_compiles_for_sm90() -> None:
    run_without_interpreter("tests.test_ag_matmul")


def test_launch_gemm_refuses_mixed_layouts() -> None:
    layout = ag.GatherLayout(1, 16, 16, 2)
    a = torch.zeros(1, 2, 16, 16).half()
    bs = [torch.zeros(16, 8).half(), torch.zeros(8, 16).half().t()]
    outs = [torch.zeros(1, 2, 16, 8).half()] * 2
    with pytest.raises(ValueError, match="share a layout"):
        ag.launch_gemm(
            a[:, 0].contiguous(),
            a,
            layout,
            bs,
            outs,
            torch.ones(3, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32),
            0,
            ag.GemmConfig(16, 16, 16, 1, 4, 1, 1),
            1,
            1,
        )


ALONE_CASES = [  # world, rank, gathered a's shape, dim, Ns, [K, N] layout, config
    (2, 1, (74, 40), 0, [24], True, ag.GemmConfig(16, 16, 16, 2, 4, 2, 2)),
    (4, 2, (2, 52, 24), 1, [40, 8, 16, 24, 8], False, ag.GemmConfig(16, 32, 16, 1, 4, 2, 3)),
    (8, 5, (3, 16, 16), 1, [16, 8], True, ag.GemmConfig(16, 16, 8, 4, 4, 3, 1)),
    # The sweep's options: the C tile stored in halves; the flattened loop (its own wait on the GPU).
    (4, 1, (2, 52, 24), 1, [40, 24], True, ag.GemmConfig(16, 32, 16, 2, 4, 2, 2, epilogue_split=2)),
    (4, 3, (100, 24), 0, [24, 8], False, ag.GemmConfig(16, 16, 16, 2, 4, 2, 2, flatten=True)),
]


@pytest.mark.parametrize("case", ALONE_CASES)
def test_gemm_alone_equals_matmul(case) -> None:
    """The GEMM of a call with the gather taken out (what `--gemm-alone` times): the same launches over
    every tile, flags set, more weights than one launch takes; outputs poisoned before each run."""
    world, rank, shape, dim, ns, kn, config = case
    a = torch.randn(shape).half()
    bs = [torch.randn(shape[-1], n).half() if kn else torch.randn(n, shape[-1]).half().t() for n in ns]
    alone = ag.GemmAlone(a, bs, dim, rank, world, config, num_sms=3)
    assert alone.config == ag.resolve_config(alone.layout, bs, config), "the call's config picking"
    for _ in range(2):
        for out in alone.outs:
            out.fill_(float("nan"))
        outs = alone.run()
        assert alone.status.tolist() == [0, 0, 0, 0]
        for i, (b, out) in enumerate(zip(bs, outs, strict=True)):
            ref = a.float() @ b.float()
            assert not out.isnan().any(), f"weight {i}: tiles left unwritten"
            err = (out.float() - ref).norm() / ref.norm()
            assert err < 2e-3, f"weight {i}: relative error {err:.2e}"


def test_gemm_alone_validates() -> None:
    a, b = torch.zeros(12, 16).half(), torch.zeros(16, 8).half()
    with pytest.raises(ValueError, match="not in a world of 4"):
        ag.GemmAlone(a, [b], 0, 4, 4, num_sms=1)
    with pytest.raises(ValueError, match="not 8 shards"):
        ag.GemmAlone(a, [b], 0, 0, 8, num_sms=1)
    with pytest.raises(ValueError, match="epilogue_split must be 1 or 2"):
        ag.GemmAlone(
            a, [b], 0, 0, 4, ag.GemmConfig(16, 16, 16, 1, 4, 1, 1, epilogue_split=4), num_sms=1
        ).run()


# ------------------------------------------------------------------------------------ CPU: layout, validation


def test_buffer_regions() -> None:
    """Three regions per buffer, each holding a whole shard of every size the buffer serves; eager calls
    alternate 0 and 1 per buffer, captured calls take region 2 and leave the count alone."""
    for shard_bytes in (16, 1000, 256, 3 << 20, (3 << 20) + 48):
        nbytes = size_class(ag.buffer_bytes(shard_bytes))
        for smaller in (16, shard_bytes // 2 // 16 * 16 or 16, shard_bytes):
            if size_class(ag.buffer_bytes(smaller)) == nbytes:
                assert ag.region_offset(nbytes, 1) >= smaller, (shard_bytes, smaller)
        assert ag.region_offset(nbytes, 2) + shard_bytes <= nbytes
        assert ag.region_offset(nbytes, 1) % ag.REGION_ALIGN == 0
    key = ("test-group", 1 << 20)
    regions = [ag.next_region(key, capturing) for capturing in (False, False, True, False, True)]
    assert regions == [0, 1, 2, 0, 2]
    assert ag.next_region(("other", 1 << 20), False) == 0


def test_gather_layout() -> None:
    assert ag.gather_layout((4, 8, 16), 1, 2) == ag.GatherLayout(4, 8, 16, 2)
    assert ag.gather_layout((4, 8, 16), 0, 2) == ag.GatherLayout(1, 32, 16, 2)
    assert ag.gather_layout((2, 3, 5, 16), -3, 4) == ag.GatherLayout(2, 15, 16, 4)
    assert ag.gather_layout((6, 16), 0, 8).gathered_shape((6, 16), 0) == [48, 16]
    with pytest.raises(ValueError, match="last"):
        ag.gather_layout((4, 16), 1, 2)


def test_check_inputs_and_fallback_rules() -> None:
    a = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs \[64, N\]"):
        ag.check_inputs(a, [w], 1)  # an nn.Linear weight passed without .t()
    with pytest.raises(ValueError, match="one dtype"):
        ag.check_inputs(a, [w.t().float()], 1)
    with pytest.raises(ValueError, match="at least one weight"):
        ag.check_inputs(a, [], 1)
    ag.check_inputs(a, [w.t()], 1)
    assert ag.fallback_reason(a, [w.t()], 1, 4) is None
    assert ag.fallback_reason(a, [w.t().contiguous()], 1, 2) is None
    assert "world size 3" in ag.fallback_reason(a, [w.t()], 1, 3)
    assert "dtype" in ag.fallback_reason(a.float(), [w.t().float()], 1, 2)
    assert "last dim" in ag.fallback_reason(a, [w.t()], 2, 2)
    assert "multiple of 8" in ag.fallback_reason(a[..., :60], [w[:, :60].t()], 1, 2)
    assert "mixed layouts" in ag.fallback_reason(a, [w.t(), w.t().contiguous()], 1, 2)
    assert "neither" in ag.fallback_reason(a, [w.t()[:, ::2]], 1, 2)


def test_pick_config_and_dispatch() -> None:
    assert ag.pick_config(1000).block_n == 128
    assert ag.pick_config(2560).block_n == 256
    assert ag.pick_config(14336).block_n == 256
    from parallel.comm import _find_kernel

    assert _find_kernel("all_gather_matmul") is ag.all_gather_matmul


def test_table_splits_follow_the_rows_per_rank() -> None:
    """The table's copy chunks hold at least MIN_TILES_PER_SPLIT row tiles (one chunk for a few rows); an
    explicit config keeps its splits, only clamped to the row tiles."""
    b = [torch.empty(4096, 7168)]
    block_m = ag.pick_config(7168).block_m
    for rows_per_rank, expected in ((100, 1), (8 * block_m, 1), (32 * block_m, 2), (64 * block_m, 4)):
        layout = ag.GatherLayout(1, rows_per_rank, 4096, 4)
        assert ag.resolve_config(layout, b, None).splits == expected, rows_per_rank
    explicit = dataclasses.replace(ag.pick_config(7168), splits=3)
    assert ag.resolve_config(ag.GatherLayout(1, 8 * block_m, 4096, 4), b, explicit).splits == 3
    assert ag.resolve_config(ag.GatherLayout(1, 2 * block_m, 4096, 4), b, explicit).splits == 2


def _reference_on_rank(rank: int, world: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape, dim in (((2, 3, 16), 1), ((5, 16), 0), ((3, 2, 16), 0)):
        torch.manual_seed(rank)
        shard = torch.randn(shape)
        bs = [torch.randn(16, 8), torch.randn(24, 16).t()]
        a, outs = ag.all_gather_matmul_reference(shard, bs, dim)
        parts = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(parts, shard)
        expect = torch.cat(parts, dim=dim)
        assert torch.equal(a, expect), f"gathered {shape} along {dim}"
        for b, out in zip(bs, outs, strict=True):
            torch.testing.assert_close(out, expect @ b)
        with FakeTensorMode():
            fake = torch.ops.weft.all_gather_matmul(
                torch.empty(shape), [torch.empty(16, 8)], dim, dist.group.WORLD.group_name
            )
        gathered = list(shape)
        gathered[dim] *= world
        assert [list(t.shape) for t in fake] == [gathered, [*gathered[:-1], 8]]
    with pytest.raises(ValueError, match="needs CUDA"):
        ag.all_gather_matmul(torch.zeros(2, 16), [torch.zeros(16, 8)], 0)


def test_reference_and_fake_gloo() -> None:
    run_ranks(_reference_on_rank, 2)


# ------------------------------------------------------------------------------------ GPU

GPU_CASES = [  # shard shape, dim, Ns, weights as [K, N] (else weight.t() views)
    ((256, 512), 0, [768], False),
    ((129, 4000), 0, [1000], True),
    ((129, 4000), 0, [1000, 24, 264], False),
    ((2, 192, 1024), 1, [2048, 256, 256], False),
    ((2, 77, 520), 1, [136], True),
    ((1, 1024, 4096), 1, [3072], False),
    ((3, 64, 256), 0, [512, 128], True),
    ((2, 40, 256), -2, [64, 8, 136, 72, 64], False),  # 5 weights: two launches over one gather
]
BF16_RTOL = 1.6e-2


def _reference(
    shard: torch.Tensor, bs: list[torch.Tensor], dim: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    world = dist.get_world_size()
    dim %= shard.dim()
    flat = torch.empty((world * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(flat, shard.contiguous())
    a = flat.unflatten(0, (world, -1)).movedim(0, dim).flatten(dim, dim + 1) if dim else flat
    return a, [a.float() @ b.float() for b in bs]


def _check(a, outs, ref_a, ref_outs, what: str) -> None:
    assert torch.equal(a, ref_a), f"{what}: gathered A differs from all_gather_into_tensor"
    for i, (out, ref) in enumerate(zip(outs, ref_outs, strict=True)):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{what}: output {i} {out.shape}"
        assert not out.isnan().any(), f"{what}: output {i} has unwritten (NaN) elements"
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < BF16_RTOL / 4, f"{what}: output {i} relative error {err:.2e}"


def _weights(k: int, ns: list[int], kn: bool, dev) -> list[torch.Tensor]:
    if kn:
        return [torch.randn(k, n, device=dev, dtype=torch.bfloat16) / math.sqrt(k) for n in ns]
    return [(torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)).t() for n in ns]


def _poisoned_call(shard, bs, dim, op=None):
    """The op (default: the entry point), after NaN-filling and freeing blocks of its outputs' sizes:
    the caching allocator hands those blocks to the op's outputs, so an element the kernel misses
    stays NaN."""
    shape = list(shard.shape)
    shape[dim] *= dist.get_world_size()
    sizes = [shape] + [[*shape[:-1], b.shape[1]] for b in bs]
    junk = [torch.full(s, float("nan"), device=shard.device, dtype=shard.dtype) for s in sizes]
    del junk
    return (op or ag.all_gather_matmul)(shard, bs, dim)


def _correctness(rank: int, world: int) -> None:
    dev = rank_gpu()
    for shape, dim, ns, kn in GPU_CASES:
        for trial in range(2):
            torch.manual_seed(1000 * trial + 17 * rank + len(ns))
            shard = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            torch.manual_seed(trial)  # weights equal on every rank, as in tensor parallelism
            bs = _weights(shape[-1], ns, kn, dev)
            assert ag.fallback_reason(shard, bs, dim, world) is None, "this case must run the kernel"
            a, outs = _poisoned_call(shard, bs, dim)
            torch.cuda.synchronize()
            ag.check()
            _check(a, outs, *_reference(shard, bs, dim), f"rank {rank} {shape} dim={dim} N={ns} kn={kn}")
    # The flattened loop of the sweep: its unbranched wait must hold the peers' rows back as well.
    flat = ag.GemmConfig(128, 128, 64, 8, 4, 4, 4, flatten=True)
    for shape, dim, ns, kn in (GPU_CASES[2], GPU_CASES[3], GPU_CASES[5]):
        torch.manual_seed(17 * rank)
        shard = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        torch.manual_seed(1)
        bs = _weights(shape[-1], ns, kn, dev)
        flat_op = functools.partial(ag.all_gather_matmul_kernel, group=dist.group.WORLD, config=flat)
        a, outs = _poisoned_call(shard, bs, dim, flat_op)
        torch.cuda.synchronize()
        ag.check()
        _check(a, outs, *_reference(shard, bs, dim), f"rank {rank} flatten {shape} dim={dim} N={ns}")
    # The fallback (fp32) goes through the same entry point.
    shard = torch.randn(64, 64, device=dev)
    a, outs = ag.all_gather_matmul(shard, [torch.ones(64, 8, device=dev)], 0)
    torch.testing.assert_close(outs[0], a @ torch.ones(64, 8, device=dev))


def _graphs(rank: int, world: int) -> None:
    dev = rank_gpu()
    shards = [
        torch.zeros(2, 96, 512, device=dev, dtype=torch.bfloat16),
        torch.zeros(300, 512, device=dev, dtype=torch.bfloat16),
    ]
    torch.manual_seed(5)
    w3 = _weights(512, [384, 128, 128], False, dev)
    w1 = _weights(512, [1024], True, dev)
    calls = [(shards[0], w3, 1), (shards[1], w1, 0), (shards[0], w1, 1)]
    results: list = [None] * len(calls)

    def step() -> None:
        for i, (shard, bs, dim) in enumerate(calls):
            results[i] = ag.all_gather_matmul(shard, bs, dim)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: allocates the symmetric buffers and compiles, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    captured = list(results)
    for replay in range(6):
        torch.manual_seed(100 * replay + rank)
        for shard in shards:
            shard.copy_(torch.randn_like(shard))
        for a, outs in captured:
            a.fill_(float("nan"))
            for out in outs:
                out.fill_(float("nan"))
        graph.replay()
        if replay % 2:
            eager = torch.randn(40, 512, device=dev, dtype=torch.bfloat16)
            _check(
                *ag.all_gather_matmul(eager, w1, 0),
                *_reference(eager, w1, 0),
                f"eager between replays {replay}",
            )
        torch.cuda.synchronize()
        ag.check()
        for (shard, bs, dim), (a, outs) in zip(calls, captured, strict=True):
            _check(a, outs, *_reference(shard, bs, dim), f"rank {rank} replay {replay} {tuple(shard.shape)}")


def _timeout(rank: int, world: int) -> None:
    dev = rank_gpu()
    group = dist.new_group(list(range(world)))
    absent = world - 1
    shard = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    bs = _weights(256, [128], True, dev)
    ag.prepare(group, shard.numel() * shard.element_size())
    dist.barrier()
    if rank != absent:
        ag.all_gather_matmul_kernel(shard, bs, 0, group, timeout_s=TIMEOUT_TEST_S)
        torch.cuda.synchronize()
        with pytest.raises(
            SymmMemTimeout, match=rf"rank {rank}: all_gather_matmul .* waiting for rank {absent}"
        ):
            ag.check(group)
    torch.cuda.synchronize()
    dist.barrier()


def _run_on_rank(rank: int, world: int) -> None:
    _correctness(rank, world)
    _graphs(rank, world)
    _timeout(rank, world)


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_ag_matmul_gpu(world: int) -> None:
    run_ranks(_run_on_rank, world, backend="nccl")


@pytest.mark.gpu
def test_gemm_alone_gpu() -> None:
    """On one GPU, bf16: the GEMM alone (what `--gemm-alone` times) with the table's config and every
    config of the benchmark's sweep (the flattened loop's own wait included, which the interpreter
    skips), ragged rows (M/W = 129), K and N, against torch.matmul; outputs poisoned."""
    from benchmarks.bench_ag_matmul import SWEEP

    torch.manual_seed(0)
    a = torch.randn(4 * 129, 3008, device="cuda", dtype=torch.bfloat16)
    bs = [
        (torch.randn(n, 3008, device="cuda", dtype=torch.bfloat16) / math.sqrt(3008)).t()
        for n in (1000, 2048)
    ]
    for config in (None, *SWEEP):
        alone = ag.GemmAlone(a, bs, 0, 1, 4, config)
        for out in alone.outs:
            out.fill_(float("nan"))
        outs = alone.run()
        for i, (b, out) in enumerate(zip(bs, outs, strict=True)):
            ref = a.float() @ b.float()
            assert not out.isnan().any(), f"{alone.config} weight {i}: tiles left unwritten"
            err = ((out.float() - ref).norm() / ref.norm()).item()
            assert err < BF16_RTOL / 4, f"{alone.config} weight {i}: relative error {err:.2e}"

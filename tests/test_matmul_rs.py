"""Matmul + reduce-scatter (kernels/matmul_rs.py).

CPU (Triton interpreter, gloo):
* the tile schedule of the kernel itself (`_tile_coords`, run in a small kernel): every tile of every
  destination exactly once, destinations in the order rank + 1, ..., rank (own rows last), T tiles
  per destination (the flags each peer sets per call), the same order inside a step on every rank;
* both launches, staging, chunk counters, flags, credits and reduction included, on W simulated ranks
  in one process: every rank's stage launch, then its copy streams' work done by the test from the
  call's own copy plan (`copy_plan`, on the CPU tensors' addresses: every credit taken by the stage
  launch, each counter at its target, each chunk's bytes copied into the destination's received slot
  and its flag raised there), then every rank's own launch, flag reset and credit grants (a single
  interpreted program cannot wait for another). Every received slot holds its source's staged
  partial. Up to three calls in a row, ragged rows, K and N, several pieces (dim=1 with B > 1), both
  weight layouts, outputs poisoned, received slots random until copied. fp16 here: the interpreter's
  tl.dot mishandles bf16; the GPU tests run bf16. The bounded spin (inline PTX) and the copy streams
  (stream memory operations) cannot run on a CPU: the timeout and the streams' ordering are tested on
  GPUs;
* the chunks of a slot: consecutive, covering it, GROUP_M row tiles each;
* the kernels compiled for sm_90 (no GPU needed): fit in shared memory, use wgmma and TMA loads,
  16-byte stores and reads, released counters, bounded acquire waits;
* layout math, input validation and the fallback rules; the reference and the fake op with gloo.
GPU (2 and 4 ranks, NCCL beside): the registered op against torch.matmul + reduce_scatter_tensor at
bf16 tolerance on fresh inputs, ragged N, K and rows (M/W = 129), both b layouts, dim=1 with B=2,
outputs poisoned; CUDA-graph capture with replays on fresh inputs mixed with eager calls; a rank that
never enters -> SymmMemTimeout naming it; two ranks with CUDA_LAUNCH_BLOCKING=1, where a rank's own
launch ends only if its peers queued their copies before their own launches.
"""

import ctypes
import itertools
import math

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels import matmul_rs as mrs
from kernels.symm_mem import SymmMemTimeout
from parallel.comm import TorchComm
from tests.multiprocess import GPU_WORLDS, TIMEOUT_TEST_S, rank_gpu, run_ranks
from tests.sm90 import compile_ptx, ptxas_log, run_without_interpreter, spill_stores

# ------------------------------------------------------------------------------------ CPU: schedule


@triton.jit
def _coords_kernel(
    out_ptr, total, tiles_per_dest, row_tiles, n_tiles,
    RANK: tl.constexpr, WORLD: tl.constexpr, GROUP_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    for start in range(0, total, BLOCK):
        tile = start + tl.arange(0, BLOCK)
        mask = tile < total
        dest, m, j = mrs._tile_coords(tile, tiles_per_dest, row_tiles, n_tiles, RANK, WORLD, GROUP_M)
        tl.store(out_ptr + tile * 3 + 0, dest, mask=mask)
        tl.store(out_ptr + tile * 3 + 1, m, mask=mask)
        tl.store(out_ptr + tile * 3 + 2, j, mask=mask)


def schedule(rank: int, world: int, row_tiles: int, n_tiles: int, group_m: int) -> list[tuple[int, int, int]]:
    """(destination, row tile, column tile) of every tile, in schedule order."""
    total = world * row_tiles * n_tiles
    out = torch.full((total, 3), -1, dtype=torch.int32)
    _coords_kernel[(1,)](
        out, total, row_tiles * n_tiles, row_tiles, n_tiles,
        RANK=rank, WORLD=world, GROUP_M=group_m, BLOCK=256,
    )  # fmt: skip
    return [tuple(t) for t in out.tolist()]


SCHEDULE_CASES = [  # world, row tiles per destination, column tiles, group_m
    (2, 1, 1, 8),
    (2, 9, 5, 8),
    (4, 16, 16, 8),
    (4, 3, 7, 2),
    (8, 17, 3, 4),
    (8, 20, 12, 8),
]


@pytest.mark.parametrize("case", SCHEDULE_CASES)
def test_tile_schedule(case) -> None:
    world, row_tiles, n_tiles, group_m = case
    per_dest = row_tiles * n_tiles
    inner = None
    for rank in range(world):
        coords = schedule(rank, world, row_tiles, n_tiles, group_m)
        expected = {(d, m, j) for d in range(world) for m in range(row_tiles) for j in range(n_tiles)}
        assert len(coords) == len(set(coords)) == len(expected) and set(coords) == expected, "each tile once"
        for step in range(world):
            block = coords[step * per_dest : (step + 1) * per_dest]
            assert {d for d, _, _ in block} == {(rank + 1 + step) % world}, f"step {step}'s destination"
            # The counter target: a destination receives exactly T tiles (one flag each) per source.
            assert len(block) == per_dest
        assert coords[-1][0] == rank, "own rows last"
        order = [(m, j) for _, m, j in coords[:per_dest]]
        assert inner is None or order == inner, "the same (row tile, column tile) order on every rank"
        inner = order
    # Group-M: the first group_m row tiles' tiles come first (they share B tiles in L2).
    first = inner[: min(group_m, row_tiles) * n_tiles]
    assert {m for m, _ in first} == set(range(min(group_m, row_tiles)))


# ------------------------------------------------------------------------------------ CPU: simulated ranks


class SimulatedWorld:
    """W ranks' buffers as CPU tensors in one process: staging slots, counters, received slots (random
    bytes until copied), flag buffers ([credits | chunk flags]) and status words per rank."""

    def __init__(self, world: int, layout: mrs.ScatterLayout, config: mrs.GemmConfig) -> None:
        self.world, self.layout, self.config = world, layout, config
        slots = (world - 1) * layout.slot_numel()
        flags = (world - 1) * layout.chunk_count(config)
        self.flag_buffers = [torch.zeros(mrs.CREDITS + flags, dtype=torch.int32) for _ in range(world)]
        for fb in self.flag_buffers:
            fb[: mrs.CREDITS] = 1  # as a group's state starts
        self.buffers = [
            mrs.CallBuffers(
                staging=torch.full((slots,), float("nan")).half(),
                counters=torch.zeros(flags, dtype=torch.int32),
                received=torch.randint(0, 255, (slots * 2,), dtype=torch.uint8).view(torch.float16),
                flags=fb[mrs.CREDITS :],
                status=torch.zeros(4, dtype=torch.int32),
                credits=fb[: mrs.CREDITS],
                credited=torch.zeros(1, dtype=torch.int32),
            )
            for fb in self.flag_buffers
        ]

    def plan(self, rank: int):
        """`mrs.copy_plan` of rank `rank`, on these CPU tensors' addresses."""
        return mrs.copy_plan(
            self.layout, self.config, rank, [b.received.data_ptr() for b in self.buffers],
            [fb.data_ptr() for fb in self.flag_buffers], self.buffers[rank].staging.data_ptr(),
            self.buffers[rank].counters.data_ptr(),
        )  # fmt: skip

    def copy(self, rank: int) -> None:
        """What rank `rank`'s copy streams do, from the call's own copy plan: find `credited` set by
        the stage launch (which took every peer's credit), reset it, then per chunk find the counter
        at its target, reset it, copy the chunk's bytes and raise its flag in the destination's flag
        buffer."""
        own = self.buffers[rank]
        assert own.credited.item() == 1, f"rank {rank}: the stage launch did not take its credits"
        own.credited.zero_()
        assert all(own.credits[d] == 0 for d in range(self.world) if d != rank), f"rank {rank}: credits"
        steps, _ = self.plan(rank)
        for step, ops in enumerate(steps):
            for counter, target, dst, src, nbytes, flag in ops:
                count = ctypes.c_int32.from_address(counter)
                assert count.value == target, f"rank {rank} step {step}: counter {count.value}, not {target}"
                count.value = 0
                ctypes.memmove(dst, src, nbytes)
                ctypes.c_int32.from_address(flag).value = 1

    def call(self, a: list[torch.Tensor], b: torch.Tensor, num_programs: int) -> list[torch.Tensor]:
        """One matmul-reduce-scatter over the simulated ranks: every rank's stage launch, the copies,
        then every rank's own launch, flag reset and credit grants (a single interpreted program cannot
        wait for another)."""
        layout, config = self.layout, self.config
        outs = [torch.full((layout.pieces, layout.rows, layout.n), float("nan")).half() for _ in a]
        for r in range(self.world):
            mrs.launch(a[r], b, outs[r], layout, self.buffers[r], r, config, num_programs, 10**9, "stage")
        for r in range(self.world):
            self.copy(r)
        for r in range(self.world):
            mrs.launch(a[r], b, outs[r], layout, self.buffers[r], r, config, num_programs, 10**9, "own")
            self.buffers[r].flags.zero_()
            for grant in self.plan(r)[1]:
                ctypes.c_int32.from_address(grant).value = 1
        return outs


MATH_CASES = [  # world, pieces, rows per destination, K, N, b as [K, N], BM BN BK, group_m, calls
    (2, 1, 37, 40, 24, True, (16, 16, 16), 2, 3),
    (4, 2, 13, 24, 40, False, (16, 32, 16), 1, 2),
    (4, 1, 1, 16, 8, True, (16, 16, 16), 2, 3),
    (8, 2, 5, 8, 16, False, (16, 16, 8), 3, 1),
]


@pytest.mark.parametrize("case", MATH_CASES)
def test_kernel_on_simulated_ranks(case) -> None:
    world, pieces, rows, k, n, kn, (bm, bn, bk), group_m, calls = case
    config = mrs.GemmConfig(bm, bn, bk, group_m, 4, 2)
    layout = mrs.ScatterLayout(pieces, rows, k, n, world)
    sim = SimulatedWorld(world, layout, config)
    for call in range(calls):
        a = [torch.randn(pieces, world, rows, k).half() for _ in range(world)]
        b = torch.randn(k, n).half() if kn else torch.randn(n, k).half().t()
        outs = sim.call(a, b, num_programs=3)
        total = sum(x.float() @ b.float() for x in a)  # [P, W, R, N]: rank d keeps [:, d]
        slot = layout.slot_numel()
        for r, d in itertools.permutations(range(world), 2):  # rank r's partial of d's rows, in place
            got = sim.buffers[d].received[((r - d) % world - 1) * slot :][:slot]
            sent = sim.buffers[r].staging[((d - r) % world - 1) * slot :][:slot]
            assert torch.equal(got, sent), f"call {call}: rank {d}'s slot of rank {r}"
        for r in range(world):
            assert sim.buffers[r].status.tolist() == [0, 0, 0, 0], f"rank {r}: a wait recorded a timeout"
            assert not outs[r].isnan().any(), f"rank {r}, call {call}: tiles left unwritten"
            ref = total[:, r]
            err = (outs[r].float() - ref).norm() / ref.norm()
            assert err < 2e-3, f"rank {r}, call {call}: relative error {err:.2e}"


CHUNK_CASES = [  # pieces, rows, n, config
    (1, 300, 24, mrs.GemmConfig(16, 16, 16, 4, 4, 2)),
    (3, 37, 40, mrs.GemmConfig(16, 32, 16, 2, 8, 2)),
    (2, 128, 8, mrs.GemmConfig(128, 128, 64, 8, 8, 4)),
    (5, 1, 16, mrs.GemmConfig(16, 16, 16, 3, 4, 2)),
]


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunks_tile_each_slot(case) -> None:
    """The copies' chunks: consecutive byte ranges covering a slot exactly, GROUP_M row tiles each
    (a piece's ragged last tile included), counter targets adding up to threads x tiles."""
    pieces, rows, n, config = case
    layout = mrs.ScatterLayout(pieces, rows, 16, n, 2)
    chunks = layout.chunks(config)
    assert chunks[0].offset == 0
    for before, after in itertools.pairwise(chunks):
        assert before.offset + before.nbytes == after.offset, "chunks are consecutive"
    assert chunks[-1].offset + chunks[-1].nbytes == layout.slot_numel() * 2, "chunks cover the slot"
    assert len(chunks) == math.ceil(layout.row_tiles(config) / config.group_m)
    assert sum(c.target for c in chunks) == layout.tiles_per_dest(config) * config.threads


def test_launch_validates_its_arguments() -> None:
    layout = mrs.ScatterLayout(1, 16, 16, 8, 2)
    config = mrs.GemmConfig(16, 16, 16, 1, 4, 1)
    sim = SimulatedWorld(2, layout, config)
    buffers = sim.buffers[0]
    a = torch.zeros(1, 2, 16, 16).half()
    b = torch.zeros(16, 8).half()
    out = torch.zeros(1, 16, 8).half()
    with pytest.raises(ValueError, match="contiguous"):
        mrs.launch(a[:, :1], b, out, layout, buffers, 0, config, 1, 1)
    with pytest.raises(ValueError, match="neither"):
        mrs.launch(a, torch.zeros(16, 16).half()[:, ::2], out, layout, buffers, 0, config, 1, 1)
    with pytest.raises(ValueError, match="num_programs"):
        mrs.launch(a, b, out, layout, buffers, 0, config, 0, 1)
    with pytest.raises(ValueError, match="part"):
        mrs.launch(a, b, out, layout, buffers, 0, config, 1, 1, "pushes")
    with pytest.raises(ValueError, match="counters must be contiguous, at least 2"):
        mrs.launch(a, b, out, layout, buffers, 0, mrs.GemmConfig(8, 16, 16, 1, 4, 1), 1, 1)


ALONE_CASES = [  # world, rank, a's shape, dim, N, b as [K, N], config
    (2, 0, (74, 40), 0, 24, True, mrs.GemmConfig(16, 16, 16, 2, 4, 2)),
    (4, 3, (2, 52, 24), 1, 40, False, mrs.GemmConfig(16, 32, 16, 1, 4, 2)),
    (8, 5, (3, 16, 16), 1, 16, True, mrs.GemmConfig(16, 16, 8, 4, 4, 3)),
    (4, 1, (2, 52, 24), 1, 40, False, mrs.GemmConfig(16, 32, 16, 2, 8, 2)),
    (1, 0, (2, 40, 24), 1, 40, False, mrs.GemmConfig(16, 32, 16, 2, 4, 2)),  # the GEMM with no peers
]


@pytest.mark.parametrize("case", ALONE_CASES)
def test_gemm_alone_equals_matmul(case) -> None:
    """The GEMM of a call with the communication taken out (what `--gemm-alone` times): own rows equal
    this rank's rows of a @ b, every peer's rows were staged; two runs, the output poisoned before
    each."""
    world, rank, shape, dim, n, kn, config = case
    a = torch.randn(shape).half()
    b = torch.randn(shape[-1], n).half() if kn else torch.randn(n, shape[-1]).half().t()
    alone = mrs.GemmAlone(a, b, dim, rank, world, config, num_sms=3)
    layout = alone.layout
    product = (a.float() @ b.float()).view(layout.pieces, world, layout.rows, n)
    for run in range(2):
        alone.out.fill_(float("nan"))
        out = alone.run()
        assert alone.buffers.status.tolist() == [0, 0, 0, 0], "a wait recorded a timeout"
        expect = {rank: out.view(layout.pieces, layout.rows, n)}
        expect.update({d: alone.staged(d) for d in range(world) if d != rank})
        for d, got in expect.items():
            assert not got.isnan().any(), f"run {run}, rows of rank {d}: tiles left unwritten"
            err = (got.float() - product[:, d]).norm() / product[:, d].norm()
            assert err < 2e-3, f"run {run}, rows of rank {d}: relative error {err:.2e}"


def test_gemm_alone_validates() -> None:
    a, b = torch.zeros(12, 16).half(), torch.zeros(16, 8).half()
    with pytest.raises(ValueError, match="not in a world of 4"):
        mrs.GemmAlone(a, b, 0, 4, 4, num_sms=1)
    alone = mrs.GemmAlone(a, b, 0, 1, 4, num_sms=1)
    with pytest.raises(ValueError, match="call run"):
        alone.staged(0)
    with pytest.raises(ValueError, match="not 1"):
        alone.staged(1)


# ------------------------------------------------------------------------------------ CPU: sm_90 build


def _descriptors(config: mrs.GemmConfig, b_kn: bool) -> dict[str, str]:
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    return {
        "a_desc": f"tensordesc<bf16[1,{bm},{bk}]>",
        "b_desc": f"tensordesc<bf16[{bk},{bn}]>" if b_kn else f"tensordesc<bf16[{bn},{bk}]>",
    }


def _compile_sm90(
    kernel, world: int, config: mrs.GemmConfig, b_kn: bool, n16: bool, args: dict, consts: dict
) -> str:
    """PTX of one of the module's kernels for sm_90, with the signature and specialization a launch
    gives (Triton marks an integer argument divisible by 16 when it is: N = 1000 is not)."""
    sig = {**_descriptors(config, b_kn), **args, "k": "i32", "rows": "i32", "n": "i32", "pieces": "i32",
           "chunks": "i32"}  # fmt: skip
    const = {"RANK": world - 1, "WORLD": world, "BM": config.block_m, "BN": config.block_n,
             "BK": config.block_k, "GROUP_M": config.group_m, "B_KN": b_kn, "pieces": 1,
             **consts}  # fmt: skip
    aligned = [a for a in sig if a.endswith("_ptr")] + ["k", "rows"]
    return compile_ptx(
        kernel, sig, const, aligned + ["n"] * n16, num_warps=config.num_warps, num_stages=config.num_stages
    )


def _compile_stage(world: int, config: mrs.GemmConfig, b_kn: bool, n16: bool) -> str:
    args = {"staging_ptr": "*bf16", "counters_ptr": "*i32", "credits_ptr": "*i32", "credited_ptr": "*i32",
            "status_ptr": "*i32", "timeout_ns": "i64"}  # fmt: skip
    consts = {"THREADS": config.threads, "CREDITS": True, "OP_ID": 1, "PDL": True}
    return _compile_sm90(mrs._matmul_rs_stage_kernel, world, config, b_kn, n16, args, consts)


def _compile_own(world: int, config: mrs.GemmConfig, b_kn: bool, n16: bool) -> str:
    args = {"out_ptr": "*bf16", "recv_ptr": "*bf16", "flags_ptr": "*i32", "status_ptr": "*i32",
            "timeout_ns": "i64"}  # fmt: skip
    consts = {"OP_ID": 1, "AFTER_STAGE": True, "SPIN": True}
    return _compile_sm90(mrs._matmul_rs_own_kernel, world, config, b_kn, n16, args, consts)


def check_sm90_ptx() -> None:
    """Compile both kernels for sm_90, with the table's configs and every config the benchmark sweeps
    (nn.Linear layout, as the benchmark runs them), and check the PTX has what the design relies on.
    Runs in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit)."""
    from benchmarks.bench_matmul_rs import SWEEP

    cases = [(4, 4096, False, True), (2, 1024, True, True), (8, 8192, True, True), (4, 1000, False, False)]
    configs = [
        (world, mrs.pick_config(mrs.scatter_layout((world * 1024, 4096), 0, n, world)), b_kn, n16)
        for world, n, b_kn, n16 in cases
    ]
    configs += [(4, config, False, True) for config in SWEEP]
    for world, config, b_kn, n16 in configs:
        what = f"world {world} {config} kn={b_kn} N%16==0: {n16}"
        _assert_ptx(_compile_stage(world, config, b_kn, n16), f"{what}: stage kernel", {
            "wgmma": "no wgmma", "cp.async.bulk.tensor": "no TMA loads",
            "st.global.v4": "staging stores not 16-byte",
            "atom.global.gpu.release": "counters not released",
            "griddepcontrol.launch_dependents": "the own-rows launch cannot overlap",
            "%globaltimer": "unbounded credit waits",
        })  # fmt: skip
        _assert_ptx(_compile_own(world, config, b_kn, n16), f"{what}: own kernel", {
            "wgmma": "no wgmma", "cp.async.bulk.tensor": "no TMA loads",
            "ld.global.cg.v4": "partials not read in 16-byte vectors",
            "ld.acquire.sys": "flags not acquired", "%globaltimer": "unbounded waits",
            "griddepcontrol.wait": "may end before the stage launch",
        })  # fmt: skip


def _assert_ptx(ptx: str, what: str, needs: dict[str, str]) -> None:
    """Each needle of `needs` in the PTX (else its message), and ptxas neither serializes the wgmma
    instructions nor spills."""
    for needle, missing in needs.items():
        assert needle in ptx, f"{what}: {missing}"
    log = ptxas_log(ptx)
    assert "serialized" not in log and spill_stores(log) == 0, f"{what}: {log}"


def test_kernel_compiles_for_sm90() -> None:
    run_without_interpreter("tests.test_matmul_rs")


# ------------------------------------------------------------------------------------ CPU: layout, validation


def test_scatter_layout() -> None:
    assert mrs.scatter_layout((2, 8, 16), 1, 24, 4) == mrs.ScatterLayout(2, 2, 16, 24, 4)
    assert mrs.scatter_layout((2, 8, 16), 0, 24, 2) == mrs.ScatterLayout(1, 8, 16, 24, 2)
    assert mrs.scatter_layout((3, 4, 5, 16), -3, 8, 2) == mrs.ScatterLayout(3, 10, 16, 8, 2)
    assert mrs.scatter_layout((516, 64), 0, 8, 4).rows == 129
    assert mrs.output_shape((2, 8, 16), 1, 24, 4) == [2, 2, 24]
    with pytest.raises(ValueError, match="last"):
        mrs.scatter_layout((4, 16), 1, 8, 2)
    with pytest.raises(ValueError, match="does not split over 4"):
        mrs.scatter_layout((2, 6, 16), 1, 8, 4)
    layout = mrs.ScatterLayout(2, 129, 64, 1000, 4)
    assert layout.tiles_per_dest(mrs.GemmConfig(128, 128, 64, 8, 8, 3)) == 2 * 2 * 8
    assert layout.slots_bytes() == 3 * 2 * 129 * 1000 * 2


def test_check_inputs_and_fallback_rules() -> None:
    a = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs \[64, N\]"):
        mrs.check_inputs(a, w, 1, 2)  # an nn.Linear weight passed without .t()
    with pytest.raises(ValueError, match="one dtype"):
        mrs.check_inputs(a, w.t().float(), 1, 2)
    with pytest.raises(ValueError, match="not a row dim"):
        mrs.check_inputs(a, w.t(), 2, 2)
    with pytest.raises(ValueError, match="does not split over 3"):
        mrs.check_inputs(a, w.t(), 1, 3)
    mrs.check_inputs(a, w.t(), 1, 4)
    assert mrs.fallback_reason(a, w.t(), 1, 4) is None
    assert mrs.fallback_reason(a, w.t().contiguous(), 0, 2) is None
    assert "world size 3" in mrs.fallback_reason(a[:, :6], w.t(), 1, 3)
    assert "dtype" in mrs.fallback_reason(a.float(), w.t().float(), 1, 2)
    assert "multiple of 8" in mrs.fallback_reason(a[..., :60], w[:, :60].t(), 1, 2)
    assert "multiple of 8" in mrs.fallback_reason(a, w[:92].t(), 1, 2)
    assert "neither" in mrs.fallback_reason(a, w.t()[:, ::2], 1, 2)
    assert "empty" in mrs.fallback_reason(a[:, :0], w.t(), 1, 2)
    big = torch.empty(1 << 30, 8, dtype=torch.bfloat16, device="meta")
    assert "chunks" in mrs.fallback_reason(big, torch.empty(8, 64, dtype=torch.bfloat16, device="meta"), 0, 2)


def test_one_hardware_queue_falls_back(monkeypatch) -> None:
    a = torch.zeros(16, 64, dtype=torch.bfloat16)
    w = torch.zeros(96, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in mrs.fallback_reason(a, w.t(), 0, 2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert mrs.fallback_reason(a, w.t(), 0, 2) is None


def test_pick_config_and_dispatch() -> None:
    def layout(rows: int, n: int) -> mrs.ScatterLayout:
        return mrs.scatter_layout((rows * 4, 4096), 0, n, 4)

    assert mrs.pick_config(layout(1024, 1000)).block_n == 128
    assert mrs.pick_config(layout(1024, 4096)).block_n == 256
    # group_m: the table's 8, cut so that each destination's rows make two copy chunks or more.
    for rows, group_m in ((4096, 8), (2048, 8), (1024, 4), (384, 1), (128, 1), (100, 1)):
        cfg = mrs.pick_config(layout(rows, 7168))
        assert cfg.group_m == group_m, (rows, cfg)
        assert layout(rows, 7168).chunk_count(cfg) >= min(2, layout(rows, 7168).row_tiles(cfg))
    # The own launch leaves copies within one GPU an SM where the ranks share it, and only there.
    assert mrs.own_programs(132, 132, shares_gpu=False) == 132
    assert mrs.own_programs(16, 16, shares_gpu=True) == 15
    assert mrs.own_programs(6, 16, shares_gpu=True) == 6
    assert mrs.own_programs(1, 1, shares_gpu=True) == 1
    from parallel.comm import _find_kernel

    assert _find_kernel("matmul_reduce_scatter") is mrs.matmul_reduce_scatter


def _reference_on_rank(rank: int, world: int) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    for shape, dim in (((2, 4, 16), 1), ((6, 16), 0), ((4, 2, 16), 0)):
        torch.manual_seed(rank)
        a = torch.randn(shape)
        for b in (torch.randn(16, 8), torch.randn(24, 16).t()):
            out = mrs.matmul_reduce_scatter_reference(a, b, dim)
            total = a @ b
            dist.all_reduce(total)
            expect = total.chunk(world, dim=dim)[rank]
            torch.testing.assert_close(out, expect)
            # The same dim counted from the end, and the torch comm path (parallel.comm=torch).
            torch.testing.assert_close(mrs.matmul_reduce_scatter_reference(a, b, dim - a.dim()), expect)
            for d in (dim, dim - a.dim()):
                torch.testing.assert_close(TorchComm(dist.group.WORLD).matmul_reduce_scatter(a, b, d), expect)
        with FakeTensorMode():
            fake = torch.ops.weft.matmul_reduce_scatter(
                torch.empty(shape), torch.empty(16, 8), dim, dist.group.WORLD.group_name
            )
        assert list(fake.shape) == mrs.output_shape(shape, dim, 8, world)
    with pytest.raises(ValueError, match="needs CUDA"):
        mrs.matmul_reduce_scatter(torch.zeros(4, 16), torch.zeros(16, 8), 0)
    with pytest.raises(ValueError, match="does not split"):
        mrs.matmul_reduce_scatter(torch.zeros(3, 16), torch.zeros(16, 8), 0)


def test_reference_and_fake_gloo() -> None:
    run_ranks(_reference_on_rank, 2)


# ------------------------------------------------------------------------------------ GPU

GPU_CASES = [  # shape of a with `dim` given per rank (the call has W times it), dim, N, b as [K, N]
    ((256, 512), 0, 768, False),
    ((129, 3008), 0, 1024, True),  # ragged rows (M/W = 129) and K
    ((129, 3008), 0, 1000, False),  # ragged N
    ((2, 96, 1024), 1, 2048, False),  # dim=1, B=2
    ((2, 78, 520), 1, 136, True),
    ((1, 1024, 4096), 1, 3584, False),
    ((3, 16, 256), 0, 512, True),
]
BF16_RTOL = 1.6e-2


def _reference(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.matmul + reduce_scatter_tensor, the product kept in fp32 (the tolerance is on ours)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = torch.matmul(a.float(), b.float())
    dist.all_reduce(total)
    return total.chunk(world, dim=dim % a.dim())[rank]


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape, f"{what}: {out.dtype} {tuple(out.shape)}"
    assert not out.isnan().any(), f"{what}: unwritten (NaN) elements"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < BF16_RTOL / 4, f"{what}: relative error {err:.2e}"


def _weight(k: int, n: int, kn: bool, dev) -> torch.Tensor:
    if kn:
        return torch.randn(k, n, device=dev, dtype=torch.bfloat16) / math.sqrt(k)
    return (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / math.sqrt(k)).t()


def _poisoned_call(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """The op, after NaN-filling and freeing a block of its output's size: the caching allocator hands
    that block to the output, so an element the kernel misses stays NaN."""
    shape = mrs.output_shape(a.shape, dim, b.shape[1], dist.get_world_size())
    junk = torch.full(shape, float("nan"), device=a.device, dtype=a.dtype)
    del junk
    return mrs.matmul_reduce_scatter(a, b, dim)


def _correctness(rank: int, world: int) -> None:
    dev = rank_gpu()
    for shape, dim, n, kn in GPU_CASES:
        shape = tuple(size * world if i == dim else size for i, size in enumerate(shape))
        for trial in range(2):
            torch.manual_seed(1000 * trial + 17 * rank + n)
            a = torch.randn(shape, device=dev, dtype=torch.bfloat16)
            torch.manual_seed(31 * trial + rank + 7)  # every rank its own weight shard
            b = _weight(shape[-1], n, kn, dev)
            assert mrs.fallback_reason(a, b, dim, world) is None, "this case must run the kernel"
            out = _poisoned_call(a, b, dim)
            torch.cuda.synchronize()
            mrs.check()
            _check(out, _reference(a, b, dim), f"rank {rank} {shape} dim={dim} N={n} kn={kn}")
    # The fallback (fp32) goes through the same entry point.
    a = torch.randn(64, 64, device=dev)
    eye = torch.eye(64, device=dev)
    torch.testing.assert_close(mrs.matmul_reduce_scatter(a, eye, 0), _reference(a, eye, 0))


def _graphs(rank: int, world: int) -> None:
    dev = rank_gpu()
    inputs = [
        torch.zeros(2, 96 * world, 512, device=dev, dtype=torch.bfloat16),
        torch.zeros(129 * world, 512, device=dev, dtype=torch.bfloat16),
    ]
    torch.manual_seed(5)
    w_nk = _weight(512, 384, False, dev)
    w_kn = _weight(512, 1024, True, dev)
    calls = [(inputs[0], w_nk, 1), (inputs[1], w_kn, 0), (inputs[0], w_kn, 1)]  # odd: parities shift
    results: list = [None] * len(calls)

    def step() -> None:
        for i, (a, b, dim) in enumerate(calls):
            results[i] = mrs.matmul_reduce_scatter(a, b, dim)

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
        for a in inputs:
            a.copy_(torch.randn_like(a))
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        if replay % 2:
            eager = torch.randn(40 * world, 512, device=dev, dtype=torch.bfloat16)
            _check(mrs.matmul_reduce_scatter(eager, w_kn, 0), _reference(eager, w_kn, 0), f"eager {replay}")
        torch.cuda.synchronize()
        mrs.check()
        for (a, b, dim), out in zip(calls, captured, strict=True):
            _check(out, _reference(a, b, dim), f"rank {rank} replay {replay} {tuple(a.shape)} dim={dim}")


def _timeout(rank: int, world: int) -> None:
    dev = rank_gpu()
    group = dist.new_group(list(range(world)))
    absent = world - 1
    a = torch.randn(64 * world, 256, device=dev, dtype=torch.bfloat16)
    b = _weight(256, 128, True, dev)
    mrs.prepare(a, b, 0, group)
    dist.barrier()
    if rank != absent:
        # The second call finds the absent rank's credit taken and its flags unset: it must return
        # (every wait gives up at once after the first timeout), not hang.
        for _ in range(2):
            mrs.matmul_reduce_scatter_kernel(a, b, 0, group, timeout_s=TIMEOUT_TEST_S)
        torch.cuda.synchronize()
        with pytest.raises(
            SymmMemTimeout, match=rf"rank {rank}: matmul_reduce_scatter .* waiting for rank {absent}"
        ):
            mrs.check(group)
    torch.cuda.synchronize()
    dist.barrier()


def _run_on_rank(rank: int, world: int) -> None:
    _correctness(rank, world)
    _graphs(rank, world)
    _timeout(rank, world)


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_matmul_rs_gpu(world: int) -> None:
    run_ranks(_run_on_rank, world, backend="nccl")


def _serialised(rank: int, world: int) -> None:
    """Two calls with every kernel launch returning only once its kernel has ended: a rank's own launch
    ends only if every rank queued its copies before its own launch. The reference is summed from every
    rank's seeded inputs, so nothing but the op itself runs a collective kernel."""
    dev = rank_gpu()
    for call, (rows, k, n) in enumerate(((64, 256, 128), (129, 512, 256))):
        shards = []
        for r in range(world):
            torch.manual_seed(100 * call + r)
            a = torch.randn(rows * world, k, device=dev, dtype=torch.bfloat16)
            shards.append((a, _weight(k, n, True, dev)))
        a, b = shards[rank]
        out = _poisoned_call(a, b, 0)
        torch.cuda.synchronize()
        mrs.check()
        total = sum(x.float() @ w.float() for x, w in shards)
        _check(out, total.chunk(world)[rank], f"rank {rank} call {call}")


@pytest.mark.multigpu(n=2)
def test_matmul_rs_gpu_with_serialised_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_LAUNCH_BLOCKING=1 (a debugging setting; profilers serialise launches alike)."""
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    run_ranks(_serialised, 2, backend="nccl")


@pytest.mark.gpu
def test_gemm_alone_gpu() -> None:
    """On one GPU, bf16: the kernel alone (what `--gemm-alone` times), pushes into local memory, with the
    table's config and every config of the benchmark's sweep, ragged rows (M/W = 129), K and N, against
    torch.matmul: own rows and every staged partial; the output poisoned."""
    from benchmarks.bench_matmul_rs import SWEEP

    torch.manual_seed(0)
    world, rank = 4, 2
    a = torch.randn(world * 129, 3008, device="cuda", dtype=torch.bfloat16)
    for n, kn in ((1000, False), (2048, True)):
        b = _weight(3008, n, kn, "cuda")
        product = (a.float() @ b.float()).view(world, 129, n)
        for config in (None, *SWEEP):
            alone = mrs.GemmAlone(a, b, 0, rank, world, config)
            alone.out.fill_(float("nan"))
            got = {rank: alone.run().view(129, n)}
            got.update({d: alone.staged(d)[0] for d in range(world) if d != rank})
            for d, out in got.items():
                assert not out.isnan().any(), f"{alone.config} N={n}, rows of rank {d}: tiles left unwritten"
                err = ((out.float() - product[d]).norm() / product[d].norm()).item()
                assert err < BF16_RTOL / 4, (
                    f"{alone.config} N={n}, rows of rank {d}: relative error {err:.2e}"
                )

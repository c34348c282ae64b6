"""The Ulysses all-to-all (kernels/all_to_all.py).

CPU: the kernel's own index code (`push_rows`, `copy_out_rows`) runs under the Triton interpreter in a
one-process simulation of W ranks (every rank's pushes, then every rank's copy-outs, through a pointer
table like the symmetric buffer's), against the definition of the exchange on full tensors: both
directions, q/k/v in one launch, replicated key/value heads, ragged sequence chunks, transpose-view
inputs, round trips. Plus the schedule, the layout helpers, validation, and the stock reference on gloo.

GPU (2 and 4 ranks, NCCL beside the kernel): kernel == reference exactly for q, k, v shapes with and
without GQA and ragged chunks, both directions, poisoned outputs; CUDA-graph replays with fresh inputs
mixed with eager calls; a rank that never enters -> SymmMemTimeout naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

from kernels.all_to_all import (
    FLAG_BYTES,
    MAX_CHUNKS,
    MIN_CHUNK_BYTES,
    TARGET_CHUNKS,
    all_to_all_kernel,
    buffer_bytes,
    check,
    check_inputs,
    copy_out_rows,
    fallback_reason,
    heads_to_seq,
    heads_to_seq_reference,
    image_layout,
    image_stride,
    launch_all_to_all,
    new_output,
    output_shape,
    prepare,
    push_block,
    readable,
    replicate_heads,
    schedule,
    seq_to_heads,
    seq_to_heads_reference,
    vector_strides,
)
from kernels.symm_mem import SymmMemTimeout, size_class
from tests.multiprocess import GPU_WORLDS, TIMEOUT_TEST_S, run_ranks
from tests.sm90 import compile_ptx, run_without_interpreter

# ------------------------------------------------------------------------------- the definition


def expected_seq_to_heads(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s result from the full [B, H, S, D] tensor: its heads (after replication), all S."""
    full = replicate_heads(full, world)
    local = full.shape[1] // world
    return full[:, rank * local : (rank + 1) * local]


def expected_heads_to_seq(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s result from the full [B, H, S, D] tensor: every head, its S/W positions."""
    seq_local = full.shape[2] // world
    return full[:, :, rank * seq_local : (rank + 1) * seq_local]


def seq_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s seq_to_heads input as the model hands it over: a [B, H, S/W, D] transpose view of
    a [B, S/W, H, D] tensor."""
    return expected_heads_to_seq(full, rank, world).transpose(1, 2).contiguous().transpose(1, 2)


def head_shard(full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    local = full.shape[1] // world
    return full[:, rank * local : (rank + 1) * local].contiguous()


# ----------------------------------------------------------------- simulated ranks (interpreter)


@triton.jit
def _push_kernel(
    ins, strides, outs, image_offsets, images, n_rows, seq_local, block_rows,
    HEADS: tl.constexpr, REPS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
    HEAD_DIM: tl.constexpr, VEC: tl.constexpr, SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
    ROTATE: tl.constexpr,
):  # fmt: skip
    push_block(
        ins, strides, outs, image_offsets, images, 0, tl.program_id(0) * block_rows, block_rows, n_rows,
        seq_local, HEADS, REPS, RANK, WORLD, HEAD_DIM, VEC, SEQ_TO_HEADS, TILE, ROTATE,
    )  # fmt: skip


@triton.jit
def _copy_out_kernel(
    image, image_offsets, outs, n_rows, seq_local, block_rows,
    HEADS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, HEAD_DIM: tl.constexpr, VEC: tl.constexpr,
    SEQ_TO_HEADS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    NT: tl.constexpr = len(outs)
    row0 = tl.program_id(0) * block_rows
    for j in tl.static_range(1, WORLD):
        src = (RANK + WORLD - j) % WORLD
        for t in tl.static_range(NT):
            copy_out_rows(
                image + image_offsets[t], outs[t], row0, block_rows, n_rows, seq_local, src,
                HEADS[t], HEAD_DIM, VEC, WORLD, SEQ_TO_HEADS, TILE,
            )  # fmt: skip


def simulate(
    per_rank: list[list[torch.Tensor]],
    seq_to_heads: bool,
    block_rows: int,
    tile: int = 64,
    rotate_peers: bool = False,
) -> list[list[torch.Tensor]]:
    """Every rank's pushes (peers in the order `rotate_peers` picks), then every rank's copy-outs, with
    CPU tensors as the ranks' buffer images (poisoned) and outputs (poisoned): the results per rank."""
    world = len(per_rank)
    x0 = per_rank[0][0]
    vec = 16 // x0.element_size()
    bsz, _, seq_in, dim = x0.shape
    seq_local = seq_in if seq_to_heads else seq_in // world
    n_rows = bsz * seq_local
    outs = [
        [
            new_output(output_shape(x.shape, world, seq_to_heads), seq_to_heads, x).fill_(float("nan"))
            for x in xs
        ]
        for xs in per_rank
    ]
    offsets, image_bytes = image_layout([o.shape for o in outs[0]], x0.element_size())
    images = [
        torch.full((image_bytes // x0.element_size(),), float("nan"), dtype=x0.dtype) for _ in range(world)
    ]
    table = torch.tensor([im.data_ptr() for im in images], dtype=torch.int64)
    heads = tuple(
        o.shape[1] if seq_to_heads else x.shape[1] for x, o in zip(per_rank[0], outs[0], strict=True)
    )
    reps = tuple(
        o.shape[1] * world // x.shape[1] if seq_to_heads else 1
        for x, o in zip(per_rank[0], outs[0], strict=True)
    )
    grid = (triton.cdiv(n_rows, block_rows),)
    common = dict(HEAD_DIM=dim, VEC=vec, WORLD=world, SEQ_TO_HEADS=seq_to_heads, TILE=tile)
    for rank, xs in enumerate(per_rank):
        assert all(readable(x) for x in xs)
        strides = tuple(tuple(s // vec for s in x.stride()[:3]) for x in xs)  # in 16-byte vectors
        _push_kernel[grid](
            tuple(xs), strides, tuple(outs[rank]), tuple(offsets), table.data_ptr(), n_rows, seq_local,
            block_rows, HEADS=heads, REPS=reps, RANK=rank, ROTATE=rotate_peers, **common,
        )  # fmt: skip
    for rank in range(world):
        _copy_out_kernel[grid](
            images[rank], tuple(offsets), tuple(outs[rank]), n_rows, seq_local, block_rows,
            HEADS=heads, RANK=rank, **common,
        )  # fmt: skip
    return outs


# (world, batch, seq per rank, head dim, dtype, heads of q, k, v)
CASES = [
    (2, 1, 4, 16, torch.float32, (4, 2, 2)),
    (4, 2, 5, 16, torch.float32, (8, 2, 2)),  # ragged chunk, GQA with kv heads replicated
    (4, 1, 3, 8, torch.float32, (4, 4, 4)),
    (4, 2, 3, 16, torch.bfloat16, (8, 1, 1)),
    (8, 1, 3, 8, torch.bfloat16, (8, 2, 2)),  # world 8: every kv head replicated to 4 ranks
]


@pytest.mark.parametrize("rotate", [False, True], ids=["rank+1 first", "rotated"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_index_maps_match_the_definition(case, rotate: bool) -> None:
    world, bsz, seq_local, dim, dtype, heads = case
    seq = world * seq_local
    fulls = [torch.randn(bsz, h, seq, dim).to(dtype) for h in heads]
    block_rows = 2  # several blocks per rank, the last one short when seq_local is odd
    # sequence -> heads, q, k, v in one launch; inputs are transpose views
    shards = [[seq_shard(f, r, world) for f in fulls] for r in range(world)]
    outs = simulate(shards, True, block_rows, rotate_peers=rotate)
    for rank in range(world):
        for full, out in zip(fulls, outs[rank], strict=True):
            assert torch.equal(out, expected_seq_to_heads(full, rank, world)), f"seq_to_heads rank {rank}"
    # heads -> sequence on the same shapes' transposed role, then the round trip
    head_fulls = [replicate_heads(f, world) for f in fulls]
    back = simulate(
        [[head_shard(f, r, world) for f in head_fulls] for r in range(world)], False, block_rows,
        rotate_peers=rotate,
    )  # fmt: skip
    for rank in range(world):
        for full, out in zip(head_fulls, back[rank], strict=True):
            assert torch.equal(out, expected_heads_to_seq(full, rank, world)), f"heads_to_seq rank {rank}"
    trip = simulate(outs, False, 3)
    for rank in range(world):
        for full, out in zip(fulls, trip[rank], strict=True):
            want = expected_heads_to_seq(replicate_heads(full, world), rank, world)
            assert torch.equal(out, want), f"round trip rank {rank}"


def test_heads_to_seq_reads_strided_inputs() -> None:
    """Attention outputs and gradients come in any layout with a contiguous head dim."""
    world, bsz, seq_local, heads, dim = 2, 2, 3, 4, 8
    full = torch.randn(bsz, heads, world * seq_local, dim)
    ins = [head_shard(full, r, world).transpose(1, 2).contiguous().transpose(1, 2) for r in range(world)]
    outs = simulate([[x] for x in ins], False, 4)
    for rank in range(world):
        assert torch.equal(outs[rank][0], expected_heads_to_seq(full, rank, world))


# ------------------------------------------------------------------------------ host-side helpers


@pytest.mark.parametrize("n_rows", [1, 7, 1000 + 8, 8192, 32768, 1 << 20])
@pytest.mark.parametrize("row_bytes", [64, 12288, 8192 * 4])
@pytest.mark.parametrize("chunks", [1, 16, 1000])
def test_schedule_covers_rows_within_the_flags(n_rows: int, row_bytes: int, chunks: int) -> None:
    block_rows, programs = schedule(n_rows, row_bytes, 132, chunks)
    n_blocks = -(-n_rows // block_rows)
    assert 1 <= programs <= min(132, n_blocks), "every program has a block; at most one per SM"
    assert -(-n_blocks // programs) <= min(chunks, MAX_CHUNKS.value), "chunks per program fit the flags"
    assert block_rows * row_bytes >= min(MIN_CHUNK_BYTES, n_rows * row_bytes), "no tiny pipeline steps"


@pytest.mark.parametrize("heads", [48, 12])  # H=32 or 8 query heads, H/4 kv heads; 128 bf16 each
def test_issue_shapes_pipeline_on_every_program(heads: int) -> None:
    """Every program gets rows, TARGET_CHUNKS deep unless that would cut chunks under MIN_CHUNK_BYTES."""
    for seq in (32768, 131072):
        n_rows, row_bytes = seq // 4, heads * 128 * 2  # per rank at W=4
        block_rows, programs = schedule(n_rows, row_bytes, 132)
        chunks = -(-n_rows // (block_rows * programs))
        capped = block_rows * row_bytes < MIN_CHUNK_BYTES + row_bytes
        assert programs == 132 and (chunks == TARGET_CHUNKS or capped), (seq, heads, block_rows, chunks)


def test_layout_helpers() -> None:
    assert output_shape((2, 8, 5, 16), 4, True) == (2, 2, 20, 16)
    assert output_shape((2, 2, 5, 16), 4, True) == (2, 1, 20, 16)  # replicated kv head
    assert output_shape((2, 2, 20, 16), 4, False) == (2, 8, 5, 16)
    out = new_output((2, 3, 5, 16), True, torch.empty(0))
    assert out.transpose(1, 2).is_contiguous()
    for image in (256, 3 << 20, (384 << 20) + 256, 1 << 30):  # both images fit the buffer allocated for them
        total = size_class(buffer_bytes(image))
        assert image <= image_stride(total) and FLAG_BYTES.value + 2 * image_stride(total) <= total
    offsets, nbytes = image_layout([(1, 2, 3, 8), (1, 1, 3, 8)], 2)
    assert offsets == [0, 128] and nbytes == 512  # 96 and 48 bytes, each rounded to 256
    assert readable(torch.empty(2, 5, 4, 16).transpose(1, 2))
    assert readable(torch.empty(2, 4, 5, 16)[..., :8])  # fp32 rows 64 bytes apart
    assert not readable(torch.empty(2, 4, 5, 6)[..., :4])  # rows 24 bytes apart
    assert not readable(torch.empty(2, 4, 5, 16).transpose(2, 3))  # head dim not contiguous
    # A dimension of size 1 may carry any stride (torch ignores it for contiguity): never used.
    one_head = torch.empty(2, 5, 1, 16).as_strided((2, 1, 5, 16), (80, 3, 16, 1))
    assert readable(one_head) and vector_strides(one_head) == (20, 0, 4)
    # Contiguous but 4 bytes off a 16-byte boundary: a fresh copy is needed, x.contiguous() is x.
    misaligned = torch.empty(1 + 2 * 4 * 5 * 16)[1:].view(2, 4, 5, 16)
    assert misaligned.is_contiguous() and not readable(misaligned)
    assert readable(misaligned.clone(memory_format=torch.contiguous_format))


def test_validation_says_what_to_change() -> None:
    q = torch.empty(1, 8, 4, 16)
    with pytest.raises(ValueError, match="1 to 3 tensors"):
        check_inputs([q] * 4, 4, True)
    with pytest.raises(ValueError, match=r"expected \[B, heads, seq, D\]"):
        check_inputs([q[0]], 4, True)
    with pytest.raises(ValueError, match="one dtype and device"):
        check_inputs([q, q.double()], 4, True)
    with pytest.raises(ValueError, match="batch, seq and head dim must match"):
        check_inputs([q, torch.empty(1, 8, 5, 16)], 4, True)
    with pytest.raises(ValueError, match="6 heads, which neither divide nor are divisible"):
        check_inputs([torch.empty(1, 6, 4, 16)], 4, True)
    with pytest.raises(ValueError, match="sequence length 6, not divisible by the 4 ranks"):
        check_inputs([torch.empty(1, 2, 6, 16)], 4, False)
    check_inputs([q, torch.empty(1, 2, 4, 16)], 4, True)
    assert fallback_reason([q], 4) is None
    assert "world size 3" in fallback_reason([q], 3)
    assert "dtype torch.float64" in fallback_reason([q.double()], 4)
    assert "head dim 4" in fallback_reason([torch.empty(1, 8, 4, 4, dtype=torch.bfloat16)], 4)


# ------------------------------------------------------------------------------ reference on gloo


def reference_on_rank(rank: int, world: int) -> None:
    torch.manual_seed(5)  # the same full tensors on every rank
    fulls = [torch.randn(2, h, world * 3, 8) for h in (8, 2, 2)]
    outs = seq_to_heads_reference([seq_shard(f, rank, world) for f in fulls])
    for full, out in zip(fulls, outs, strict=True):
        assert torch.equal(out, expected_seq_to_heads(full, rank, world))
    back = heads_to_seq_reference(outs)
    for full, out in zip(fulls, back, strict=True):
        assert torch.equal(out, expected_heads_to_seq(replicate_heads(full, world), rank, world))
    with pytest.raises(ValueError, match=r"needs CUDA tensors, got cpu: use parallel\.comm=torch"):
        seq_to_heads(outs)


def test_triton_path_finds_the_kernels() -> None:
    from parallel.comm import TRITON_KERNELS, check_ops
    from parallel.ulysses import ULYSSES_OPS

    check_ops("triton", ULYSSES_OPS)
    assert {TRITON_KERNELS[op] for op in ULYSSES_OPS} == {
        ("kernels.all_to_all", "seq_to_heads"),
        ("kernels.all_to_all", "heads_to_seq"),
    }


def test_reference_on_gloo() -> None:
    run_ranks(reference_on_rank, 4)


# -------------------------------------------------------------------------------------------- GPU


# ------------------------------------------------------------------------------------ sm_90 build


def _compile_sm90(
    seq_to_heads: bool, world: int, dtype: torch.dtype, heads: tuple, reps: tuple, rotate: bool, warps: int
) -> str:
    from kernels.all_to_all import _all_to_all_kernel

    n = len(heads)
    ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    sig = {
        "ins": (ty,) * n, "strides": (("i64",) * 3,) * n, "outs": (ty,) * n, "image_offsets": ("i64",) * n,
        "buf_ptrs": "i64", "base_offset": "i64", "image_stride": "i64", "epoch_ptr": "*i32",
        "status_ptr": "*i32", "n_rows": "i32", "seq_local": "i32", "block_rows": "i32", "timeout_ns": "i64",
    }  # fmt: skip
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    const = {"HEADS": heads, "REPS": reps, "RANK": world - 1, "WORLD": world, "HEAD_DIM": 128, "VEC": vec,
             "SEQ_TO_HEADS": seq_to_heads, "TILE": 8192, "OP": 1, "ROTATE": rotate}  # fmt: skip
    # What the launcher's specialization gives: tensors and image offsets 16-byte aligned.
    aligned = [(a, t) for a in ("ins", "outs", "image_offsets") for t in range(n)]
    return compile_ptx(_all_to_all_kernel, sig, const, aligned, num_warps=warps)


def check_sm90_ptx() -> None:
    """Compile the kernel for sm_90 in a few configurations and check the PTX has what the design
    relies on. Runs in a process without TRITON_INTERPRET (the interpreter replaces @triton.jit)."""
    import re

    cases = [
        (True, 4, torch.bfloat16, (8, 2, 2), (1, 1, 1), True, 16),  # q, k, v, as launched by default
        (True, 4, torch.bfloat16, (8, 2, 2), (1, 1, 1), False, 8),  # every program from rank + 1
        (True, 8, torch.bfloat16, (4, 1, 1), (1, 2, 2), True, 16),  # kv heads replicated
        (False, 4, torch.bfloat16, (8, 2, 2), (1, 1, 1), True, 16),  # gradients of q, k, v
        (False, 2, torch.float32, (3,), (1,), False, 8),  # 3 heads: padded columns
    ]
    for case in cases:
        ptx = _compile_sm90(*case)
        assert "st.global.v4" in ptx and "ld.global.v4" in ptx, f"{case}: data must move as 16-byte vectors"
        narrow = re.findall(r"(?:ld|st)\.global\.(?:b16|v2\.\w+)|ld\.global\.b32", ptx)
        assert not narrow, f"{case}: narrow data accesses {sorted(set(narrow))}"
        assert "atom.global.sys.release" in ptx, f"{case}: flags must be released at system scope"
        assert "ld.acquire.sys" in ptx and "%globaltimer" in ptx, f"{case}: waits must be bounded acquires"


def test_kernel_compiles_for_sm90() -> None:
    run_without_interpreter("tests.test_all_to_all")


# -------------------------------------------------------------------------------------------- GPU

# (batch, seq per rank, head dim, dtype, heads of each tensor): q/k/v with and without GQA, replicated
# kv heads at world 4, ragged chunks, a lone tensor.
GPU_CASES = [
    (1, 1024, 128, torch.bfloat16, (32, 8, 8)),
    (2, 1000 + 3, 128, torch.bfloat16, (8, 2, 2)),
    (1, 257, 64, torch.float16, (4, 1, 1)),
    (3, 77, 128, torch.float32, (8,)),
]


def _random_seq_inputs(case, world: int, dev: torch.device) -> list[torch.Tensor]:
    bsz, seq_local, dim, dtype, heads = case
    # What the model hands over: [B, H, S/W, D] transpose views of [B, S/W, H, D] projections.
    return [torch.randn(bsz, seq_local, h, dim, device=dev).to(dtype).transpose(1, 2) for h in heads]


def _correctness(rank: int, world: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    for n, case in enumerate(GPU_CASES):
        torch.manual_seed(100 * n + rank)  # different data on every rank
        xs = _random_seq_inputs(case, world, dev)
        assert fallback_reason(xs, world) is None
        want = seq_to_heads_reference(xs)
        got = seq_to_heads(xs)
        for t, (w, g) in enumerate(zip(want, got, strict=True)):
            assert torch.equal(g, w), f"seq_to_heads case {case} tensor {t}: op != reference"
        # The launcher itself, into poisoned outputs: on every SM, on 8 programs (deep pipelines), on two
        # programs per SM.
        _, image_bytes = image_layout([o.shape for o in want], xs[0].element_size())
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        launches = ((None, False, 16), (8, False, 16), (2 * sms, False, 16), (None, True, 8), (8, True, 16))
        for max_programs, rotate, warps in launches:
            outs = [new_output(o.shape, True, o).fill_(float("nan")) for o in want]
            launch_all_to_all(prepare(group, image_bytes), xs, outs, True, 10**10, max_programs=max_programs,
                              rotate_peers=rotate, num_warps=warps)  # fmt: skip
            torch.cuda.synchronize()
            check(group)
            for t, (w, o) in enumerate(zip(want, outs, strict=True)):
                where = f"{max_programs} programs, {rotate=}, {warps} warps"
                assert torch.equal(o, w), f"case {case} tensor {t} on {where}: launcher"
        # The way back, from strided [B, H/W, S, D] views (what attention outputs and gradients may be).
        ys = [torch.randn_like(o).transpose(1, 2).contiguous().transpose(1, 2) if t else torch.randn_like(o)
              for t, o in enumerate(want)]  # fmt: skip
        back_want = heads_to_seq_reference(ys)
        back = heads_to_seq(ys)
        for t, (w, g) in enumerate(zip(back_want, back, strict=True)):
            assert torch.equal(g, w), f"heads_to_seq case {case} tensor {t}: op != reference"
        # Round trip of the non-replicated tensors.
        trip = heads_to_seq(got)
        for t, (x, y) in enumerate(zip(xs, trip, strict=True)):
            if x.shape[1] >= world:
                assert torch.equal(x, y), f"round trip case {case} tensor {t}"
    # A non-readable input (odd strides) is copied once, then exchanged.
    x = torch.randn(1, 64, 8, 130, device=dev, dtype=torch.bfloat16)[..., 1:129].transpose(1, 2)
    assert torch.equal(all_to_all_kernel([x], group, True)[0], seq_to_heads_reference([x])[0])
    check(group)


def _graphs(rank: int, world: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    case = GPU_CASES[1]
    xs = _random_seq_inputs(case, world, dev)
    o = torch.randn_like(seq_to_heads_reference(xs[:1])[0])

    def step() -> list[torch.Tensor]:  # three calls: the epoch parity flips between replays
        q, k, v = seq_to_heads(xs)
        (back,) = heads_to_seq([o])
        (q2,) = seq_to_heads([xs[0]])
        return [q, k, v, back, q2]

    def reference() -> list[torch.Tensor]:
        q, k, v = seq_to_heads_reference(xs)
        return [q, k, v, *heads_to_seq_reference([o]), *seq_to_heads_reference([xs[0]])]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: allocates the symmetric buffers (collective) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for replay in range(12):
        torch.manual_seed(1000 * replay + rank)
        for x in xs:
            x.copy_(torch.randn_like(x))
        o.copy_(torch.randn_like(o))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        if replay % 3 == 0:  # eager calls between replays shift the epochs by an odd count
            eager = seq_to_heads([xs[1]])[0]
            assert torch.equal(eager, seq_to_heads_reference([xs[1]])[0]), f"eager call after replay {replay}"
        torch.cuda.synchronize()
        check()
        for t, (got, want) in enumerate(zip(outs, reference(), strict=True)):
            assert torch.equal(got, want), f"graph replay {replay} output {t}"


def _timeout(rank: int, world: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    xs = _random_seq_inputs(GPU_CASES[0], world, dev)
    all_to_all_kernel(xs, dist.group.WORLD, True, tag="timeout-test")  # every rank: the buffer exists
    torch.cuda.synchronize()
    absent = world - 1
    if rank != absent:
        all_to_all_kernel(xs, dist.group.WORLD, True, timeout_s=TIMEOUT_TEST_S, tag="timeout-test")
        torch.cuda.synchronize()
        with pytest.raises(SymmMemTimeout, match=rf"rank {rank}: .* waiting for rank {absent}"):
            check(tag="timeout-test")
    torch.cuda.synchronize()
    dist.barrier()


def _on_gpus(rank: int, world: int) -> None:
    _correctness(rank, world)
    _graphs(rank, world)
    _timeout(rank, world)


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_kernel_equals_reference_on_gpus(world: int) -> None:
    run_ranks(_on_gpus, world, backend="nccl")

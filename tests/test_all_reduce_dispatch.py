"""CPU tests of the all-reduce dispatch: algorithm choice (size tables, push kernels' size limit),
launch configs, the one-node check, the status message, the registered op's fake, and the NCCL/gloo
fallback of CustomAllReduce."""

import pytest
import torch

from kernels import symm_mem
from kernels.all_reduce import PUSH_ALGORITHMS
from kernels.custom_all_reduce import (
    ALGORITHMS,
    ANY_SIZE,
    AUTO_ALGORITHMS,
    LAUNCH,
    SUPPORTED_WORLD_SIZES,
    CustomAllReduce,
    choose_algorithm,
    launch_config,
    slot_bytes_for,
)
from kernels.symm_mem import (
    MAX_BLOCKS,
    MAX_PROGRAMS,
    SymmMemError,
    check_peer_access,
    check_single_node,
    describe_status,
    eager_or_op,
    shares_gpu,
    size_class,
)
from tests.multiprocess import run_ranks

KiB, MiB = 1 << 10, 1 << 20
BF16 = torch.bfloat16


def test_every_table_row_is_chosen_over_exactly_its_range() -> None:
    for world in SUPPORTED_WORLD_SIZES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            rows = AUTO_ALGORITHMS[world][dtype]
            assert [b for b, _ in rows] == sorted(b for b, _ in rows) and rows[-1][0] == ANY_SIZE
            low = 16
            for max_bytes, algo in rows:
                assert algo in ALGORITHMS
                top = min(max_bytes, 1 << 40)
                for nbytes in (low, top):
                    assert choose_algorithm(nbytes, world, dtype, 1 << 41, push_max_size=1 << 41) == algo
                low = top + 16


def test_four_algorithms_by_size_and_push_only_up_to_its_limit() -> None:
    table = {
        4: {
            BF16: (
                (8 * KiB, "one_shot_push"),
                (64 * KiB, "one_shot"),
                (MiB, "two_shot_push"),
                (ANY_SIZE, "two_shot"),
            )
        }
    }

    def pick(nbytes: int, push_max: int = 4 * MiB) -> str:
        return choose_algorithm(nbytes, 4, BF16, 32 * MiB, table, push_max)

    sizes = (16, 8 * KiB, 8 * KiB + 16, 64 * KiB, 64 * KiB + 16, MiB, MiB + 16)
    expect = ["one_shot_push"] * 2 + ["one_shot"] * 2 + ["two_shot_push"] * 2 + ["two_shot"]
    assert [pick(n) for n in sizes] == expect
    # A push row beyond the push buffer's size falls through to the next row that can take the size.
    assert pick(4 * KiB, push_max=0) == "one_shot"
    assert pick(512 * KiB, push_max=256 * KiB) == "two_shot"
    only_push = {4: {BF16: ((ANY_SIZE, "two_shot_push"),)}}
    assert choose_algorithm(2 * MiB, 4, BF16, 32 * MiB, only_push, push_max_size=MiB) == "two_shot"


def test_a_table_without_this_world_size_or_dtype_falls_back_to_the_defaults() -> None:
    table = {4: {BF16: ((ANY_SIZE, "two_shot"),)}}
    assert choose_algorithm(4096, 4, BF16, 64 * MiB, table) == "two_shot"
    assert choose_algorithm(4096, 4, torch.float32, 64 * MiB, table) == choose_algorithm(
        4096, 4, torch.float32, 64 * MiB
    )
    assert choose_algorithm(4096, 8, BF16, 64 * MiB, table) == choose_algorithm(4096, 8, BF16, 64 * MiB)


def test_nccl_beyond_max_size_and_for_what_the_kernels_do_not_cover() -> None:
    assert choose_algorithm(8 * MiB, 4, BF16, max_size=8 * MiB) == "two_shot"
    assert choose_algorithm(8 * MiB + 16, 4, BF16, max_size=8 * MiB) == "nccl"
    assert choose_algorithm(4096 + 2, 4, BF16, 64 * MiB) == "nccl"  # not whole 16-byte vectors
    assert choose_algorithm(0, 4, BF16, 64 * MiB) == "nccl"
    assert choose_algorithm(4096, 4, torch.int32, 64 * MiB) == "nccl"
    assert choose_algorithm(4096, 3, BF16, 64 * MiB) == "nccl"
    assert choose_algorithm(4096, 6, BF16, 64 * MiB) == "nccl"
    assert choose_algorithm(4096, 1, BF16, 64 * MiB) == "identity"


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_launch_config_covers_every_size(algo: str) -> None:
    for world in SUPPORTED_WORLD_SIZES:
        for nbytes in [16, 4 * KiB, 4 * KiB + 16, 64 * KiB, MiB, 32 * MiB, 1 << 34]:
            warps, blocks = launch_config(algo, nbytes, world, 2)
            assert warps in (1, 2, 4, 8, 16, 32)
            assert 1 <= blocks <= (MAX_PROGRAMS if algo in PUSH_ALGORITHMS else MAX_BLOCKS).value
            vectors = -(-nbytes // 16)
            if algo.startswith("two_shot"):
                vectors = -(-vectors // world)
            assert (blocks - 1) * warps * 32 < vectors, "no program may be left without work"
    assert launch_config(algo, 16, 4, 2)[1] == 1
    with pytest.raises(ValueError):
        launch_config("ring", 16, 4, 2)


def test_launch_tables_are_sorted() -> None:
    assert set(LAUNCH) == set(ALGORITHMS)
    for rows in LAUNCH.values():
        sizes = [r.max_bytes for r in rows]
        assert sizes == sorted(sizes) and sizes[-1] >= 1 << 40


def test_sizes() -> None:
    assert size_class(1) == MiB and size_class(MiB) == MiB and size_class(MiB + 1) == 2 * MiB
    assert slot_bytes_for(1000) == 1008 and slot_bytes_for(4096) == 4096
    with pytest.raises(ValueError):
        size_class(0)
    # the flags of NUM_BARRIERS x MAX_BLOCKS x MAX_WORLD fit torch's default 9216-byte signal pad
    assert symm_mem.PAD_INT32S * 4 <= 9216


def test_eager_or_op_takes_the_registered_op_only_under_compile() -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        return eager_or_op(lambda y: y + 1, lambda y: y + 2)(x)

    assert step(torch.zeros(1)).item() == 1
    assert torch.compile(step, backend="eager", fullgraph=True)(torch.zeros(1)).item() == 2


def info(host: str, device: int, uuid: str = "") -> dict:
    return {"host": host, "boot": "b-" + host, "device": device, "uuid": uuid or f"{host}-{device}"}


def test_group_on_one_node_passes() -> None:
    check_single_node([info("a", 0), info("a", 1), info("a", 2), info("a", 3)], rank=2)


def test_group_across_nodes_fails_clearly() -> None:
    with pytest.raises(SymmMemError, match=r"rank 0: .*one node.*\['a', 'b'\].*ranks \[2, 3\]"):
        check_single_node([info("a", 0), info("a", 1), info("b", 0), info("b", 1)], rank=0)


def test_ranks_sharing_a_gpu_are_seen() -> None:
    # One GPU for two ranks passes the one-node check; the buffers are then mapped by CUDA IPC.
    shared = [info("a", 0, "u0"), info("a", 0, "u0")]
    check_single_node(shared, rank=1)
    assert shares_gpu(shared)
    assert shares_gpu([info("a", 0, "u0"), info("a", 1, "u1"), info("a", 0, "u0")])
    assert not shares_gpu([info("a", d) for d in range(4)])


def test_missing_peer_access_fails_clearly() -> None:
    infos = [info("a", d) for d in range(4)]
    check_peer_access(infos, 1, can_access=lambda a, b: True)
    with pytest.raises(SymmMemError, match=r"rank 1: GPU 1 has no peer access to GPU 3 \(rank 3\)"):
        check_peer_access(infos, 1, can_access=lambda a, b: b != 3)


def test_status_message_names_rank_op_barrier_and_peer() -> None:
    assert describe_status([0, 0, 0, 0], 1, "g") is None
    op = symm_mem.op_id("all_reduce one-shot")
    msg = describe_status([1, op, 0, 3], 1, "tp")
    assert "rank 1" in msg and "all_reduce one-shot" in msg and "barrier 0" in msg
    assert "waiting for rank 3" in msg and "'tp'" in msg
    push = describe_status([1, symm_mem.op_id("all_reduce two-shot push"), 1, 2], 0, "tp")
    assert "all_reduce two-shot push" in push and "waiting for rank 2" in push


def test_registered_op_has_a_fake() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 4096, dtype=BF16)
        y = torch.ops.weft.symm_all_reduce(x, "any-group")
    assert y.shape == x.shape and y.dtype == x.dtype


def fallback_on_rank(rank: int, world: int) -> None:
    car = CustomAllReduce()  # no CUDA: no symmetric buffer, everything goes through the stock path
    x = torch.arange(24, dtype=torch.float32) * (rank + 1)
    assert car.algorithm(x) == "nccl" and car.push_buf is None
    for algo in ALGORITHMS:
        with pytest.raises(RuntimeError, match=f"{algo} needs a symmetric buffer"):
            car.all_reduce(x, algo=algo)
    with pytest.raises(ValueError, match="push_max_size must be >= 0"):
        CustomAllReduce(push_max_size=-1)
    # "identity" is auto's choice at world 1: asked for by name it would return x unsummed.
    for algo in ("identity", "ring"):
        with pytest.raises(ValueError, match=f"algo must be auto, nccl or one of .*, got '{algo}'"):
            car.all_reduce(x, algo=algo)
    y = car(x)
    torch.testing.assert_close(y, torch.arange(24, dtype=torch.float32) * sum(range(1, world + 1)))
    z = torch.ops.weft.symm_all_reduce(x, car.group_name)
    torch.testing.assert_close(z, y)
    assert torch.equal(x, torch.arange(24, dtype=torch.float32) * (rank + 1)), "input untouched"
    # An out of another shape or dtype is refused on every path (the stock one would broadcast or cast).
    for out in (torch.empty(2, 24), torch.empty(24, dtype=torch.float16)):
        with pytest.raises(ValueError, match="pass an out of x's shape, dtype and device"):
            car.all_reduce(x, out=out)
    out = torch.empty(24)
    assert car.all_reduce(x, out=out) is out
    torch.testing.assert_close(out, y)


def test_custom_all_reduce_falls_back_on_cpu() -> None:
    run_ranks(fallback_on_rank, 2)

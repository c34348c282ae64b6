"""Symmetric-memory all-reduce on 2 and 4 GPUs (one process per GPU, NCCL beside it):

* equal to the exact fp32 sum within one rounding, to the stock all-reduce's (NCCL, or gloo where ranks
  share a GPU) within that one's rounding bound, and bit-identical on every rank; bf16, fp16, fp32;
  ragged sizes; one-shot, two-shot and their push variants; inputs holding -0.0 and exact zeros (the
  push kernels' sentinel is -0.0); copy-in and direct (producer writes the symmetric buffer) inputs;
  outputs poisoned with NaN before each call; after the calls every word of the push buffer holds the
  sentinel again;
* inside a CUDA graph of many calls (an odd number, and a number of push calls that is not a multiple
  of their 3 slot sets, so epochs shift between replays) replayed many times with fresh inputs,
  interleaved with eager calls;
* a rank that never enters: the others raise SymmMemTimeout naming it, instead of hanging.

    pytest -q tests/test_all_reduce_gpu.py          # world 2 and 4 (each skipped without its GPUs)
"""

import pytest
import torch
import torch.distributed as dist

from kernels.all_reduce import SENTINEL
from kernels.custom_all_reduce import ALGORITHMS, CustomAllReduce, all_reduce_reference
from kernels.symm_mem import SymmMemTimeout, check_status
from tests.multiprocess import GPU_WORLDS, TIMEOUT_TEST_S, run_ranks

EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}
SIZES = [8, 8 * 3, 8 * 257, 8 * 1000 + 8 * 5, 65536, 131072 + 8 * 11, 512 * 1024]


def exact_sum(x: torch.Tensor) -> torch.Tensor:
    total = x.double()
    dist.all_reduce(total)
    return total


def check_result(y: torch.Tensor, x: torch.Tensor, what: str, one_rounding: bool = True) -> None:
    """y (from x on every rank) vs the exact sum, the stock all-reduce's sum, and every other rank's y."""
    assert not torch.isnan(y).any(), f"{what}: NaN left in the output"
    exact = exact_sum(x)
    eps = EPS[x.dtype]
    if one_rounding:  # fp32 sum rounded once: |y - exact| <= eps |exact| (+ fp32 accumulation error)
        err = (y.double() - exact).abs()
        bound = eps * exact.abs() + 1e-5
        assert (err <= bound).all(), f"{what}: error {(err - bound).max().item()} beyond one rounding"
    stock = all_reduce_reference(x)
    # The stock all-reduce rounds to the dtype after each of its W - 1 additions, each by at most eps
    # times a partial sum, itself at most the sum of magnitudes: where large partials cancel (a matmul's
    # partial sums), that is several units of the result's last place. Plus y's own rounding.
    magnitude = exact_sum(x.abs())
    bound = eps * ((dist.get_world_size() - 1) * magnitude + exact.abs()) + 1e-5
    err = (y.double() - stock.double()).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what} vs the stock all-reduce: {y[worst].item()} vs {stock[worst].item()} at {worst.item()}"
    )
    gathered = [torch.empty_like(y) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, y.contiguous())
    raw = y.view(torch.uint8) if y.dtype == torch.float32 else y.view(torch.int16)
    for r, g in enumerate(gathered):
        other = g.view(torch.uint8) if y.dtype == torch.float32 else g.view(torch.int16)
        assert torch.equal(raw, other), f"{what}: rank {dist.get_rank()} differs from rank {r}"


def check_push_buffer_reset(car: CustomAllReduce, what: str) -> None:
    """Every word of the push buffer is the sentinel again once all ranks are idle."""
    torch.cuda.synchronize()
    dist.barrier()
    assert car.push_buf is not None and car.push_layout is not None
    words = car.push_buf.tensor[: car.push_layout.total_bytes].view(torch.int32)
    stale = (words != SENTINEL.value).nonzero()
    assert stale.numel() == 0, f"{what}: {stale.numel()} push-buffer words not reset, first at {stale[:4]}"


def with_zeros(x: torch.Tensor, rank: int) -> torch.Tensor:
    """-0.0 and +0.0 scattered differently on every rank, plus positions that are -0.0 on every rank."""
    x[rank % 5 :: 5] = -0.0
    x[(rank + 2) % 7 :: 7] = 0.0
    x[3::11] = -0.0
    return x


def correctness(car: CustomAllReduce, rank: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for numel in SIZES:
            for algo in (*ALGORITHMS, "auto"):
                for direct in (False, True):
                    torch.manual_seed(numel * 31 + rank)  # different data on every rank
                    x = with_zeros(torch.randn(numel, dtype=dtype, device=dev), rank)
                    inp = x
                    if direct:
                        inp = car.input_buffer((numel,), dtype)
                        inp.copy_(x)
                    out = torch.full_like(x, float("nan"))
                    y = car.all_reduce(inp, algo=algo, out=out)
                    assert y is out
                    torch.cuda.synchronize()
                    car.check()
                    check_result(y, x, f"{dtype} n={numel} {algo} direct={direct}")
                    if direct:
                        assert torch.equal(inp, x), "the direct region must not be written"
    check_push_buffer_reset(car, "after the correctness calls")
    # 2-D input, the registered op, and a matmul writing its partial sums straight into the buffer
    torch.manual_seed(7 + rank)
    a = torch.randn(16, 256, dtype=torch.bfloat16, device=dev)
    w = torch.randn(512, 256, dtype=torch.bfloat16, device=dev)
    partial = car.input_buffer((16, 512), torch.bfloat16)
    torch.matmul(a, w.t(), out=partial)
    expect = partial.clone()
    y = car(partial)
    assert y.shape == (16, 512) and car.is_direct(partial)
    check_result(y.flatten(), expect.flatten(), "matmul into the direct buffer")
    z = torch.ops.weft.symm_all_reduce(expect, car.group_name)
    assert torch.equal(z, y), "registered op == method, and copy-in == direct"
    # NCCL beyond max_size, and for sizes that are not whole 16-byte vectors
    for numel in (car.max_size // 2 + 8, 1001):
        x = torch.randn(numel, dtype=torch.bfloat16, device=dev)
        assert car.algorithm(x) == "nccl"
        check_result(car(x), x, f"nccl fallback n={numel}", one_rounding=False)


def graphs(car: CustomAllReduce, rank: int) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    cases = [  # (numel, algo, direct): 11 calls per replay, 4 of them push (not a multiple of 3)
        (8 * 129, "one_shot", False),
        (8 * 131, "one_shot_push", False),
        (4096, "two_shot", False),
        (65536 + 8 * 3, "auto", False),
        (8 * 3001, "two_shot_push", False),
        (8 * 1001, "one_shot", True),
        (262144, "auto", False),
        (8 * 777, "two_shot", True),
        (8 * 5, "two_shot_push", True),
        (4096, "one_shot", False),
        (131072 + 8 * 7, "one_shot_push", False),
    ]
    xs = [torch.zeros(n, dtype=torch.bfloat16, device=dev) for n, _, _ in cases]
    outs = [torch.zeros_like(x) for x in xs]

    def step() -> None:
        for (n, algo, direct), x, out in zip(cases, xs, outs, strict=True):
            inp = x
            if direct:  # the "producer": writes the partial sums into the symmetric buffer
                inp = car.input_buffer((n,), x.dtype)
                inp.copy_(x)
            car.all_reduce(inp, algo=algo, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(40):
        torch.manual_seed(1000 * replay + rank)
        for x in xs:
            x.copy_(torch.randn_like(x))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        if replay % 3 == 0:  # eager calls between replays move the epochs by an odd count
            e = torch.randn(8 * 5, dtype=torch.bfloat16, device=dev)
            check_result(car(e), e, f"eager between replays {replay}")
            algo = ("one_shot_push", "two_shot_push")[replay % 2]
            check_result(car.all_reduce(e, algo), e, f"eager {algo} between replays {replay}")
        torch.cuda.synchronize()
        car.check()
        if replay % 4 == 0 or replay == 39:
            for (n, algo, direct), x, out in zip(cases, xs, outs, strict=True):
                check_result(out, x, f"graph replay {replay} n={n} {algo} direct={direct}")
    # many back-to-back replays, checked at the end
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    car.check()
    for (n, algo, direct), x, out in zip(cases, xs, outs, strict=True):
        check_result(out, x, f"after 200 replays n={n} {algo} direct={direct}")
    check_push_buffer_reset(car, "after the graph replays")


def timeout(rank: int, world: int) -> None:
    car = CustomAllReduce(max_size=1 << 20, timeout_s=TIMEOUT_TEST_S, tag="timeout-test")
    dev = torch.device("cuda", torch.cuda.current_device())
    absent = world - 1
    if rank != absent:
        x = torch.randn(4096, dtype=torch.bfloat16, device=dev)
        for algo in ALGORITHMS:
            car.all_reduce(x, algo=algo)
        torch.cuda.synchronize()
        with pytest.raises(SymmMemTimeout, match=rf"rank {rank}: .* waiting for rank {absent}"):
            car.check()
        # the push kernels record on their own buffer; the first of them to give up names the op
        with pytest.raises(SymmMemTimeout, match=rf"rank {rank}: all_reduce one-shot push .* rank {absent}"):
            check_status(car.push_buf)
    torch.cuda.synchronize()
    dist.barrier()


def large_push(rank: int) -> None:
    """The push kernels past 4 MiB, where the two-shot launch has more programs than SMs and 16 or 32
    warps (LAUNCH), with push_max_size raised as the benchmark does."""
    car = CustomAllReduce(max_size=33 << 20, push_max_size=33 << 20, tag="large-push-test")
    dev = torch.device("cuda", torch.cuda.current_device())
    for numel in ((4 << 20) + 8 * 5, (16 << 20) + 8 * 3):  # bf16, 8 and 32 MiB: both rows, ragged
        for algo in ("two_shot_push", "one_shot_push"):
            torch.manual_seed(numel + rank)
            x = with_zeros(torch.randn(numel, dtype=torch.bfloat16, device=dev), rank)
            out = torch.full_like(x, float("nan"))
            car.all_reduce(x, algo=algo, out=out)
            torch.cuda.synchronize()
            car.check()
            check_result(out, x, f"large n={numel} {algo}")
    check_push_buffer_reset(car, "after the large push calls")


def run_on_rank(rank: int, world: int) -> None:
    car = CustomAllReduce(max_size=4 << 20)
    correctness(car, rank)
    graphs(car, rank)
    large_push(rank)
    timeout(rank, world)


@pytest.mark.parametrize("world", GPU_WORLDS)
def test_symm_all_reduce(world: int) -> None:
    run_ranks(run_on_rank, world, backend="nccl")

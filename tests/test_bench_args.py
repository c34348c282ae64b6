"""Command-line arguments of the benchmarks, and the smoke runs, that a CPU can check."""

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks import bench_decode_attention, common, tune_decode
from benchmarks.bench_fp8 import shape_arg
from kernels.fp8_gemm import GemmConfig
from model.decode import Bf16Weight
from model.fp8 import Fp8Weight


def test_tune_shapes_parse_and_reject_clearly() -> None:
    assert shape_arg("4096x14336") == (4096, 14336)
    assert shape_arg("8192X8192") == (8192, 8192)
    for bad in ("8192by8192", "8192x", "x4096", "0x4096", "-1x8", "4096x14336x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="NxK"):
            shape_arg(bad)


def test_decode_tune_candidates_split_k_within_two_programs_per_sm() -> None:
    found = tune_decode.candidates(16, 6144, 4096, 132)
    assert GemmConfig(64, 512, 1, num_stages=3, swap_ab=True) in found
    assert len(set(found)) == len(found)
    for config in found:
        tiles = -(-6144 // config.block_n)
        assert config.split_k == 1 or tiles * config.split_k <= 264
        assert 4096 // config.split_k >= config.block_k
    assert {c.split_k for c in found if c.block_n == 64} == {1, 2}  # 96 tiles: 3 slices would be 288 programs
    assert {c.split_k for c in tune_decode.candidates(16, 28672, 4096, 132)} == {1}


def test_decode_tune_bf16_candidates_hold_the_same_bytes_per_tile() -> None:
    fp8 = tune_decode.candidates(16, 4096, 14336, 132)
    bf16 = tune_decode.candidates(16, 4096, 14336, 132, element_bytes=2)
    assert [dataclasses.replace(c, block_k=c.block_k // 2) for c in fp8] == bf16


def _fake_steps(steps: dict[str, list[float]]) -> Callable[[GemmConfig], list[float]]:
    """measure() for pick_config: each call of config block_n = n takes the next of steps["c<n>"] (ms,
    one batch size); block_n = 1 fails as a config the compiler rejects would."""

    def measure(config: GemmConfig) -> list[float]:
        name = f"c{config.block_n}"
        if name == "c1":
            raise RuntimeError("out of shared memory")
        return [steps[name].pop(0)]

    return measure


def test_decode_tune_keeps_a_winner_only_if_it_wins_every_confirm_round() -> None:
    in_use, bad, fast, faster = (GemmConfig(n, 64, 1) for n in (64, 1, 32, 16))
    # faster wins the sweep (bad skipped) and both confirm rounds, by 25 and 31 us
    measure = _fake_steps({"c64": [3.0, 3.0, 3.001], "c32": [2.99], "c16": [2.97, 2.975, 2.97]})
    best, tried = tune_decode.pick_config(in_use, [in_use, bad, fast, faster], measure, 10, 2, lambda: False)
    assert best == faster
    assert [c for c, _ in tried] == [in_use, fast, faster, in_use, faster, in_use, faster]
    # the same sweep, but the second round finds it 5 us faster, within the 10 us of noise
    measure = _fake_steps({"c64": [3.0, 3.0, 2.98], "c32": [2.99], "c16": [2.97, 2.975, 2.975]})
    best, tried = tune_decode.pick_config(in_use, [fast, faster], measure, 10, 2, lambda: False)
    assert best == in_use and len(tried) == 7
    # nothing better than 10 us: no confirm rounds
    measure = _fake_steps({"c64": [3.0], "c32": [2.995]})
    assert tune_decode.pick_config(in_use, [fast], measure, 10, 2, lambda: False) == (
        in_use,
        [(in_use, [3.0]), (fast, [2.995])],
    )
    # out of time after the config in use
    measure = _fake_steps({"c64": [3.0]})
    assert tune_decode.pick_config(in_use, [fast, faster], measure, 10, 2, lambda: True) == (
        in_use,
        [(in_use, [3.0])],
    )


def test_decode_tune_takes_one_m_bucket_at_a_time() -> None:
    assert tune_decode.check_one_bucket([1, 8]) == 16
    with pytest.raises(SystemExit, match="different M buckets"):
        tune_decode.check_one_bucket([8, 32])
    with pytest.raises(SystemExit, match="up to M = 64"):
        tune_decode.check_one_bucket([128])


def test_decode_tune_keeps_the_bucket_rows_of_earlier_runs(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(tune_decode, "RESULTS_DIR", tmp_path)
    assert tune_decode.earlier_rows("decode_tune-x", 16) == []
    rows = [{"M_bucket": 16, "N": 1, "K": 2}, {"M_bucket": 32, "N": 1, "K": 2}]
    (tmp_path / "decode_tune-x-cpu.json").write_text(json.dumps({"rows": rows}))
    assert tune_decode.earlier_rows("decode_tune-x", 16) == rows[:1]


def test_decode_tune_finds_each_fp8_weight_shape_once_in_step_order() -> None:
    qkv, o = torch.randn(96, 64), torch.randn(64, 64)
    model = torch.nn.Sequential(Fp8Weight(qkv[:64], qkv[64:]), Fp8Weight(o), Fp8Weight(qkv[:64], qkv[64:]))
    assert tune_decode.decode_gemm_shapes(model) == [(96, 64), (64, 64)]
    bf16 = torch.nn.Sequential(Bf16Weight(qkv[:64], qkv[64:]), Fp8Weight(o), Bf16Weight(o))
    assert tune_decode.decode_gemm_shapes(bf16, Bf16Weight) == [(96, 64), (64, 64)]


def test_decode_attention_benchmark_smoke_run() -> None:
    """--smoke runs every path of the benchmark (ours with and without PDL, stock eager and compiled,
    bf16 and FP8 outputs, the sweep) at one tiny shape, on CPU through the interpreter."""
    da = bench_decode_attention.da
    served = da.BLOCK_N, da.MIN_POSITIONS_PER_SPLIT, da.SPLIT_PROGRAMS_PER_SM
    rows = bench_decode_attention.main(["--smoke", "--sweep"])
    assert [row.get("out") for row in rows] == ["bf16", "fp8", None, None]
    for row in rows[:2]:
        for key in ("ours_us", "ours_no_pdl_us", "eager_us", "compile_us", "floor_us"):
            assert row[key] > 0 and torch.isfinite(torch.tensor(row[key])), (key, row)
    # The sweep's settings change the launch (4 "SMs" on CPU, batch 2 x 2 kv heads: 2 programs per SM
    # give 2 splits, 1 gives 1) and are restored after it.
    assert [(row["block_n"], row["splits"]) for row in rows[2:]] == [(16, 2), (32, 1)]
    assert rows[2]["ours_us"] > 0 and rows[3]["ours_us"] > 0
    assert served == (da.BLOCK_N, da.MIN_POSITIONS_PER_SPLIT, da.SPLIT_PROGRAMS_PER_SM)


def test_bf16_gemm_benchmark_shapes_come_from_the_presets() -> None:
    """bench_bf16_gemm times the fused weights serve.py's bf16 decode path reads, per preset."""
    from benchmarks.bench_bf16_gemm import decode_gemms

    layers, gemms = decode_gemms("llama3_8b")
    assert layers == 32
    assert gemms == [
        ("wqkv", 6144, 4096),
        ("wo", 4096, 4096),
        ("w13", 28672, 4096),
        ("w2", 4096, 14336),
        ("output", 128256, 4096),
    ]
    assert decode_gemms("llama3_70b")[1][2] == ("w13", 57344, 8192)


def test_decode_floor_chain_has_the_step_kernels_and_bytes() -> None:
    """decode_floor's chain launches as many kernels as the profiled step (291 with the argmax) and
    reads exactly the roofline's weights and KV cache, whatever the launch structure."""
    from benchmarks.bench_bf16_gemm import preset_args
    from benchmarks.decode_floor import STRUCTURES, step_ops

    args = preset_args("llama3_8b")
    cpu = torch.device("cpu")
    weights = 32 * (6144 + 4096 + 28672) * 4096 + 32 * 4096 * 14336 + 128256 * 4096
    kv = 2 * 32 * 8 * 8 * 640 * 128 * 2
    counts = []
    for structure in STRUCTURES:
        ops = step_ops(args, 8, 640, True, structure, cpu)
        assert sum(op.reads for op in ops) == weights + kv
        counts.append(len(ops))
    assert counts == [290, 258, 226, 161]
    assert sum(op.reads for op in step_ops(args, 1, 640, False, STRUCTURES[0], cpu)) == 2 * weights + kv // 8


def test_train_tp_compares_each_path_with_the_first() -> None:
    from benchmarks.bench_train_tp import compare_losses

    rows, diffs = compare_losses(
        {"torch": [2.0, 1.5, 1.25], "symm_mem": [2.0, 1.5], "triton": [2.0, 1.75, 1.0]}
    )
    assert rows[0] == {"step": 1, "torch": 2.0, "symm_mem": 2.0, "triton": 2.0}
    assert rows[2] == {"step": 3, "torch": 1.25, "symm_mem": None, "triton": 1.0}
    assert diffs == {"torch": 0.0, "symm_mem": 0.0, "triton": 0.25}
    assert compare_losses({}) == ([], {})


def test_interleaved_timing_rotates_the_order_and_times_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """time_ranks_interleaved (the GEMM + collective benchmarks' timing) on a fake GPU clock: each
    call's GPU time per call, every round's calls in an order rotated from the last's."""
    clock, order = [0.0], []

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.ms = 0.0

        def record(self) -> None:
            self.ms = clock[0]

        def elapsed_time(self, end: "FakeEvent") -> float:
            return end.ms - self.ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(common.dist, "barrier", lambda: None)
    monkeypatch.setattr(common, "slowest", lambda value: value)
    monkeypatch.setattr(common, "align_ranks_on_gpu", lambda: order.append("|"))

    def call(label: str, ms: float):
        def run() -> None:
            order.append(label)
            clock[0] += ms

        return run

    reps, iters = 3, 4
    times = common.time_ranks_interleaved({"a": call("a", 2.0), "b": call("b", 0.5)}, iters, reps)
    assert times["a"].gpu_ms == pytest.approx(2.0) and times["b"].gpu_ms == pytest.approx(0.5)
    timed = order[2 * 2 * reps :]  # after the warm-up: two rounds of `reps` calls of each
    # Every call's `reps` back-to-back calls follow an alignment of the ranks, and nothing else does.
    runs = "".join(timed).split("|")
    assert runs[0] == "" and runs[1:] == [label * reps for label in "abbaabba"]


@pytest.mark.parametrize("peers", [1, 3, 7])
def test_push_floor_kernels_deliver_every_peer_block(peers: int) -> None:
    """bench_push_floor's SM-store and TMA kernels put block p of the source at rows row0.. of peer p's
    buffer and nothing elsewhere (peers simulated by CPU tensors, through the interpreter)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from benchmarks import bench_push_floor as pf

    rows, cols, row0 = 128, pf.COLS, 256
    src = torch.randn(peers * rows, cols).to(pf.DTYPE)
    for kernel in ("store", "tma"):
        views = [torch.zeros(4 * rows, cols, dtype=pf.DTYPE) for _ in range(peers)]
        if kernel == "store":
            addrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64)
            pf._store_push[(3,)](src, addrs, rows, row0, PEERS=peers, ROWS=32, COLS=cols)
        else:
            descs = [TensorDescriptor(v, list(v.shape), [cols, 1], [64, cols]) for v in views]
            descs += descs[:1] * (pf.MAX_PEERS - peers)
            sd = TensorDescriptor(src, list(src.shape), [cols, 1], [64, cols])
            pf._tma_push[(2,)](sd, *descs, rows, row0, PEERS=peers, ROWS=64)
        for p, view in enumerate(views):
            assert torch.equal(view[row0 : row0 + rows], src[p * rows : (p + 1) * rows]), (kernel, p)
            assert not view[:row0].any() and not view[row0 + rows :].any(), (kernel, p)


def test_failures_at_once_prints_each_failure_as_it_happens(tmp_path) -> None:
    """run_node.sh's pytest flag (tests/conftest.py): a failure's reason is printed before the next test
    runs, not only in the final summary, which a step cut at its timeout never reaches."""
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'the reason'\n\n\ndef test_later():\n    print('LATER')\n"
    )
    root = Path(__file__).resolve().parent.parent
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-s"]
    done = subprocess.run(
        [*command, "--failures-at-once", str(tmp_path / "test_two.py")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.index("the reason") < done.stdout.index("LATER"), done.stdout


def test_profile_kernel_runs_each_kernel_on_its_operands() -> None:
    """Each subcommand at a tiny shape, on the GPU or through the interpreter on the CPU: the output is
    the kernel's on the operands the seed gives."""
    from benchmarks import profile_kernel
    from kernels.fp8 import quantize_per_token, quantize_weight_per_channel

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def run(command: str) -> torch.Tensor:
        return profile_kernel.main(["--device", dev.type, *shlex.split(command)])

    out = run("--calls 2 attention --batch 2 --cache-len 40 --heads 4 2 16 --out bf16")
    torch.manual_seed(0)
    operands = bench_decode_attention.operand_sets(2, 4, 2, 16, 40, dev, 1)[0]
    expected = bench_decode_attention.da.decode_attention_reference(*operands).float()
    assert out.shape == expected.shape and (out.float() - expected).norm() / expected.norm() < 1e-2
    assert run("--calls 1 attention --batch 2 --cache-len 40 --heads 4 2 16").dtype == torch.float8_e4m3fn

    out = run("--calls 1 matmul-rs --shape 64 32 48 --world 2")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16  # as profile_kernel.matmul_rs
    a = torch.randn(64, 32, device=dev, dtype=dtype)
    b = (torch.randn(48, 32, device=dev, dtype=dtype) / 32**0.5).t()
    expected = (a.float() @ b.float())[:32]  # rank 0's rows; the peers' partials are zeros
    assert (out.float() - expected).norm() / expected.norm() < 1e-2

    out = run("--calls 1 fp8-gemm --shape 2 64 128")
    torch.manual_seed(0)
    w, w_scale = quantize_weight_per_channel(torch.randn(64, 128, device=dev, dtype=torch.bfloat16))
    x, x_scale = quantize_per_token(torch.randn(2, 128, device=dev, dtype=torch.bfloat16))
    expected = (x.float() * x_scale.view(-1, 1)) @ (w.float() * w_scale.view(-1, 1)).t()
    assert (out.float() - expected).norm() / expected.norm() < 1e-2

    with pytest.raises(SystemExit, match="do not share"):
        run("attention --heads 6 4 16")
    with pytest.raises(SystemExit):
        run("fp8-gemm --shape 0 64 128")


def test_profile_kernel_needs_the_interpreter_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import profile_kernel

    monkeypatch.setattr(profile_kernel, "INTERPRETED", False)
    with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
        profile_kernel.main(["--device", "cpu", "attention"])


def test_a_rerun_keeps_the_sections_added_below_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Re-running a benchmark rewrites its table and keeps what was written below it (tried / won /
    lost, profiles): the research record outlives the figures it started from."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    path = common.write_results("bench", [{"shape": "a", "us": 1.0}], "notes", device="cpu")
    path.write_text(path.read_text() + "\n## Tried / won / lost\n\nA lost, by 3%.\n")
    common.write_results("bench", [{"shape": "a", "us": 2.0}], "notes", device="cpu")
    text = path.read_text()
    assert "| a | 2 |" in text and "| a | 1 |" not in text
    assert text.endswith("| a | 2 |\n\n## Tried / won / lost\n\nA lost, by 3%.\n")


def test_result_table_has_every_rows_columns() -> None:
    """A row that lacks columns (bench_train_tp's comm path that cannot run here, first in --comms)
    leaves its cells empty and does not drop the other rows' figures from the markdown table."""
    from report import markdown_table

    rows = [
        {"comm": "symm_mem", "status": "unavailable: no peer access"},
        {"comm": "torch", "status": "ok", "step_ms": 62.8, "mfu": 0.3104},
    ]
    assert markdown_table(rows).splitlines() == [
        "| comm | status | step_ms | mfu |",
        "|---|---|---|---|",
        "| symm_mem | unavailable: no peer access |  |  |",
        "| torch | ok | 62.8 | 0.3104 |",
    ]


def test_all_reduce_size_labels_name_the_size() -> None:
    """Sizes that are no whole KiB or MiB (a --min-size that is no power of two) keep their bytes."""
    from benchmarks.bench_all_reduce import label

    assert [label(n) for n in (4096, 3 << 20, 1536, 3000)] == ["4 KiB", "3 MiB", "1536 B", "3000 B"]

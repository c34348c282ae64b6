"""train.py as a user runs it, on CPU: Ctrl-C / SIGTERM stop with a checkpoint and a resume command,
resumes log each step once, a changed schedule is refused unless allowed, an unreadable checkpoint is
skipped for the one before it, failed launches leave nothing behind, and the step lines reach
train.log, the console, TensorBoard and the plot."""

import fcntl
import gzip
import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from safetensors.torch import load_file

from benchmarks.plot_metrics import run_label
from configs.schema import TrainConfig
from model.args import ModelArgs
from model.llama import Llama
from parallel.parallelize import apply_activation_checkpointing
from tests.multiprocess import run_ranks
from tests.test_train_serve import CPU, ROOT, TINY, losses, run_script
from train import build_optimizer, lr_lambda, train_step
from training.interrupt import StopRequest
from training.metrics import MetricsLog, read_metrics
from training.records import data_windows_change, resume_command

STEPS = 300
CPU_DEVICE = torch.device("cpu")
COMMON = [*TINY, CPU, f"training.steps={STEPS}", "checkpoint.every=50"]


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def start_training(*overrides: str, torchrun: int = 0) -> subprocess.Popen:
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}"]
        if torchrun
        else [sys.executable]
    )
    return subprocess.Popen(
        [*launcher, "train.py", *overrides],
        cwd=ROOT,
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, start: str) -> list[str]:
    """Read the process's stdout up to a line starting with `start` (the lines read so far)."""
    seen = []
    for line in process.stdout:
        seen.append(line)
        if line.startswith(start):
            return seen
    process.wait(timeout=60)
    raise AssertionError(f"no line {start!r} in:\n{''.join(seen)}{process.stderr.read()[-3000:]}")


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run, logging to TensorBoard too when it is installed; its output is not a
    terminal, so the progress bar (on by default) gives way to plain lines."""
    run_dir = tmp_path_factory.mktemp("straight")
    tensorboard = "true" if _installed("tensorboard") else "false"
    done = run_script(
        "train.py",
        *COMMON,
        "logging.progress_bar=true",
        f"logging.tensorboard={tensorboard}",
        f"hydra.run.dir={run_dir}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir / "console.txt").write_text(done.stdout + done.stderr)
    return run_dir


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def test_step_lines_in_train_log_and_plain_console(straight: Path) -> None:
    console = (straight / "console.txt").read_text()
    assert "\r" not in console
    assert f"step {STEPS}/{STEPS}  loss" in console
    log = (straight / "train.log").read_text()
    assert log.splitlines()[0].endswith(f"run directory: {straight}")
    assert sum(f"step {s}/{STEPS}  loss" in log for s in range(1, STEPS + 1)) == STEPS
    assert metric_steps(straight) == list(range(1, STEPS + 1))
    # This launch's config, kept under launches/<launch time>/ (to the microsecond: two launches into one
    # run directory within a second get a record each).
    (record,) = (straight / "launches").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d\.\d{6}", record.name), record.name
    assert f"steps: {STEPS}" in (record / "config.yaml").read_text()


def test_sigint_saves_prints_resume_command_and_resumes_exactly(tmp_path: Path, straight: Path) -> None:
    run_dir = tmp_path / "run"
    process = start_training(*COMMON, f"hydra.run.dir={run_dir}")
    first = wait_for_line(process, "step 1/")
    assert first[0] == f"run directory: {run_dir}\n"
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGINT, err[-3000:]
    stopped = max(metric_steps(run_dir))
    assert 1 <= stopped < STEPS
    assert checkpoint_steps(run_dir)[-1] == stopped  # saved at the step it stopped after
    assert f"SIGINT: stopped at step {stopped}" in out
    assert f"run directory {run_dir}" in out
    (command,) = [line.split("resume with: ", 1)[1] for line in out.splitlines() if "resume with: " in line]
    assert command.endswith(f"hydra.run.dir={run_dir}")

    resumed = subprocess.run(
        shlex.split(command), cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/step_{stopped:08d}" in resumed.stdout
    assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert losses(run_dir)[STEPS] == losses(straight)[STEPS]


def test_printed_command_resumes_a_run_directory_with_spaces_and_accents(tmp_path: Path) -> None:
    run_dir = tmp_path / "my runs" / "été 1"
    short = [*TINY, CPU, "training.steps=4", "checkpoint.every=0"]
    first = run_script("train.py", *short, "training.stop_at=2", f"hydra.run.dir='{run_dir}'")
    assert first.returncode == 0, first.stderr[-3000:]
    (command,) = [
        line.split("resume with: ", 1)[1] for line in first.stdout.splitlines() if "resume with: " in line
    ]
    assert "training.stop_at" not in command  # reached: a resume refuses it (below)
    again = run_script("train.py", *short, "training.stop_at=2", f"hydra.run.dir='{run_dir}'")
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"training.stop_at=2 is not after step 2, which this launch resumes from "
        f"({run_dir}/checkpoints/step_00000002): set a later step, or leave training.stop_at out"
    )
    resumed = subprocess.run(
        shlex.split(command), cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoints/step_00000002" in resumed.stdout
    assert metric_steps(run_dir) == [1, 2, 3, 4]


def test_resume_over_a_changed_corpus_says_its_order_is_new(tmp_path: Path) -> None:
    """A document appended between launches rebuilds the token file, and its epoch of 11 windows (10
    before) is drawn in another order: the resume says so, and trains on from the saved step."""
    corpus, run_dir = tmp_path / "corpus.jsonl", tmp_path / "run"
    # 6 documents of 52 bytes, 54 tokens with BOS and EOS: 10 windows of 32 tokens (and a target)
    corpus.write_text((json.dumps({"text": "the corpus grows " * 3 + "x"}) + "\n") * 6)
    launch = [*TINY, CPU, "training.steps=3", "checkpoint.every=0", f"data.path={corpus}"]
    launch += [f"data.cache_dir={tmp_path / 'tokens'}", f"hydra.run.dir={run_dir}"]
    first = run_script("train.py", *launch, "training.stop_at=1")
    assert first.returncode == 0, first.stderr[-3000:]
    with corpus.open("a") as file:
        file.write(json.dumps({"text": "one more document appended later"}) + "\n")
    resumed = run_script("train.py", *launch)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = (
        f"warning: resuming {run_dir}/checkpoints/step_00000001 with changed values: data windows 10 -> 11 "
        "(the corpus changed: this epoch's order is a new one)"
    )
    assert said in resumed.stdout
    assert metric_steps(run_dir) == [1, 2, 3]


def test_data_windows_change_is_named_only_where_recorded_and_changed() -> None:
    """A checkpoint from before weft recorded the epoch's windows says nothing; a new
    training.seq_len, not the corpus, is named as the cause where it changed."""
    config = {"training": {"seq_len": 32}}
    assert data_windows_change(config, config, {"epoch": 0, "step": 3, "windows_per_step": 2}, 11) == []
    assert data_windows_change(config, config, {"epoch": 0, "step": 3, "windows": 11}, 11) == []
    longer = {"training": {"seq_len": 64}}
    assert data_windows_change(config, longer, {"epoch": 0, "step": 3, "windows": 11}, 5) == [
        "data windows 11 -> 5 (training.seq_len changed: this epoch's order is a new one)"
    ]


def test_multirun_job_prints_a_command_that_resumes_it(tmp_path: Path) -> None:
    """A job of a sweep stopped early names its own values (the sweep's command line would start a new
    sweep, every job from step 0)."""
    sweep = tmp_path / "sweep"
    overrides = [*TINY, CPU, "training.steps=2", "training.stop_at=1", "training.lr=1e-3,2e-3"]
    done = run_script("train.py", "-m", *overrides, f"hydra.sweep.dir={sweep}")
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stdout.splitlines() if "resume with: " in line]
    commands = [line.split("resume with: ", 1)[1] for line in said]
    assert len(commands) == 2
    first = shlex.split(commands[0])
    assert "-m" not in first and "training.lr=0.001" in first, first
    assert first[-1] == f"hydra.run.dir={sweep / '0'}"

    resumed = subprocess.run(first, cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {sweep / '0'}/checkpoints/step_00000001" in resumed.stdout
    assert metric_steps(sweep / "0") == [1, 2] and metric_steps(sweep / "1") == [1]


def test_warmup_longer_than_the_run_is_trained_and_named(tmp_path: Path) -> None:
    """A smoke test shorter than the warm-up runs, with a warning that the lr never reaches its value."""
    run_dir = tmp_path / "run"
    done = run_script(
        "train.py", *TINY, CPU, "training.steps=2", "training.warmup_steps=5", f"hydra.run.dir={run_dir}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = "training.warmup_steps=5 exceeds training.steps=2: the learning rate stops at 0.0012 in warm-up"
    assert said in done.stdout
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([3e-3 / 5, 3e-3 * 2 / 5])


def test_warmup_that_leaves_no_step_of_decay_is_named(tmp_path: Path) -> None:
    """With warmup_steps at steps - 1 the last step trains at the peak (the cosine starts there): the
    run says that its learning rate does not end at lr * min_lr_ratio."""
    done = run_script(
        "train.py", *TINY, CPU, "training.steps=3", "training.warmup_steps=2", f"hydra.run.dir={tmp_path}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = "training.warmup_steps=2 leaves training.steps=3 no step of decay: the learning rate ends at 0.003"
    assert said in done.stdout


def test_learning_rate_warms_up_then_decays_to_its_floor_at_the_last_step(tmp_path: Path) -> None:
    """Step 1 trains at lr / warmup_steps, the last warm-up step at lr, and the cosine ends at
    lr * min_lr_ratio on the last step trained (not one step after it, which never comes)."""
    run_dir = tmp_path / "run"
    schedule = ["training.steps=5", "training.lr=1e-3", "training.min_lr_ratio=0.1", "checkpoint.every=0"]
    done = run_script("train.py", *TINY, CPU, *schedule, f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    lrs = [json.loads(line)["lr"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # Warm-up over steps 1-2; cosine from 1 (step 3) through 0.55 (half-way) to 0.1 (step 5).
    assert lrs == pytest.approx([0.5e-3, 1e-3, 1e-3, 0.55e-3, 0.1e-3])


def test_backward_runs_after_autocast_ends() -> None:
    """train_step's backward runs outside autocast: its cast cache (a bf16 copy of every weight) is then
    freed before the backward, so checkpointed blocks do not keep every block's copies through it (about
    0.7 GiB more at peak for a 360M-parameter model on CPU; model/memory.py counts what stays)."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=128)
    model = Llama(args)
    apply_activation_checkpointing(model)
    cfg = OmegaConf.structured(TrainConfig(model=args))
    cfg.training.batch_size, cfg.training.seq_len = 2, 16
    optimizer = build_optimizer(model, cfg, CPU_DEVICE)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast_in_backward = []
    model.output.register_full_backward_hook(
        lambda *_: autocast_in_backward.append(torch.is_autocast_enabled("cpu"))
    )

    class Batches:
        def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, args.vocab_size, (2, 17))
            return tokens[:, :-1], tokens[:, 1:]

    stats = train_step(model, optimizer, scheduler, Batches(), cfg, CPU_DEVICE, torch.bfloat16, dp_size=1)
    assert autocast_in_backward == [False] and stats.loss > 0


def test_gradient_accumulation_trains_as_the_whole_batch(tmp_path: Path, straight: Path) -> None:
    """training.grad_accum=2 of batches of 2 takes the straight run's windows of 4 in two halves: the same
    loss, gradient norm (the mean over the micro-batches, not their sum) and so the same updates."""
    run_dir = tmp_path / "accum"
    halves = ["training.batch_size=2", "training.grad_accum=2", "training.stop_at=3"]
    done = run_script("train.py", *COMMON, *halves, f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]

    def rows(run: Path) -> list[float]:
        records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return [value for r in records if r["step"] <= 3 for value in (r["loss"], r["grad_norm"])]

    assert rows(run_dir) == pytest.approx(rows(straight), rel=1e-4)


def _compiled_ddp_reduces_once_per_step(rank: int, world: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=128)
    cfg = OmegaConf.structured(TrainConfig(model=args))
    cfg.training.batch_size, cfg.training.seq_len, cfg.training.grad_accum = 2, 16, 4

    class Batches:
        def __init__(self) -> None:
            self.generator = torch.Generator().manual_seed(rank)

        def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
            tokens = torch.randint(0, args.vocab_size, (2, 17), generator=self.generator)
            return tokens[:, :-1], tokens[:, 1:]

    def one_step(compiled: bool) -> tuple[int, float, float]:
        """(bucket all-reduces, loss, gradient norm) of a step of 4 micro-batches."""
        torch.manual_seed(0)
        model = Llama(args)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        reductions = []

        def counted(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            reductions.append(bucket.index())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counted)
        train_model = torch.compile(ddp, backend="eager") if compiled else ddp
        optimizer = build_optimizer(model, cfg, CPU_DEVICE)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        stats = train_step(train_model, optimizer, scheduler, Batches(), cfg, CPU_DEVICE, None, world)
        return len(reductions), stats.loss, stats.grad_norm

    results = [one_step(compiled=False), one_step(compiled=True)]
    assert results[1] == results[0], results


def test_compiled_ddp_reduces_gradients_on_the_last_micro_batch_only() -> None:
    """training.compile=true under DDP (torchrun, tp = cp = 1): torch.compile wraps the DDP module, and the
    micro-batches before the last still skip the all-reduce (no_sync), as uncompiled: the same gradients
    from a quarter of the all-reduces at grad_accum=4."""
    run_ranks(_compiled_ddp_reduces_once_per_step, 2)


def worker_of_rank(torchrun: subprocess.Popen, rank: int) -> int:
    """The pid of a torchrun worker (read from /proc: the children of torchrun's process)."""
    children = Path(f"/proc/{torchrun.pid}/task/{torchrun.pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker of rank {rank} among {children}")


def test_torchrun_ranks_agree_on_the_step_to_stop_after(tmp_path: Path) -> None:
    """Only rank 1 is signalled: rank 0 stops after the same step, saves, and the run resumes."""
    steps = 100
    process = start_training(*TINY, CPU, f"training.steps={steps}", f"hydra.run.dir={tmp_path}", torchrun=2)
    wait_for_line(process, "step 1/")
    os.kill(worker_of_rank(process, 1), signal.SIGINT)
    out, err = process.communicate(timeout=60)
    stopped = max(metric_steps(tmp_path))
    assert f"SIGINT: stopped at step {stopped}" in out, err[-3000:]
    assert stopped < steps and checkpoint_steps(tmp_path)[-1] == stopped
    (command,) = [line.split("resume with: ", 1)[1] for line in out.splitlines() if "resume with: " in line]
    assert command.startswith("torchrun --nproc_per_node=2 train.py ")

    launcher = [sys.executable, "-m", "torch.distributed.run"]
    resumed = subprocess.run(
        [*launcher, *shlex.split(command)[1:]],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metric_steps(tmp_path) == list(range(1, steps + 1))


def _signal_during_the_all_reduce(rank: int, world: int) -> None:
    stop = StopRequest()
    reduce = dist.all_reduce

    def late_signal(tensor, **kwargs):  # the reduce runs, then the signal lands before it returns
        reduce(tensor, **kwargs)
        if rank == 1 and stop.signal is None:
            stop._handle(signal.SIGINT, None)

    dist.all_reduce = late_signal
    try:
        # This step: no rank had a signal when they reduced, so none stops; the next step, all do.
        assert [stop.agreed(), stop.agreed()] == [False, True]
    finally:
        dist.all_reduce = reduce


def test_a_signal_during_the_agreement_stops_every_rank_at_the_same_step() -> None:
    run_ranks(_signal_during_the_all_reduce, 2)


def test_non_finite_loss_stops_every_rank_with_one_message(tmp_path: Path) -> None:
    done = run_script(
        "train.py", *TINY, CPU, "training.warmup_steps=0", "training.lr=1e12", "training.steps=20",
        f"hydra.run.dir={tmp_path}", torchrun=2,
    )  # fmt: skip
    assert done.returncode != 0
    why = "loss became nan at step 2: stopping; no checkpoint was saved"
    said = (done.stdout + done.stderr).count(why)
    assert said == 1, done.stderr[-3000:]
    assert (
        (tmp_path / "train.log")
        .read_text()
        .splitlines()[-1]
        .endswith(why + " before it. Lower training.lr or check the data")
    )


def test_non_finite_gradients_never_reach_a_checkpoint(tmp_path: Path) -> None:
    """At this learning rate a finite loss comes with a NaN gradient norm at step 2: the run stops
    before the update, so the checkpoint it keeps as the last good one holds finite weights."""
    done = run_script(
        "train.py", *TINY, CPU, "training.warmup_steps=0", "training.lr=1e8", "training.grad_clip=0",
        "training.steps=10", "checkpoint.every=1", f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert done.returncode != 0
    assert (
        "became nan at step 2: stopping; the last good checkpoint (step 1) is kept"
        in done.stdout + done.stderr
    )
    assert checkpoint_steps(tmp_path) == [1]
    weights = load_file(str(tmp_path / "checkpoints" / "step_00000001" / "model.safetensors"))
    assert all(t.isfinite().all() for t in weights.values())


def test_signal_before_the_first_step_trains_and_keeps_nothing(tmp_path: Path) -> None:
    """A SIGINT that lands while the model is built stops before step 1: no checkpoint, no record."""
    early = (
        "import runpy, signal, sys\n"
        "from training.interrupt import StopRequest\n"
        "enter = StopRequest.__enter__\n"
        "def signalled(self):\n"
        "    enter(self)\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "    return self\n"
        "StopRequest.__enter__ = signalled\n"
        "sys.argv = ['train.py', *sys.argv[1:]]\n"
        "runpy.run_path('train.py', run_name='__main__')\n"
    )
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", early, *COMMON, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=environment(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 128 + signal.SIGINT, done.stderr[-3000:]
    assert "SIGINT before the first step: stopping; nothing trained, nothing saved" in done.stdout
    assert not run_dir.exists()


def test_export_of_a_finished_run(straight: Path, tmp_path: Path) -> None:
    """checkpoint.export_hf=true on a run that already reached training.steps exports its weights."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    done = run_script("train.py", *COMMON, "checkpoint.export_hf=true", f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"already holds step {STEPS} >= training.steps={STEPS}: nothing to train" in done.stdout
    exported = load_file(str(run_dir / "hf" / "model.safetensors"))
    trained = load_file(str(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))
    assert torch.equal(exported["model.norm.weight"], trained["norm.weight"].to(torch.bfloat16))


def test_second_signal_exits_at_once_and_resume_drops_replayed_rows(tmp_path: Path, straight: Path) -> None:
    run_dir = tmp_path / "run"
    process = start_training(*COMMON, "checkpoint.every=3", f"hydra.run.dir={run_dir}")
    wait_for_line(process, "step 5/")
    # Two different signals, so that neither is lost (one signal sent twice may be handled once), sent
    # while the process is stopped: on a loaded machine it could otherwise finish its step, save and exit
    # on the first before the second is sent.
    process.send_signal(signal.SIGSTOP)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGTERM)
    process.send_signal(signal.SIGCONT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM, err[-3000:]
    assert "SIGTERM again: exiting without saving" in err
    assert "resume with" not in out
    logged, saved = max(metric_steps(run_dir)), checkpoint_steps(run_dir)[-1]
    assert saved % 3 == 0 and saved <= logged  # no checkpoint of the step it was stopped in

    resumed = run_script("train.py", *COMMON, "checkpoint.every=3", f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metric_steps(run_dir) == list(range(1, STEPS + 1))
    assert losses(run_dir)[STEPS] == losses(straight)[STEPS]


def test_changed_schedule_is_refused_unless_allowed(tmp_path: Path) -> None:
    short = [*TINY, CPU, "training.steps=8", "checkpoint.every=0"]
    first = run_script("train.py", *short, "training.stop_at=4", f"hydra.run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    records = sorted((tmp_path / "launches").iterdir())
    config = (records[0] / "config.yaml").read_text()

    longer = [*TINY, CPU, "training.steps=16", "checkpoint.every=0", f"hydra.run.dir={tmp_path}"]
    refused = run_script("train.py", *longer)
    assert refused.returncode != 0
    message = refused.stdout + refused.stderr
    assert "training.steps 8 -> 16" in message and "training.allow_schedule_change=true" in message
    old, new = (3e-3 * lr_lambda(4, 2, steps, 0.1) for steps in (8, 16))
    assert f"learning rate of step 5: {old:.3g} -> {new:.3g}" in message
    # The failed launch left the run's records and checkpoints as they were.
    assert sorted((tmp_path / "launches").iterdir()) == records
    assert (records[0] / "config.yaml").read_text() == config
    assert checkpoint_steps(tmp_path) == [4]

    allowed = run_script("train.py", *longer, "training.allow_schedule_change=true")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "changed schedule (training.steps 8 -> 16" in allowed.stdout
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    # The lr logged at step 5 is the one it used, as the refusal above said: the new schedule's.
    assert rows[5]["lr"] == pytest.approx(new)
    assert rows[1]["lr"] == pytest.approx(3e-3 * lr_lambda(0, 2, 8, 0.1))  # step 1's, half the peak
    assert len(list((tmp_path / "launches").iterdir())) == 2
    meta = json.loads((tmp_path / "checkpoints" / "step_00000016" / "meta.json").read_text())
    assert meta["config"]["training"]["steps"] == 16


def test_resume_over_fewer_data_parallel_ranks_says_so(tmp_path: Path) -> None:
    """Two data-parallel ranks stopped, resumed on one: each step now trains on half the sequences,
    which no config value shows, so the resume names the change."""
    short = [*TINY, CPU, "training.steps=2", "checkpoint.every=0", f"hydra.run.dir={tmp_path}"]
    first = run_script("train.py", *short, "training.stop_at=1", torchrun=2)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_script("train.py", *short)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "with changed values: data-parallel ranks 2 -> 1" in resumed.stdout


def test_truncated_checkpoint_falls_back_to_the_one_before(tmp_path: Path, straight: Path) -> None:
    first = run_script("train.py", *COMMON, "training.stop_at=100", f"hydra.run.dir={tmp_path}")
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint_steps(tmp_path) == [50, 100]
    weights = tmp_path / "checkpoints" / "step_00000100" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    resumed = run_script("train.py", *COMMON, f"hydra.run.dir={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"warning: cannot read {weights}" in resumed.stdout
    assert f"resuming from {tmp_path}/checkpoints/step_00000050" in resumed.stdout
    assert metric_steps(tmp_path) == list(range(1, STEPS + 1))
    assert losses(tmp_path)[STEPS] == losses(straight)[STEPS]


def test_a_checkpoint_that_cannot_be_written_stops_with_one_line(tmp_path: Path) -> None:
    """A save that fails to write (here past a file size limit, as on a full disk) stops the run with one
    line naming the checkpoint kept and the command that resumes, and leaves no partial files."""
    short = [*TINY, CPU, "training.steps=6", "checkpoint.every=3", f"hydra.run.dir={tmp_path}"]
    first = run_script("train.py", *short, "training.stop_at=3")
    assert first.returncode == 0, first.stderr[-3000:]
    kept = tmp_path / "checkpoints" / "step_00000003"
    limit = (kept / "model.safetensors").stat().st_size // 2

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run(
        [sys.executable, "train.py", *short], cwd=ROOT, env=environment(), capture_output=True, text=True,
        preexec_fn=limit_file_size, timeout=600,
    )  # fmt: skip
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"cannot save the checkpoint of step 6 in {tmp_path / 'checkpoints'}: ")
    assert f"the last good checkpoint (step 3) is kept in {tmp_path / 'checkpoints'}" in line
    assert " train.py " in line.split("resume with: ")[1] and line.endswith(f"hydra.run.dir={tmp_path}")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == [kept.name]


@pytest.mark.parametrize("torchrun", [0, 2])
def test_a_second_launch_into_a_run_directory_in_use_is_refused(tmp_path: Path, torchrun: int) -> None:
    """While a launch holds the run directory (here still setting up: nothing trained yet), another one
    into it is refused with one line and leaves the first launch's files as they were."""
    (tmp_path / "launches" / "first").mkdir(parents=True)
    (tmp_path / "train.log").write_text("the first launch's log\n")
    with open(tmp_path / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = run_script(
            "train.py", *TINY, CPU, "training.steps=2", f"hydra.run.dir={tmp_path}", torchrun=torchrun
        )
    assert done.returncode == 1
    said = f"{tmp_path} is in use by another launch training there: wait for it to end, or choose another"
    assert said in done.stderr and done.stderr.count(said) == 1, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "launches", "train.log"]
    assert [p.name for p in (tmp_path / "launches").iterdir()] == ["first"]
    assert (tmp_path / "train.log").read_text().startswith("the first launch's log\n")


def test_failed_launch_leaves_no_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = run_script("train.py", *TINY, CPU, "training.seq_len=4096", f"hydra.run.dir={run_dir}")
    assert done.returncode != 0
    assert "max_seq_len" in done.stdout + done.stderr
    assert not run_dir.exists()


def test_failed_launch_keeps_what_the_run_directory_held_before_it(tmp_path: Path) -> None:
    """hydra.run.dir naming a directory of the user's: a launch that fails before its first step removes
    its own files there and leaves theirs, weft's file names among them, as they were."""
    theirs = {
        "tensorboard/old/events.out": "events",
        "tokenizer.json": "{}",
        "train.log": "their notes\n",
        "README.txt": "keep",
    }
    for name, text in theirs.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    done = run_script(
        "train.py", *TINY, CPU, f"data.path={tmp_path / 'typo.jsonl'}", f"hydra.run.dir={tmp_path}"
    )
    assert done.returncode == 1 and "typo.jsonl" in done.stderr
    held = {str(p.relative_to(tmp_path)): p.read_text() for p in tmp_path.rglob("*") if p.is_file()}
    assert held == theirs


def test_rows_of_earlier_launches_stay_until_this_launch_logs_a_step(tmp_path: Path) -> None:
    """A resume from step 2 drops the rows of steps 3 and 4 (it trains them again) when it logs its first
    step, not before: a launch stopped or failing before that leaves them."""
    earlier = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in earlier))
    with MetricsLog(tmp_path, start_step=2, total_steps=8, tensorboard=False) as metrics:
        assert read_metrics(tmp_path) == earlier
        metrics.write({"step": 3, "loss": 0.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0})
        assert metric_steps(tmp_path) == [1, 2, 3]
    assert read_metrics(tmp_path)[-1]["loss"] == 0.5


def test_tensorboard_events(straight: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(straight / "tensorboard"))
    events.Reload()
    assert {"train/loss", "train/lr", "train/tokens_per_s"} <= set(events.Tags()["scalars"])
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, STEPS + 1))
    assert loss[-1].value == pytest.approx(losses(straight)[STEPS], abs=1e-4)


def test_tensorboard_missing_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from training.metrics import require_tensorboard

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match=r"needs the tensorboard package: pip install") as error:
        require_tensorboard()
    assert "\n" not in str(error.value)


def trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as trace:
        return json.load(trace)["traceEvents"]


def test_profile_writes_a_trace_per_rank_of_the_steps_asked(tmp_path: Path) -> None:
    """logging.profile_at=2 traces steps 2-3 on each of 2 ranks: their matmuls, DDP's all-reduce and the
    optimizer; a trace that would run past the launch's end stops at its last step."""
    overrides = [*TINY, CPU, "training.steps=4", "logging.profile_at=2", "logging.profile_steps=2"]
    done = run_script("train.py", *overrides, f"hydra.run.dir={tmp_path / 'ddp'}", torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    traces = tmp_path / "ddp" / "profile" / "steps_2-3"
    assert sorted(p.name for p in traces.iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    for rank in (0, 1):
        names = {event.get("name", "") for event in trace_events(traces / f"rank{rank}.json.gz")}
        assert "aten::mm" in names
        assert any(name.startswith("Optimizer.step#AdamW") for name in names)
        assert any("allreduce" in name for name in names)
    at_the_end = [*overrides[:-2], "logging.profile_at=4", f"hydra.run.dir={tmp_path / 'end'}"]
    done = run_script("train.py", *at_the_end)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "end" / "profile" / "steps_4-4" / "rank0.json.gz").is_file()
    # Past the launch's last step (training.stop_at): said, and nothing written.
    stopped = [*overrides[:-2], "logging.profile_at=3", "training.stop_at=2"]
    done = run_script("train.py", *stopped, f"hydra.run.dir={tmp_path / 's'}")
    assert done.returncode == 0, done.stderr[-3000:]
    warning = "warning: logging.profile_at=3 is outside the steps this launch trains (1 to 2): no trace"
    assert warning in done.stdout + done.stderr
    assert not (tmp_path / "s" / "profile").exists()


def test_plot_metrics_draws_several_runs(tmp_path: Path, straight: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.plot_metrics", str(straight), str(straight), "--out", str(out)],
        cwd=ROOT,
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 20_000


def test_mfu_peak_is_the_cards_dense_bf16_peak() -> None:
    """The PCIe and NVL cards of a chip have lower peaks than its SXM ones: an H100 PCIe's MFU taken
    against the SXM's 989 TFLOP/s read 24% low."""
    from train import peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA H100 NVL") == 835e12
    assert peak_bf16_flops("NVIDIA H200 NVL") == 835e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None


def test_resume_command_drops_a_reached_stop_and_the_run_dir_in_every_override_form(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    args = ["training.steps=6", "++training.stop_at=2", "+training.stop_at=2", "~training.stop_at",
            "training.stop_at=5", "++hydra.run.dir=/elsewhere", "hydra.run.dir=/elsewhere"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    command = shlex.split(resume_command(tmp_path, 2))
    assert command[1:] == ["train.py", "training.steps=6", "training.stop_at=5", f"hydra.run.dir={tmp_path}"]


def test_plot_label_of_a_run_given_as_dot_is_its_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "my-run").mkdir()
    monkeypatch.chdir(tmp_path / "my-run")
    assert run_label(Path("."), several=False) == "my-run"
    assert run_label(Path("."), several=True) == "."

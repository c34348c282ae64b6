"""train.py's held-out loss (eval.path): measured every eval.every steps and at the last, on the same
windows each time, equal to the loss of that step's checkpoint on those windows computed directly
(one process, and at tp=2 under torchrun), and without changing what is trained."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.plot_metrics import plot_runs
from model.data import PackedDataset, load_documents, tokenize_corpus
from model.llama import Llama
from model.loading import checkpoint_args, load_weights_into
from model.tokenizer import ByteTokenizer
from tests.test_train_serve import CPU, ROOT, TINY, run_script

# The held-out corpus: text the default training corpus (Python's documentation) does not hold.
HELD_OUT = ROOT / "README.md"


def rows(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def checkpoint_loss(run_dir: Path, step: int, batch_size: int, seq_len: int, batches: int) -> float:
    """The loss per token of the weights saved at `step` over the held-out windows (those one rank of
    batch_size takes in the first `batches` steps of the corpus' epoch 0, order seed 0), in fp32."""
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    model = Llama(checkpoint_args(checkpoint))
    load_weights_into(model, checkpoint)
    tokens = tokenize_corpus(load_documents(str(HELD_OUT)), ByteTokenizer())
    windows = PackedDataset(tokens, seq_len, batch_size, rank=0, world_size=1, seed=0)
    losses = []
    with torch.no_grad():
        for _ in range(batches):
            inputs, targets = windows.next_batch()
            losses.append(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).item())
    return sum(losses) / len(losses)


def test_held_out_loss_is_the_checkpoints_and_changes_no_training(tmp_path: Path) -> None:
    common = [*TINY, CPU, "training.steps=4", "checkpoint.every=2"]
    plain, evaluated = tmp_path / "plain", tmp_path / "evaluated"
    done = run_script("train.py", *common, f"hydra.run.dir={plain}")
    assert done.returncode == 0, done.stderr[-3000:]
    held_out = [f"eval.path={HELD_OUT}", "eval.every=2", "eval.batches=3", "logging.every=3"]
    done = run_script("train.py", *common, *held_out, f"hydra.run.dir={evaluated}")
    assert done.returncode == 0, done.stderr[-3000:]
    measured = rows(evaluated)
    # Logged at its steps even off logging.every's (3), and only there.
    assert sorted(measured) == [1, 2, 3, 4]
    assert [step for step, row in measured.items() if "eval_loss" in row] == [2, 4]
    # Training is untouched: the same losses and gradient norms as without it.
    for step, row in measured.items():
        assert (row["loss"], row["grad_norm"]) == (rows(plain)[step]["loss"], rows(plain)[step]["grad_norm"])
    for step in (2, 4):
        expected = checkpoint_loss(evaluated, step, batch_size=4, seq_len=32, batches=3)
        assert measured[step]["eval_loss"] == pytest.approx(expected, rel=1e-4)
    assert measured[4]["eval_loss"] < measured[2]["eval_loss"]
    if importlib.util.find_spec("matplotlib") is not None:  # drawn as a dashed line beside the loss
        assert plot_runs([evaluated], tmp_path / "curves.png").stat().st_size > 0
    log = (evaluated / "train.log").read_text()
    assert "held-out loss every 2 steps and at the last, over 3 batches (384 tokens)" in log
    assert f"eval_loss {measured[4]['eval_loss']:.4f}" in log


@pytest.mark.parametrize(("layout", "data_parallel"), [("parallel.tp=2", 1), ("parallel.fsdp=true", 2)])
def test_held_out_loss_on_two_ranks(tmp_path: Path, layout: str, data_parallel: int) -> None:
    """At tp=2 the logits are split over the vocabulary (parallel/loss.py) and both ranks evaluate the
    same windows; under FSDP2 (dp=2) each rank evaluates half of them, and the weights gathered for the
    evaluation are resharded before the checkpoint that follows. Either way the loss is the checkpoint's
    over the windows of batch_size x data-parallel ranks."""
    done = run_script(
        "train.py",
        *TINY,
        CPU,
        "training.steps=4",
        "checkpoint.every=2",
        layout,
        f"eval.path={HELD_OUT}",
        "eval.every=2",
        "eval.batches=2",
        f"hydra.run.dir={tmp_path}",
        torchrun=2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    measured = rows(tmp_path)
    assert [step for step, row in measured.items() if "eval_loss" in row] == [2, 4]
    for step in (2, 4):
        expected = checkpoint_loss(tmp_path, step, batch_size=4 * data_parallel, seq_len=32, batches=2)
        assert measured[step]["eval_loss"] == pytest.approx(expected, rel=1e-4)


def test_a_small_held_out_corpus_gives_what_it_holds_or_one_line(tmp_path: Path) -> None:
    """eval.batches beyond the corpus takes all its batches; a corpus short of one batch is refused in a
    line that names eval.path."""
    small = tmp_path / "small.txt"
    small.write_text("x" * (3 * 4 * 32 + 40))  # three batches of 4 x 32 tokens, and a part
    run_dir = tmp_path / "run"
    overrides = [*TINY, CPU, "training.steps=1", f"eval.path={small}", "eval.batches=null"]
    done = run_script("train.py", *overrides, f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "over 3 batches (384 tokens)" in (run_dir / "train.log").read_text()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short")
    done = run_script("train.py", *overrides[:-2], f"eval.path={tiny}", f"hydra.run.dir={tmp_path / 'no'}")
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    too_few = "holds 11 tokens, fewer than one batch of training.batch_size x training.seq_len for each"
    assert line.startswith(f"eval.path={tiny} {too_few} of the 1 data-parallel rank(s) takes (129)")
    assert not (tmp_path / "no").exists()


def test_held_out_files_that_data_path_trains_on_are_named(tmp_path: Path) -> None:
    """A data.path directory that holds eval.path's file trains on the held-out text: warned, naming
    the file. The training file alone is no warning."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.txt").write_text(HELD_OUT.read_text())
    (corpus / "valid.txt").write_text(HELD_OUT.read_text()[:2000] * 4)
    common = [*TINY, CPU, "training.steps=1", f"eval.path={corpus / 'valid.txt'}", "eval.batches=1"]
    for data, warned in ((corpus, True), (corpus / "train.txt", False)):
        run_dir = tmp_path / ("leak" if warned else "clean")
        done = run_script("train.py", *common, f"data.path={data}", f"hydra.run.dir={run_dir}")
        assert done.returncode == 0, done.stderr[-3000:]
        warning = f"warning: data.path trains on 1 of eval.path's files ({corpus / 'valid.txt'})"
        assert (warning in (run_dir / "train.log").read_text()) == warned, done.stderr[-3000:]

"""A user's mistakes in train.py and serve.py: every value is checked before a model is built, the
schemas are strict, and each error prints as one line once (under torchrun too), with the traceback
only under HYDRA_FULL_ERROR=1; a model too large for the device's memory is refused the same way."""

import ast
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationKeyError

from configs.launch import one_line
from configs.schema import register_configs, register_resolvers
from configs.validate import check_keys, check_prompt_override, validate_serve_config, validate_train_config
from model import memory
from model.args import ModelArgs
from tests.multiprocess import run_ranks
from tests.test_train_serve import CPU, ROOT, TINY, run_script, script_command

GIB = 2**30


def composed(config: str, *overrides: str):
    """The config train.py / serve.py would get for these overrides (Hydra's errors raised as they are)."""
    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(config, overrides=list(overrides))


def error_line(config: str, *overrides: str) -> str:
    with pytest.raises(Exception) as caught:
        cfg = composed(config, *overrides)
        (validate_train_config if config == "train" else validate_serve_config)(cfg)
    line = one_line(caught.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.stepz=5"], "unknown key training.stepz: training's keys are steps, batch_size,"),
        (["+training.stepz=5"], "unknown key training.stepz: training's keys are steps, batch_size,"),
        (["+model.foo=1"], "unknown key model.foo: model's keys are name, dim, n_layers,"),
        (["stepz=1"], "unknown key stepz: the top-level keys are model, parallel, training,"),
        (["+stepz=1"], "unknown key stepz: the top-level keys are model, parallel, training,"),
        (["model=model_schema"], "the choices for model are debug, llama3_405b, llama3_70b, llama3_8b"),
        (["parallel=parallel_schema"], "the choices for parallel are default"),
        (["training.steps=abc"], "training.steps=abc: Value 'abc' of type 'str' could not be converted"),
        (["training.steps=[1"], "cannot parse the override 'training.steps=[1'"),
    ],
)
def test_config_errors_name_the_valid_choices(overrides: list[str], message: str) -> None:
    line = error_line("train", *overrides)
    assert message in line
    assert "schema" not in line.partition("choices")[2]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.steps=0", "training.steps=0 must be >= 1"),
        ("training.batch_size=0", "training.batch_size=0 must be >= 1"),
        ("training.seq_len=0", "training.seq_len=0 must be >= 1"),
        ("training.grad_accum=-1", "training.grad_accum=-1 must be >= 1"),
        ("training.lr=0", "training.lr=0.0 must be a positive number"),
        ("training.lr=nan", "training.lr=nan must be a positive number"),
        ("training.min_lr_ratio=1.5", "training.min_lr_ratio=1.5 must be in [0, 1]"),
        ("training.warmup_steps=-1", "training.warmup_steps=-1 must be >= 0"),
        ("training.weight_decay=-0.1", "training.weight_decay=-0.1 must be >= 0"),
        ("training.weight_decay=inf", "training.weight_decay=inf must be a finite number >= 0"),
        ("training.grad_clip=nan", "training.grad_clip=nan must be a finite number >= 0"),
        ("training.beta1=1", "training.beta1=1.0 must be in [0, 1)"),
        ("training.beta2=-0.5", "training.beta2=-0.5 must be in [0, 1)"),
        ("training.grad_clip=-1", "training.grad_clip=-1.0 must be >= 0"),
        ("training.seed=-1", "training.seed=-1 must be in [0, 4294967295]"),
        ("training.stop_at=0", "training.stop_at=0 must be between 1 and training.steps=300 (or null)"),
        ("training.stop_at=301", "training.stop_at=301 must be between 1 and training.steps=300 (or null)"),
        ("training.dtype=float16", "training.dtype='float16' is not one of bfloat16, float32"),
        ("model.fp8=true", "model.fp8=true is for serve.py's decode only: train.py trains in training.dtype"),
        ("data.jsonl_field=", "data.jsonl_field must name the field holding each line's text"),
        ("data.path=", "data.path is empty: give a path, or null"),
        ("checkpoint.init_from=", "checkpoint.init_from is empty: give a path, or null"),
        ("checkpoint.every=-1", "checkpoint.every=-1 must be >= 0"),
        ("checkpoint.keep=0", "checkpoint.keep=0 must be >= 1"),
        ("eval.path=", "eval.path is empty: give a path, or null"),
        ("eval.every=-1", "eval.every=-1 must be >= 0"),
        ("eval.batches=0", "eval.batches=0 must be >= 1 (or null: the whole held-out corpus)"),
        ("logging.every=0", "logging.every=0 must be >= 1"),
        (
            "logging.profile_at=301",
            "logging.profile_at=301 must be between 1 and training.steps=300 (or null)",
        ),
        ("logging.profile_steps=0", "logging.profile_steps=0 must be >= 1"),
    ],
)
def test_train_values_are_checked(override: str, message: str) -> None:
    assert error_line("train", override) == message


def test_every_training_key_is_documented_in_the_schema() -> None:
    """The README's promise that every key is documented in configs/schema.py: each training.* key has
    a comment of its own above it."""
    source = (ROOT / "configs" / "schema.py").read_text()
    lines = source.splitlines()
    (group,) = [node for node in ast.parse(source).body if getattr(node, "name", None) == "TrainingConfig"]
    keys = [field for field in group.body if isinstance(field, ast.AnnAssign)]
    undocumented = [key.target.id for key in keys if not lines[key.lineno - 2].lstrip().startswith("#")]
    assert not undocumented


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mode=chat", "mode='chat' is not one of bench, generate"),
        ("checkpoint=", "checkpoint is empty: give a path, or null"),
        ("max_new_tokens=0", "max_new_tokens=0 must be >= 1"),
        ("max_new_tokens=-1", "max_new_tokens=-1 must be >= 1"),
        ("temperature=-0.5", "temperature=-0.5 must be a finite number >= 0: set temperature (0 is greedy)"),
        ("temperature=inf", "temperature=inf must be a finite number >= 0: set temperature (0 is greedy)"),
        ("top_k=-1", "top_k=-1 must be >= 0"),
        ("top_p=1.5", "top_p=1.5 is outside (0, 1]"),
        ("batch_size=0", "batch_size=0 must be >= 1"),
        ("prompt_len=0", "prompt_len=0 must be >= 1"),
        ("decode_steps=0", "decode_steps=0 must be >= 1"),
        ("dtype=fp8", "dtype='fp8' is not one of bfloat16, float16, float32"),
        ("seed=-3", "seed=-3 must be in [0, 4294967295]"),
        (
            "parallel.fsdp=true",
            "parallel.fsdp=true is for train.py only: serve.py splits a model with parallel.tp",
        ),
        (
            "parallel.dp_replicate=2",
            "parallel.dp_replicate=2 is for train.py only: serve.py splits a model with parallel.tp",
        ),
        ("+serve.foo=1", "unknown key serve: the top-level keys are model, parallel, mode,"),
    ],
)
def test_serve_values_are_checked(override: str, message: str) -> None:
    assert error_line("serve", override).startswith(message)


def test_presets_pass_the_checks() -> None:
    for model in ("debug", "llama3_8b", "llama3_70b", "llama3_405b"):
        cfg = composed("train", f"model={model}")
        check_keys(cfg)
        validate_train_config(cfg)
        OmegaConf.to_object(cfg.model).validate()
    validate_serve_config(composed("serve"))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_heads", 0, "model.n_heads=0 must be > 0"),
        ("n_kv_heads", 0, "model.n_kv_heads=0 must be > 0"),
        ("dim", -8, "model.dim=-8 must be > 0"),
        ("max_seq_len", 0, "model.max_seq_len=0 must be > 0"),
        ("norm_eps", 0.0, "model.norm_eps=0.0 must be a finite number > 0"),
        ("norm_eps", math.inf, "model.norm_eps=inf must be a finite number > 0"),
        ("rope_theta", -1.0, "model.rope_theta=-1.0 must be a finite number > 0"),
        ("rope_theta", math.inf, "model.rope_theta=inf must be a finite number > 0"),
        ("init_std", math.inf, "model.init_std=inf must be a finite number > 0"),
        ("init_std", math.nan, "model.init_std=nan must be a finite number > 0"),
    ],
)
def test_model_shape_is_checked(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ModelArgs(**{field: value}).validate()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("factor", 0.0, "model.rope_scaling.factor=0.0 must be a finite number > 0"),
        ("factor", "inf", "model.rope_scaling.factor=inf must be a finite number > 0"),
        ("high_freq_factor", "inf", "model.rope_scaling.low_freq_factor=1.0 must be > 0 and below"),
        ("original_max_position", 0, "model.rope_scaling.original_max_position=0 must be > 0"),
        ("low_freq_factor", 4.0, "model.rope_scaling.low_freq_factor=4.0 must be > 0 and below"),
        ("low_freq_factor", 0.0, "model.rope_scaling.low_freq_factor=0.0 must be > 0 and below"),
    ],
)
def test_rope_scaling_is_checked(field: str, value: float, message: str) -> None:
    # Before any work: factor 0 used to train to a NaN loss at step 1, blamed on the learning rate.
    cfg = composed("train", "model=llama3_8b", f"model.rope_scaling.{field}={value}")
    validate_train_config(cfg)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        OmegaConf.to_object(cfg.model).validate()


def _report(rank: int, world: int, failing: list[int], out: Path) -> None:
    """Ranks in `failing` meet a user error; the others stand for ranks still at work (in a collective)."""
    from parallel import distributed

    sys.stderr = open(out / f"rank{rank}.txt", "w")  # noqa: SIM115
    if rank in failing:
        distributed.print_error_once("training.steps=0 must be >= 1", wait_s=2.0)
    if rank not in failing or len(failing) < world:
        torch.distributed.barrier()
    sys.stderr.close()


def test_error_met_by_every_rank_prints_once(tmp_path: Path) -> None:
    run_ranks(_report, 2, [0, 1], tmp_path)
    assert (tmp_path / "rank0.txt").read_text() == "training.steps=0 must be >= 1\n"
    assert (tmp_path / "rank1.txt").read_text() == ""


def test_error_met_by_one_rank_names_it(tmp_path: Path) -> None:
    run_ranks(_report, 2, [1], tmp_path)
    assert (tmp_path / "rank0.txt").read_text() == ""
    assert (tmp_path / "rank1.txt").read_text() == "[rank 1] training.steps=0 must be >= 1\n"


def assert_one_error_line(done, text: str) -> None:
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and text in lines[0], done.stderr[-3000:]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("script", "overrides", "text"),
    [
        ("train.py", ["training.stepz=5"], "unknown key training.stepz: training's keys are steps"),
        ("train.py", ["+training.stepz=5"], "unknown key training.stepz: training's keys are steps"),
        ("train.py", ["model=model_schema"], "the choices for model are debug, llama3_405b"),
        ("train.py", ["model.rope_scaling.factor=8"], "cannot set model.rope_scaling.factor: model.rope_"),
        ("serve.py", ["model.rope_scaling={factor:8.0}"], "start from a preset that sets model.rope_scaling"),
        ("train.py", ["training.steps=abc"], "could not be converted to Integer"),
        ("serve.py", ["mode=generate", "max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
        ("serve.py", ["mode=generate", "max_new_tokens=-1"], "max_new_tokens=-1 must be >= 1"),
        ("serve.py", ["model=llama3_405b"], "serving model llama3_405b needs about"),
        ("serve.py", ["prompt=hi"], "mode=bench ignores prompt=hi (mode=generate reads it): set mode="),
        ("serve.py", ["mode=generate", "batch_size=8", "decode_steps=9"], "ignores batch_size=8, decode"),
        ("serve.py", ["mode=generate", "messages=chat.json", "prompt=Hi"], "so prompt=Hi would be ignored"),
        ("serve.py", ["mode=generate", "prompt=1e3"], "prompt=1e3 is read as the float 1000.0, so the"),
        (
            "serve.py",
            ["mode=generate", "prompt='echo ${HOME}'"],
            "reads the ${...} in it as an interpolation",
        ),
        ("serve.py", ["mode=generate", "prompt=${model.n_layers}"], "write \\${ for each literal ${"),
        ("train.py", ["training.steps"], "'training.steps': an override is key=value (+key=value adds"),
        ("serve.py", ["mode=generate", "prompt=a, b"], "quote the value inside the shell's quotes"),
        # The suggestion for a quote in the value parses (test_a_suggested_quoting_is_the_text_typed).
        ("serve.py", ["mode=generate", "prompt=Qu'est"], "inside the shell's: prompt=\"'Qu\\'est'\""),
        ("serve.py", ["mode=generate", "prompt='Qu'est'"], "inside the shell's: prompt=\"'Qu\\'est'\""),
        ("train.py", ["hydra.job.chdir=true"], "hydra.job.chdir=true is not supported: weft reads relative"),
        ("serve.py", ["hydra.job.chdir=true"], "hydra.job.chdir=true is not supported: weft reads relative"),
    ],
)
def test_script_prints_one_error_line(tmp_path: Path, script: str, overrides: list[str], text: str) -> None:
    done = run_script(script, *overrides, "device=cpu", f"hydra.run.dir={tmp_path}")
    assert_one_error_line(done, text)


def test_a_suggested_quoting_is_the_text_typed() -> None:
    assert composed("serve", "mode=generate", "prompt='Qu\\'est'").prompt == "Qu'est"


def test_a_refused_serve_launch_leaves_no_run_directory(tmp_path: Path) -> None:
    """serve.py makes a run directory per launch: one refused before it logged anything is removed (as
    train.py's is); a directory that held anything else stays."""
    done = run_script(
        "serve.py", "mode=generate", "max_new_tokens=0", "device=cpu", f"hydra.run.dir={tmp_path / 'a'}"
    )
    assert_one_error_line(done, "max_new_tokens=0 must be >= 1")
    assert not (tmp_path / "a").exists()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    done = run_script(
        "serve.py", "mode=generate", "max_new_tokens=0", "device=cpu", f"hydra.run.dir={tmp_path / 'b'}"
    )
    assert_one_error_line(done, "max_new_tokens=0 must be >= 1")
    assert (tmp_path / "b" / "notes.txt").read_text() == "mine"


def test_an_escaped_interpolation_is_the_prompt_typed() -> None:
    """prompt='echo \\${HOME}' (as the refusal above says to write it) passes the check and reaches the
    prompt as the text typed."""
    override = "prompt='echo \\${HOME}'"
    check_prompt_override([override])
    assert composed("serve", "mode=generate", override).prompt == "echo ${HOME}"


def test_an_omegaconf_error_without_a_message_is_named_by_its_text() -> None:
    assert one_line(InterpolationKeyError("Interpolation key 'HOME' not found")) == (
        "Interpolation key 'HOME' not found"
    )


@pytest.mark.parametrize("under", ["", "sub"])
def test_run_directory_that_cannot_be_made(tmp_path: Path, under: str) -> None:
    """hydra.run.dir naming a file (or a path under one): Hydra fails to make it, before weft's task."""
    file = tmp_path / "a_file"
    file.write_text("")
    done = run_script("train.py", "device=cpu", f"hydra.run.dir={file / under if under else file}")
    assert_one_error_line(done, f"cannot make the run directory {file}")
    assert "set hydra.run.dir to a directory you can write" in done.stderr


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_run_directory_where_none_can_be_made() -> None:
    """A FileNotFoundError from Hydra's makedirs (a user error type weft knows) names hydra.run.dir too."""
    done = run_script("train.py", "device=cpu", "hydra.run.dir=/proc/weft_run")
    assert_one_error_line(done, "cannot make the run directory /proc/weft_run: No such file or directory")


@pytest.mark.skipif(
    (memory.available_memory(torch.device("cpu")) or 0) > 140 * GIB, reason="this host could train llama3_8b"
)
def test_train_llama3_8b_on_cpu_is_refused(tmp_path: Path) -> None:
    done = run_script("train.py", "model=llama3_8b", "device=cpu", f"hydra.run.dir={tmp_path}")
    assert_one_error_line(done, "training model llama3_8b needs about 146.4 GiB per rank")
    assert not (tmp_path / "checkpoints").exists()


def test_help_offers_no_schema() -> None:
    done = run_script("train.py", "--help")
    assert done.returncode == 0
    assert "model: debug, llama3_405b, llama3_70b, llama3_8b" in done.stdout
    assert "schema" not in done.stdout.split("== Config ==")[0]


def test_full_error_shows_the_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    done = run_script("train.py", "training.steps=0", "device=cpu", f"hydra.run.dir={tmp_path}")
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.strip().endswith("ValueError: training.steps=0 must be >= 1")


def test_torchrun_prints_the_error_once(tmp_path: Path) -> None:
    done = run_script("train.py", "training.steps=0", "device=cpu", f"hydra.run.dir={tmp_path}", torchrun=2)
    assert done.returncode != 0
    assert done.stderr.count("training.steps=0 must be >= 1") == 1, done.stderr[-3000:]
    assert "[rank" not in done.stderr


def test_torchrun_prints_a_bad_corpus_once(tmp_path: Path) -> None:
    """Rank 0 tokenizes while the others wait: its error on a bad line reaches every rank as that error
    (one line), not as the waiting ranks' broken barrier."""
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "hello world"}\n{"body": "x"}\n')
    done = run_script(
        "train.py",
        "training.steps=2",
        f"data.path={corpus}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "device=cpu",
        f"hydra.run.dir={tmp_path / 'run'}",
        torchrun=2,
    )
    assert done.returncode != 0
    assert done.stderr.count("bad.jsonl:2 has no field 'text'") == 1, done.stderr[-3000:]
    # (torchrun's own summary of the failed workers follows, as for every error under it.)
    assert "[rank" not in done.stderr and "Connection closed" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_while_serving_stops_with_one_line(tmp_path: Path, ranks: int) -> None:
    """Ctrl-C during a completion (on every rank, as the terminal and torchrun deliver it) stops with
    one line and the shell's code for SIGINT, not a KeyboardInterrupt traceback per rank."""
    script = tmp_path / "interrupted_serve.py"
    script.write_text(
        "import runpy, signal, sys\n"
        "from model.generate import DecodeStep\n"
        "def interrupted(self, tokens, pos):\n"
        "    signal.raise_signal(signal.SIGINT)\n"
        "DecodeStep.__call__ = interrupted\n"
        "sys.argv = ['serve.py', *sys.argv[1:]]\n"
        f"runpy.run_path({str(ROOT / 'serve.py')!r}, run_name='__main__')\n"
    )
    overrides = ["mode=generate", "device=cpu", f"hydra.run.dir={tmp_path / 'run'}", f"parallel.tp={ranks}"]
    done = run_script(str(script), *overrides, torchrun=ranks if ranks > 1 else 0)
    if ranks == 1:
        assert done.returncode == 128 + signal.SIGINT, done.stderr[-3000:]
        assert done.stderr.strip() == "SIGINT: stopped", done.stderr[-3000:]
    assert done.stderr.count("SIGINT: stopped") == 1, done.stderr[-3000:]
    assert "KeyboardInterrupt" not in done.stderr and "[rank" not in done.stderr, done.stderr[-3000:]


def test_a_sweep_goes_on_past_a_refused_and_a_diverged_job(tmp_path: Path) -> None:
    """A sweep job's user error, or a run that stops itself, fails that job alone (as Hydra's sweeper
    does for any failed job): the next job trains, and the sweep exits 1 once all have run."""
    done = run_script(
        "train.py", "-m", *TINY, CPU, "training.steps=2", "training.grad_clip=0",
        "training.batch_size=0,4", "training.lr=1e9,1e-3", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert "training.batch_size=0 must be >= 1" in done.stderr
    assert "the gradient norm became nan" in done.stderr or "loss became nan" in done.stderr
    assert "Traceback" not in done.stderr
    # Jobs 0 and 1 (batch size 0) were refused, leaving no run directory; job 2 diverged; job 3 trained.
    assert not (tmp_path / "0").exists() and not (tmp_path / "1").exists()
    assert (tmp_path / "3" / "checkpoints").is_dir()


def test_sweep_jobs_sharing_a_run_directory_keep_their_own_records(tmp_path: Path) -> None:
    """Every job of a sweep has the sweep's launch time: with hydra.sweep.subdir forcing one run
    directory, the jobs' records are told apart by job number, so the refused second job removes its
    own record and not the first job's."""
    done = run_script(
        "train.py", "-m", *TINY, CPU, "training.steps=1", "training.batch_size=4,0",
        f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=shared",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    (record,) = (tmp_path / "shared" / "launches").iterdir()
    assert record.name.endswith("-job0"), record.name
    assert "training.batch_size=4" in (record / "overrides.yaml").read_text()


def test_a_sweep_directory_that_cannot_be_made_is_named() -> None:
    done = run_script("train.py", "-m", CPU, "training.lr=1e-3,3e-3", "hydra.sweep.dir=/proc/weft_sweep")
    assert_one_error_line(done, "cannot make the run directory /proc/weft_sweep")
    assert "set hydra.sweep.dir to a directory you can write" in done.stderr


@pytest.mark.parametrize("script", ["train.py", "serve.py"])
def test_a_leftover_world_size_is_named(script: str) -> None:
    cmd, env = script_command(script, CPU)
    env = {k: v for k, v in env.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(cmd, cwd=ROOT, env={**env, "WORLD_SIZE": "2"}, capture_output=True, text=True)
    assert_one_error_line(done, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not: launch")

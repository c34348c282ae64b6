"""Start a Hydra entry point (train.py, serve.py) the same way on one process or under torchrun, and
report a user's mistake as one line.

A user error is a bad value, key, preset, file or layout: a ValueError raised with a message that says
what to change (weft's convention), a missing file, a comm path that cannot run here, or one of
Hydra's config errors. It prints as one line on stderr, once for all ranks, and exits with status 1;
HYDRA_FULL_ERROR=1 shows its traceback instead. Any other exception is a bug and keeps its traceback.
Ctrl-C that reaches the entry point (serve.py; train.py stops by itself) prints one line and exits 130.
In a sweep (-m) a job's user error, or a run that stops itself (train.py's `stop_run`: a diverged loss,
a failed save), is printed and fails that job alone: the sweep goes on with the next job, as Hydra's
sweeper does for any failed job, and exits 1 once all have run. A stop by a signal ends the sweep.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import is_dataclass

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from configs.schema import register_configs, register_resolvers
from configs.validate import override_key, unknown_key_message
from parallel import distributed
from parallel.comm import CommUnavailable

USER_ERRORS = (ValueError, FileNotFoundError, CommUnavailable, HydraException, OmegaConfBaseException)


class UserError(BaseException):
    """A user error on its way out of a Hydra task function. Being no `Exception`, it passes Hydra's
    job runner, which would print 'Error executing job ...' before the traceback."""


class JobFailed(Exception):
    """A sweep job's failure, already printed. Being an `Exception`, Hydra's job runner records it and
    its sweeper runs the next job; once every job has run, it raises the first failure."""


def in_sweep() -> bool:
    """Whether the running Hydra task is a job of a sweep (-m)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# Whether a Hydra task function has started: an OSError before it is Hydra making the run directory.
_task_started = False


@contextmanager
def user_errors() -> Iterator[None]:
    """The body of train.py's and serve.py's Hydra task function runs inside this."""
    global _task_started
    _task_started = True
    try:
        yield
    except USER_ERRORS as err:
        if in_sweep():
            distributed.print_error_once(one_line(err))
            raise JobFailed(one_line(err)) from err
        raise UserError(err) from err
    except SystemExit as err:
        # A run that stopped itself: exit code 1, or the message rank 0 prints (`stop_run`). An exit
        # code from 128 on is a stop by a signal, which ends the sweep too.
        stopped = isinstance(err.code, str) or (isinstance(err.code, int) and 0 < err.code < 128)
        if not (stopped and in_sweep()):
            raise
        if isinstance(err.code, str):
            print(err.code, file=sys.stderr, flush=True)
        raise JobFailed(str(err.code)) from err


def one_line(err: BaseException) -> str:
    """The message of a user error on one line (Hydra's and OmegaConf's span several)."""
    first = str(err).strip().split("\n")[0].strip()
    cause = err.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and is_dataclass(cause.object_type):
        return unknown_key_message(cause.full_key, cause.object_type)
    if isinstance(err, MissingConfigException) and err.options:
        group = err.missing_cfg_file.rpartition("/")[0]
        return f"{first}; the choices for {group} are {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        key, equals, value = err.override.partition("=")
        if not equals:
            return (
                f"cannot parse the override {err.override!r}: an override is key=value (+key=value adds a "
                "key, ~key removes one)"
            )
        # Inside Hydra's single quotes a quote is written \' (a quoted value typed already: its quotes
        # come off first, so that the suggestion parses).
        if len(value) > 1 and value[0] == value[-1] == "'":
            value = value[1:-1]
        value = value.replace("\\'", "'").replace("'", "\\'")
        return (
            f"cannot parse the override {err.override!r} ({first}): a value with brackets, colons, commas, "
            f"quotes or non-ASCII letters goes in single quotes inside the shell's: {key}=\"'{value}'\""
        )
    if first.startswith("Ambiguous value for argument"):
        # Hydra reads an unquoted comma as a sweep; its own hint is on the lines one_line drops.
        return f"{first}: quote the value inside the shell's quotes (key=\"'a, b'\"), or add -m to sweep it"
    if isinstance(err, HydraException) and isinstance(cause, OmegaConfBaseException):
        return f"{first}: {str(cause.msg).split(chr(10))[0]}"
    if isinstance(err, OmegaConfBaseException):
        return str(err.msg or err).split("\n")[0]  # (msg is None where OmegaConf raised it bare)
    return first


def command_line_overrides() -> list[str]:
    """The overrides the running Hydra task was launched with (none outside one)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return []
    # As typed: resolving would read a ${...} in an override's value as an interpolation.
    return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)


# Settings that are null in some presets and structured where set.
NULLABLE_SETTINGS = ("model.rope_scaling",)


def null_setting_error(err: BaseException, overrides: list[str]) -> ValueError | None:
    """The user error behind OmegaConf's failure to set a key inside a null structured setting, or None
    where no override reaches into one (then the failure is a bug)."""
    for override in overrides:
        key = override_key(override)
        for setting in NULLABLE_SETTINGS:
            if key == setting or key.startswith(f"{setting}."):
                return ValueError(
                    f"cannot set {key}: {setting} is null in this preset, and Hydra cannot fill a null "
                    f"setting from the command line ({type(err).__name__}); start from a preset that sets "
                    f"{setting} (model=llama3_8b) and override its other keys"
                )
    return None


def multirun(argv: list[str]) -> bool:
    """Whether the command line asks Hydra for a sweep (-m, --multirun or hydra.mode=MULTIRUN): what
    can be known before Hydra has made its config (`in_sweep` asks that config, once a job runs)."""
    return any(arg in ("-m", "--multirun") or arg.replace("+", "") == "hydra.mode=MULTIRUN" for arg in argv)


def run_dir_error(err: OSError) -> ValueError:
    """The user error of Hydra failing to make the run directory, or a sweep's (before the task
    function runs)."""
    key = "hydra.sweep.dir" if multirun(sys.argv[1:]) else "hydra.run.dir"
    error = ValueError(
        f"cannot make the run directory {err.filename}: {err.strerror}; set {key} to a directory you can "
        "write"
    )
    error.__cause__ = err
    return error


def launch(main: Callable[[], None]) -> None:
    """Join the torchrun group first, so that every rank agrees on one run directory and only rank 0
    writes Hydra's logs and config copies; then run the Hydra `main`, and leave the group after."""
    try:
        distributed.init_distributed()
    except ValueError as err:  # a half-set torchrun environment
        print(err, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    register_configs()
    register_resolvers()
    sys.argv += distributed.hydra_overrides_for_rank()
    show_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises its config errors here instead of printing them
    try:
        main()
    except JobFailed:  # a sweep whose every job has run, some failing (each printed its error)
        distributed.shutdown()
        raise SystemExit(1) from None
    except UserError as err:
        error = err.__cause__
    except USER_ERRORS as err:  # Hydra's config errors, raised before the task function runs
        # A FileNotFoundError there is Hydra failing to make the run directory (MissingConfigException is
        # an OSError too, of no file).
        making_run_dir = isinstance(err, FileNotFoundError) and err.filename is not None
        error = run_dir_error(err) if making_run_dir and not _task_started else err
    except OSError as err:
        if _task_started:
            distributed.shutdown()
            raise
        error = run_dir_error(err)
    except (AssertionError, AttributeError) as err:
        # OmegaConf cannot merge into a structured setting that is null (debug's model.rope_scaling):
        # its assertion is no bug of the user's command, but the command can be changed.
        error = null_setting_error(err, sys.argv[1:])
        if error is None:
            distributed.shutdown()
            raise
    except KeyboardInterrupt as err:
        # Ctrl-C reaches every rank (from the terminal, and again from torchrun): one line, not a
        # traceback per rank, and the shell's code for it. The peers may be gone: no meeting.
        if distributed.rank() == 0:
            print("\nSIGINT: stopped", file=sys.stderr, flush=True)
        distributed.shutdown_after(err)
        raise SystemExit(128 + signal.SIGINT) from None
    except BaseException as err:
        distributed.shutdown_after(err)  # no meeting: the peers may never get there
        raise
    else:
        distributed.leave()
        return
    if show_traceback:
        distributed.shutdown()
        raise error
    distributed.print_error_once(one_line(error))
    distributed.shutdown()
    raise SystemExit(1)

"""Test-wide settings: deterministic CPU math, skip markers for GPU tests, `--failures-at-once`, and
token files kept out of ~/.cache."""

import os
from collections.abc import Iterator

import pytest
import torch

from parallel.shared_gpu import shared_gpu_ranks


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--failures-at-once",
        action="store_true",
        help="print each failure's traceback as soon as it happens, so that a run cut short by a timeout "
        "still says why a test failed (benchmarks/run_node.sh)",
    )


def pytest_exception_interact(node: pytest.Item | pytest.Collector, report: pytest.TestReport) -> None:
    if node.config.getoption("--failures-at-once"):
        terminal = node.config.pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\n--- {report.nodeid} failed ({report.when}):\n{report.longreprtext}\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    ranks = max(gpus, shared_gpu_ranks()) if gpus else 0
    for item in items:
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible"))
        need = item.get_closest_marker("multigpu")
        if need is not None:
            want = need.kwargs.get("n", 2)
            if ranks < want:
                reason = f"needs {want} ranks on CUDA GPUs; no GPU is visible"
                if gpus:
                    reason = (
                        f"needs {want} ranks on CUDA GPUs; {gpus} visible (to share them: python -m "
                        f"parallel.shared_gpu --ranks {want} -- python -m pytest -m multigpu)"
                    )
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _token_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The token files of the corpora the tests train on (data.cache_dir's default, under
    $XDG_CACHE_HOME) go to a temporary directory, not the user's ~/.cache; train.py's subprocesses
    inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        yield


os.environ.setdefault("OMP_NUM_THREADS", "2")
# Without a GPU, Triton kernels run in Triton's interpreter; set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""The shared-GPU mode's host logic on CPU: the launcher's command, SM share and layout checks, the
device of each rank, and the symm_mem path's refusal (the kernels themselves: `pytest -m multigpu`
through `python -m parallel.shared_gpu`)."""

import sys

import pytest
import torch

from parallel import distributed, mesh
from parallel.distributed import gpu_of_rank
from parallel.mesh import ParallelDims, validate_decode_graphs, validate_device
from parallel.shared_gpu import check_layout, command_for, main, sm_percentage


def test_scripts_run_under_torchrun_and_commands_as_given() -> None:
    assert command_for(4, ["train.py", "parallel.tp=2"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
        "train.py", "parallel.tp=2",
    ]  # fmt: skip
    assert command_for(2, ["python", "-m", "pytest", "-m", "multigpu"]) == [
        "python", "-m", "pytest", "-m", "multigpu",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="give a script"):
        command_for(2, [])


def test_each_rank_gets_an_even_share_of_its_gpu() -> None:
    assert sm_percentage(2, 1) == 50
    assert sm_percentage(4, 1) == 25
    assert sm_percentage(3, 1) == 33
    assert sm_percentage(4, 2) == 50
    assert sm_percentage(3, 2) == 50  # two ranks on the busier GPU


def test_layouts_with_nothing_to_share_fail_clearly() -> None:
    check_layout(4, 1)
    with pytest.raises(ValueError, match="no CUDA GPU"):
        check_layout(2, 0)
    with pytest.raises(ValueError, match="nothing to share; run torchrun --nproc_per_node=2"):
        check_layout(2, 2)


def test_launcher_without_a_command_says_what_to_give(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--ranks", "2"])
    assert exit_info.value.code == 2
    assert "give a script" in capsys.readouterr().err


def test_ranks_share_gpus_only_when_there_are_more_ranks() -> None:
    assert [gpu_of_rank(r, 4, 8) for r in range(4)] == [0, 1, 2, 3]
    assert [gpu_of_rank(r, 4, 1) for r in range(4)] == [0, 0, 0, 0]
    assert [gpu_of_rank(r, 4, 2) for r in range(4)] == [0, 0, 1, 1]


def test_symm_mem_path_refuses_ranks_sharing_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert distributed.shared_gpu() and mesh.shared_gpu()
    dims = ParallelDims(dp=1, cp=1, tp=2, comm="symm_mem")
    with pytest.raises(ValueError, match=r"symm_mem cannot run with ranks sharing a GPU.*comm=triton"):
        validate_device(dims, torch.device("cuda", 0))
    validate_device(ParallelDims(dp=1, cp=1, tp=2, comm="triton"), torch.device("cuda", 0))


def test_graphed_decode_on_the_stock_path_refuses_ranks_sharing_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    torch_path = ParallelDims(dp=1, cp=1, tp=2, comm="torch")
    with pytest.raises(
        ValueError, match=r"cuda_graphs=true with ranks sharing a GPU needs parallel\.comm=triton"
    ):
        validate_decode_graphs(torch_path, cuda_graphs=True)
    validate_decode_graphs(torch_path, cuda_graphs=False)
    validate_decode_graphs(ParallelDims(dp=1, cp=1, tp=2, comm="triton"), cuda_graphs=True)

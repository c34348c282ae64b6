"""Tensor + sequence parallel Llama on gloo at world sizes 2 and 4 (fp32): logits, loss and every
parameter gradient equal the single-process model within 1e-5; also FSDP2 x TP (dp=2, tp=2), TP x
Ulysses (tp=2, cp=2), TP without sequence parallelism, greedy generation at tp=2 equal to tp=1, a
checkpoint saved at tp=2 loading at tp=1 and tp=4, and a Hugging Face export at tp=2 or FSDP2 equal to
the plain model's, gathered one tensor at a time."""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.args import ModelArgs
from model.checkpoint import CheckpointWriteError, LazyTensors, latest_checkpoint, load_checkpoint
from model.generate import generate
from model.hf import expected_shapes, export_hf
from model.llama import Llama
from model.tokenizer import ByteTokenizer
from parallel.checkpoint import (
    _full,
    export_parallel_hf,
    full_model_state,
    full_optimizer_state,
    init_parallel_weights,
    load_parallel_checkpoint,
    save_parallel_checkpoint,
)
from parallel.comm import OPS, CommUnavailable, TorchComm, check_ops, make_comm
from parallel.loss import cross_entropy
from parallel.mesh import (
    ParallelDims,
    build_mesh,
    data_parallel_rank,
    parallel_dims,
    tensor_parallel_ops,
    validate_comm_ops,
    validate_device,
    validate_model,
)
from parallel.parallelize import ParallelizeConfig, clip_grad_norm_, parallelize_llama
from tests.multiprocess import run_ranks

TOL = {"rtol": 1e-5, "atol": 1e-5}


def small_args(tie: bool = False) -> ModelArgs:
    return ModelArgs(
        name="tp-test",
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=64,
        ffn_hidden=96,
        rope_theta=10000.0,
        max_seq_len=64,
        tie_embeddings=tie,
    )


def full_model(args: ModelArgs, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    model = Llama(args)
    model.init_weights()
    return model


@dataclass
class Case:
    tp: int
    dp: int = 1
    cp: int = 1
    tie: bool = False
    sequence_parallel: bool = True
    save_gathered: bool = True
    activation_checkpointing: bool = False
    dp_replicate: int = 1


def _check_training(case: Case, rank: int, world: int) -> None:
    args = small_args(case.tie)
    reference = full_model(args)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    bsz, seq = 4, 16
    tokens = torch.randint(0, args.vocab_size, (bsz, seq))
    targets = torch.randint(0, args.vocab_size, (bsz, seq))
    ref_logits = reference(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()

    dims = ParallelDims(dp=case.dp, cp=case.cp, tp=case.tp, dp_replicate=case.dp_replicate)
    validate_model(dims, args, seq_len=seq)
    mesh = build_mesh(dims, "cpu")
    cfg = ParallelizeConfig(
        sequence_parallel=case.sequence_parallel,
        save_gathered=case.save_gathered,
        activation_checkpointing=case.activation_checkpointing,
    )
    parallelize_llama(model, mesh, cfg)
    # This rank's data: its dp slice of the batch, its cp chunk of the sequence.
    dp_rank, cp_rank = data_parallel_rank(mesh), mesh["cp"].get_local_rank()
    rows = slice(dp_rank * bsz // case.dp, (dp_rank + 1) * bsz // case.dp)
    cols = slice(cp_rank * seq // case.cp, (cp_rank + 1) * seq // case.cp)
    logits = model(tokens[rows, cols])
    loss = cross_entropy(model, logits, targets[rows, cols])
    loss.backward()

    state = model.parallel
    if state.tp_group is not None and not model.output.gather_output:
        gathered = [torch.empty_like(logits) for _ in range(case.tp)]
        dist.all_gather(gathered, logits.contiguous(), group=state.tp_group)
        logits = torch.cat(gathered, dim=-1)
    torch.testing.assert_close(logits, ref_logits[rows, cols], **TOL)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)  # the tp ranks of a batch hold the same loss
    torch.testing.assert_close(mean_loss, ref_loss.detach(), **TOL)

    ref_params = dict(reference.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), "parameter names or order differ from the plain model"
    for name, p in model.named_parameters():
        grad = _full(p.grad, name, state)
        torch.testing.assert_close(grad, ref_params[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")

    # Gradient clipping sees the global norm.
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    norm = clip_grad_norm_(model, 1e9)
    torch.testing.assert_close(norm, ref_norm, **TOL)
    # ... and scales every gradient as the plain model's clipping does.
    torch.nn.utils.clip_grad_norm_(reference.parameters(), ref_norm.item() / 3)
    clip_grad_norm_(model, ref_norm.item() / 3)
    for name, p in model.named_parameters():
        grad = _full(p.grad, name, state)
        torch.testing.assert_close(grad, ref_params[name].grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def meta_built_model(args: ModelArgs, seed: int) -> Llama:
    """The plain model as serve.py builds it: on the meta device, then materialised and initialised."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _check_generation(rank: int, world: int) -> None:
    from serve import build_model

    args = small_args()
    reference = meta_built_model(args, seed=3)
    # serve.py's tensor-parallel model: planned on the meta device, each rank materialising its slice
    # of the weights the unsharded model draws from the same seed.
    mesh = build_mesh(ParallelDims(dp=world // 2, cp=1, tp=2), "cpu")
    torch.manual_seed(3)
    model = build_model(args, None, torch.device("cpu"), torch.float32, mesh, "torch")
    full = full_model_state(model)
    for name, t in reference.state_dict().items():
        assert torch.equal(full[name], t), name
    torch.manual_seed(2)
    prompt = torch.randint(0, args.vocab_size, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(prompt), reference(prompt), **TOL)
    expected = generate(reference, prompt, 12, cuda_graph=False)
    got = generate(model, prompt, 12, cuda_graph=False)
    assert torch.equal(got, expected), (got, expected)
    # The decode step compiled as one graph: the collectives are registered ops (weft::tp_all_reduce,
    # weft::tp_all_gather).
    got = generate(model, prompt, 12, cuda_graph=False, compile=True)
    assert torch.equal(got, expected), (got, expected)


def _check_meta_init(rank: int, world: int) -> None:
    """init_parallel_weights on a model parallelized on the meta device (tp=2, FSDP over dp=2, tied and
    untied embeddings) gives every rank its slice of the unsharded model's weights."""
    for tie in (False, True):
        args = small_args(tie)
        reference = meta_built_model(args, seed=4)
        with torch.device("meta"):
            model = Llama(args)
        parallelize_llama(model, build_mesh(ParallelDims(dp=2, cp=1, tp=2), "cpu"), ParallelizeConfig())
        model.to_empty(device="cpu")
        torch.manual_seed(4)
        init_parallel_weights(model)
        assert model.parallel.fsdp
        assert (model.output.weight is model.tok_embeddings.weight) == tie
        full = full_model_state(model)
        for name, t in reference.state_dict().items():
            if not (tie and name == "output.weight"):
                assert torch.equal(full[name], t), (tie, name)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


def _check_fsdp_gathers_in_autocast_dtype(rank: int, world: int, tp: int, tie: bool) -> None:
    """FSDP2 with fsdp_param_dtype=bf16 under bf16 autocast (train.py's on a GPU): the blocks and an
    untied output projection compute with bf16 weights as gathered, the residual stream stays float32,
    and the loss and gradients (accumulated over two micro-batches) are those of the unsharded model
    under autocast."""
    args = small_args(tie)
    reference = full_model(args)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (4, 16))
    targets = torch.randint(0, args.vocab_size, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_logits = reference(tokens)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1).float(), targets.flatten())
    ref_loss.backward()

    dp = world // tp
    mesh = build_mesh(ParallelDims(dp=dp, cp=1, tp=tp), "cpu")
    parallelize_llama(model, mesh, ParallelizeConfig(fsdp_param_dtype=torch.bfloat16))
    seen: dict[str, torch.dtype] = {}
    block = model.layers[0]
    block.feed_forward.register_forward_pre_hook(lambda m, a: seen.update(weight=m.w1.weight.dtype))
    block.register_forward_hook(lambda m, a, out: seen.update(residual=out.dtype))
    model.output.register_forward_pre_hook(lambda m, a: seen.update(output=m.weight.dtype))
    # This rank's rows in two micro-batches, gradients reduced after the second only (train.py's
    # grad_accum): FSDP2 accumulates the bf16 gradients in fp32 in between.
    per_micro = 4 // dp // 2
    first = data_parallel_rank(mesh) * 2 * per_micro
    loss = torch.zeros(())
    for micro in range(2):
        model.set_requires_gradient_sync(micro == 1)
        rows = slice(first + micro * per_micro, first + (micro + 1) * per_micro)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            micro_loss = cross_entropy(model, model(tokens[rows]), targets[rows]) / 2
        micro_loss.backward()
        loss += micro_loss.detach()
    assert seen == {
        "weight": torch.bfloat16,
        "residual": torch.float32,
        "output": torch.float32 if tie else torch.bfloat16,  # tied: the float32 embedding
    }, seen
    dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=model.parallel.dp_group)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-4, atol=0)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == p.grad.dtype == torch.float32, name  # fp32 shards, gradients reduced in fp32
        # bf16 matmuls summed over dp in another order, norm gradients rounded to bf16.
        error = _relative_error(_full(p.grad, name, model.parallel), ref_params[name].grad)
        assert error < 2e-2, (name, error)


def _run_cases(rank: int, world: int, cases: list[Case], generation: bool) -> None:
    for case in cases:
        _check_training(case, rank, world)
    if generation:
        _check_generation(rank, world)
        for tie in (False, True):
            _check_fsdp_gathers_in_autocast_dtype(rank, world, tp=1, tie=tie)
    else:
        _check_meta_init(rank, world)
        _check_fsdp_gathers_in_autocast_dtype(rank, world, tp=2, tie=False)


WORLD2 = [
    Case(tp=2),
    Case(tp=2, tie=True, save_gathered=False, activation_checkpointing=True),
    Case(tp=2, sequence_parallel=False),
]
WORLD4 = [
    Case(tp=4),
    Case(tp=2, dp=2),
    Case(tp=2, cp=2, tie=True),
    # HSDP: two replicas, each sharded over 2 dp ranks, over 2 cp ranks, or not at all (tp=2).
    Case(tp=1, dp=4, dp_replicate=2),
    Case(tp=1, dp=2, cp=2, dp_replicate=2, tie=True),
    Case(tp=2, dp=2, dp_replicate=2),
]


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_single_process(world: int) -> None:
    run_ranks(_run_cases, world, WORLD2 if world == 2 else WORLD4, world == 2)


# -- checkpoints: saved at tp=2, loaded at tp=1 and tp=4 --------------------------------------------


def _train_step(model, tokens, targets) -> None:
    opt = model._test_opt
    loss = cross_entropy(model, model(tokens), targets)
    loss.backward()
    opt.step()
    opt.zero_grad()


def _save_at_tp2(rank: int, world: int, out: str) -> None:
    args = small_args()
    model = full_model(args)
    parallelize_llama(model, build_mesh(ParallelDims(dp=1, cp=1, tp=2), "cpu"))
    model._test_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    _train_step(model, tokens, torch.roll(tokens, -1, 1))
    # Every rank gathers; only the writer keeps the full tensors, and writes them.
    state = full_model_state(model, keep=rank == 0)
    optim = full_optimizer_state(model, model._test_opt, keep=rank == 0)
    assert (state == {} and optim == {}) == (rank != 0)
    written = save_parallel_checkpoint(out, 1, model, model._test_opt, None, None, keep=1)
    assert (written is None) == (rank != 0)
    if rank == 0:
        torch.save(tokens, Path(out) / "tokens.pt")


@contextlib.contextmanager
def one_full_tensor_at_a_time() -> Iterator[dict[str, int]]:
    """Fail if a tensor read from a checkpoint file is still alive when the next is read (AdamW's
    one-element step counts aside); yields the number of reads."""
    reads, alive = {"count": 0}, []
    original = LazyTensors.read

    def read(self: LazyTensors, name: str) -> torch.Tensor:
        alive[:] = [ref for ref in alive if ref() is not None]
        assert not alive, f"{name} read while an earlier full tensor is still held"
        tensor = original(self, name)
        reads["count"] += 1
        if tensor.numel() > 1:
            alive.append(weakref.ref(tensor))
        return tensor

    LazyTensors.read = read
    try:
        yield reads
    finally:
        LazyTensors.read = original


def _load_at_tp4(rank: int, world: int, out: str, expected: torch.Tensor) -> None:
    args = small_args()
    # tp=4, FSDP2 x TP (dp=2, tp=2; both dp ranks on the same batch, so the same update) and TP x two
    # replicas (HSDP).
    layouts = (
        ParallelDims(dp=1, cp=1, tp=4),
        ParallelDims(dp=2, cp=1, tp=2),
        ParallelDims(dp=2, cp=1, tp=2, dp_replicate=2),
    )
    for dims in layouts:
        model = full_model(args, seed=9)  # different weights: the load must replace all of them
        parallelize_llama(model, build_mesh(dims, "cpu"))
        if dims.tp == 4:  # an optimizer of other parameters is refused before any weight is replaced
            before = full_model_state(model)
            others = torch.optim.AdamW(list(model.parameters())[::-1], lr=1e-2)
            with pytest.raises(ValueError, match="holds optimizer state for other parameters"):
                load_parallel_checkpoint(latest_checkpoint(out), model, others)
            assert all(torch.equal(t, before[k]) for k, t in full_model_state(model).items())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with one_full_tensor_at_a_time() as reads:
            load_parallel_checkpoint(latest_checkpoint(out), model, opt)
        # Each weight, AdamW's step and two moments per parameter, the RNG state.
        assert reads["count"] == len(full_model(args).state_dict()) + 3 * len(opt.state) + 1
        model._test_opt = opt
        tokens = torch.load(Path(out) / "tokens.pt")
        _train_step(model, tokens, torch.roll(tokens, -1, 1))  # a second step: moments must be right
        with torch.no_grad():
            logits = model(tokens)
        gathered = [torch.empty_like(logits) for _ in range(dims.tp)]
        dist.all_gather(gathered, logits.contiguous(), group=model.parallel.tp_group)
        torch.testing.assert_close(torch.cat(gathered, -1), expected, **TOL)
        # Saving again from this layout gives back the full tensors of the plain model's shapes.
        state = full_model_state(model)
        assert {k: tuple(v.shape) for k, v in state.items()} == {
            k: tuple(v.shape) for k, v in full_model(args).state_dict().items()
        }


def test_checkpoint_saved_at_tp2_loads_at_tp1_tp4_and_fsdp_tp2(tmp_path: Path) -> None:
    run_ranks(_save_at_tp2, 2, str(tmp_path))
    args = small_args()
    # tp=1: the plain model loads the gathered checkpoint directly and continues training.
    model = full_model(args, seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(latest_checkpoint(tmp_path), model, opt)
    tokens = torch.load(tmp_path / "tokens.pt")
    loss = F.cross_entropy(model(tokens).flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
    loss.backward()
    opt.step()
    with torch.no_grad():
        expected = model(tokens)
    # The same continuation at tp=4 gives the same logits.
    run_ranks(_load_at_tp4, 4, str(tmp_path), expected)


def _save_with_a_full_disk(rank: int, world: int, out: str) -> None:
    import parallel.checkpoint

    model = full_model(small_args())
    parallelize_llama(model, build_mesh(ParallelDims(dp=2, cp=1, tp=2), "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 8))
    model._test_opt = opt
    _train_step(model, tokens, torch.roll(tokens, -1, 1))
    if rank == 0:  # the disk fills up after the first tensor

        def full_disk(path: Path, specs: list, tensors: Iterator) -> None:
            next(iter(tensors))
            raise OSError(errno.ENOSPC, "No space left on device")

        parallel.checkpoint.write_tensors = full_disk
    try:
        written = save_parallel_checkpoint(out, 1, model, opt, None, None, keep=1)
        assert rank != 0 and written is None
    except CheckpointWriteError as err:
        assert rank == 0 and "No space left on device" in str(err)
    # Every rank took part in every gather: the next collectives line up.
    full = full_model_state(model)
    assert full.keys() == full_model(small_args()).state_dict().keys()
    assert not list((Path(out) / "checkpoints").glob("*"))  # the partial directory removed


def test_a_failed_parallel_save_raises_on_rank_0_and_every_rank_goes_on(tmp_path: Path) -> None:
    run_ranks(_save_with_a_full_disk, 4, str(tmp_path))


# -- Hugging Face export of a parallel model: gathered one tensor at a time -----------------------------

# Several files of the small model's weights: the export's shards and index are compared too.
EXPORT_SHARD_BYTES = 40_000


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@contextlib.contextmanager
def one_gathered_tensor_at_a_time() -> Iterator[dict[str, int]]:
    """Fail if a gathered tensor, or its copy converted for export, is still alive when the next
    tensor is gathered; yields the number of gathers."""
    import model.hf as hf
    import parallel.checkpoint

    gathers, alive = {"count": 0}, []
    full, convert = parallel.checkpoint._full, hf.hf_tensor

    def track(tensor: torch.Tensor) -> torch.Tensor:
        alive.append(weakref.ref(tensor))
        return tensor

    def gather(t: torch.Tensor, name: str, state) -> torch.Tensor:
        alive[:] = [ref for ref in alive if ref() is not None]
        assert not alive, f"{name} gathered while an earlier full tensor is still held"
        gathers["count"] += 1
        return track(full(t, name, state))

    parallel.checkpoint._full = gather
    hf.hf_tensor = lambda name, tensor, args, dtype: track(convert(name, tensor, args, dtype))
    try:
        yield gathers
    finally:
        parallel.checkpoint._full, hf.hf_tensor = full, convert


def _export(rank: int, world: int, out: str, dims: ParallelDims, tie: bool, dtype: torch.dtype) -> None:
    model = full_model(small_args(tie))
    parallelize_llama(model, build_mesh(dims, "cpu"))
    with one_gathered_tensor_at_a_time() as gathers:
        written = export_parallel_hf(
            model, out, tokenizer=ByteTokenizer(), dtype=dtype, max_shard_bytes=EXPORT_SHARD_BYTES
        )
    assert written == (Path(out) if rank == 0 else None)
    assert gathers["count"] == len(expected_shapes(small_args(tie)))  # (a tied output weight is not one)


@pytest.mark.parametrize(
    "dims, tie, dtype",
    [
        (ParallelDims(dp=1, cp=1, tp=2), False, torch.bfloat16),
        (ParallelDims(dp=2, cp=1, tp=1), True, torch.float32),  # FSDP2
    ],
    ids=["tp2", "fsdp2-tied"],
)
def test_parallel_export_equals_the_single_process_one_and_gathers_one_tensor_at_a_time(
    tmp_path: Path, dims: ParallelDims, tie: bool, dtype: torch.dtype
) -> None:
    """export_parallel_hf writes, byte for byte, the directory export_hf writes of the plain model
    (sharded files, index, config and tokenizer), while rank 0 holds one gathered tensor at a time."""
    run_ranks(_export, dims.world, str(tmp_path / "parallel"), dims, tie, dtype)
    args = small_args(tie)
    model = full_model(args)
    single = export_hf(
        model, args, tmp_path / "single", ByteTokenizer(), dtype=dtype, max_shard_bytes=EXPORT_SHARD_BYTES
    )
    exported = files_of(tmp_path / "parallel")
    assert exported == files_of(single)
    assert "model.safetensors.index.json" in exported
    assert sum(name.endswith(".safetensors") for name in exported) > 1
    if dtype == torch.float32:  # and transformers runs it as weft runs the model
        transformers = pytest.importorskip("transformers")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "parallel").eval()
        tokens = torch.randint(0, args.vocab_size, (2, 16))
        with torch.no_grad():
            assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


def _export_with_a_full_disk(rank: int, world: int, run_dir: str) -> None:
    import model.hf as hf
    import train

    model = full_model(small_args())
    parallelize_llama(model, build_mesh(ParallelDims(dp=2, cp=1, tp=2), "cpu"))
    out = Path(run_dir) / "hf"
    export_parallel_hf(model, out, max_shard_bytes=EXPORT_SHARD_BYTES)  # an earlier export
    before = files_of(out) if rank == 0 else {}
    if rank == 0:  # the disk fills up in the second file, after its first tensor
        write = hf.write_tensors

        def full_disk(path: Path, specs: list, tensors: Iterator, metadata: dict | None = None) -> None:
            if path.name.startswith("model-00001-"):
                return write(path, specs, tensors, metadata)
            next(iter(tensors))
            raise OSError(errno.ENOSPC, "No space left on device")

        hf.write_tensors = full_disk
    try:
        written = export_parallel_hf(model, out, max_shard_bytes=EXPORT_SHARD_BYTES, overwrite=True)
        assert rank != 0 and written is None
    except CheckpointWriteError as err:
        assert rank == 0 and "No space left on device" in str(err)
    # train.py's export: every rank stops, rank 0 saying why and how to export again.
    train.launch_resume_command = lambda run_dir, step: "RESUME"
    with pytest.raises(SystemExit) as stopped:
        train.export_run(model, model.args, Path(run_dir), ByteTokenizer(), sharded=True, step=4)
    if rank == 0:
        assert (
            "No space left on device" in stopped.value.code
            and "export them with: RESUME" in stopped.value.code
        )
    else:
        assert stopped.value.code == 1
    # Every rank took part in every gather: the next collectives line up.
    full = full_model_state(model)
    assert full.keys() == full_model(small_args()).state_dict().keys()
    if rank == 0:  # the earlier export untouched, no partial directory left beside it
        assert files_of(out) == before
        assert [path.name for path in Path(run_dir).iterdir()] == ["hf"]
    # Another error on rank 0 is raised there once every rank has agreed that the export failed: the
    # others stop too, none left waiting for rank 0 in the agreement.
    if rank == 0:

        def broken(path: Path, specs: list, tensors: Iterator, metadata: dict | None = None) -> None:
            next(iter(tensors))
            raise ValueError("a broken writer")

        hf.write_tensors = broken
    with pytest.raises(ValueError if rank == 0 else SystemExit) as stopped:
        train.export_run(model, model.args, Path(run_dir), ByteTokenizer(), sharded=True, step=4)
    assert "a broken writer" in str(stopped.value) if rank == 0 else stopped.value.code == 1
    assert full_model_state(model).keys() == full.keys()
    # The new export takes the old one's name by renames: where that fails, the old export is whole.
    if rank == 0:
        hf.write_tensors = write
        replace = os.replace

        def rename_fails(src: Path, dst: Path) -> None:
            if Path(src).name.startswith("hf.tmp-"):
                raise OSError(errno.EBUSY, "Device or resource busy")
            replace(src, dst)

        hf.os.replace = rename_fails
        try:
            with pytest.raises(CheckpointWriteError, match="Device or resource busy"):
                export_parallel_hf(model, out, max_shard_bytes=EXPORT_SHARD_BYTES, overwrite=True)
        finally:
            hf.os.replace = replace
        assert files_of(out) == before
        assert [path.name for path in Path(run_dir).iterdir()] == ["hf"]
    else:
        assert export_parallel_hf(model, out, max_shard_bytes=EXPORT_SHARD_BYTES, overwrite=True) is None


def test_a_failed_parallel_export_raises_on_rank_0_keeps_the_old_export_and_every_rank_goes_on(
    tmp_path: Path,
) -> None:
    run_ranks(_export_with_a_full_disk, 4, str(tmp_path))


# -- bad input: one-line errors before any work --------------------------------------------------------


class _P:
    def __init__(self, tp=1, cp=1, comm="torch", dp_replicate=1):
        self.tp, self.cp, self.comm, self.dp_replicate = tp, cp, comm, dp_replicate


def test_bad_layouts_fail_with_one_line_errors() -> None:
    with pytest.raises(
        ValueError, match=r"world size 6 is not a multiple of parallel\.tp \* parallel\.cp = 4\*1"
    ):
        parallel_dims(_P(tp=4), 6)
    with pytest.raises(ValueError, match=r"parallel\.comm='nccl' is not one of"):
        parallel_dims(_P(comm="nccl"), 2)
    assert parallel_dims(_P(tp=2, cp=2), 8) == ParallelDims(dp=2, cp=2, tp=2)
    with pytest.raises(ValueError, match=r"parallel\.dp_replicate=3 does not divide the 4 data-parallel"):
        parallel_dims(_P(tp=2, dp_replicate=3), 8)
    with pytest.raises(ValueError, match=r"parallel\.dp_replicate=0 must be >= 1"):
        parallel_dims(_P(dp_replicate=0), 8)
    assert parallel_dims(_P(tp=2, dp_replicate=2), 8) == ParallelDims(dp=4, cp=1, tp=2, dp_replicate=2)
    args = small_args()
    # Each names the parallel degree to change first: a loaded model's shape cannot change.
    with pytest.raises(
        ValueError,
        match=r"model\.n_heads=8 is not divisible by parallel\.tp=3: choose a parallel\.tp dividing 8",
    ):
        validate_model(ParallelDims(1, 1, 3), args)
    with pytest.raises(
        ValueError,
        match=r"model\.n_kv_heads=4 is not divisible by parallel\.tp=8: choose a parallel\.tp dividing 4",
    ):
        validate_model(ParallelDims(1, 1, 8), args)
    with pytest.raises(
        ValueError,
        match=r"n_heads=8 is not divisible by parallel\.tp\*parallel\.cp=4\*4: choose a parallel\.tp and "
        r"parallel\.cp with a product dividing 8",
    ):
        validate_model(ParallelDims(1, 4, 4), args)
    with pytest.raises(
        ValueError,
        match=r"training\.seq_len=18 is not divisible by parallel\.tp\*parallel\.cp=4\*1: set "
        r"training\.seq_len to a multiple of 4",
    ):
        validate_model(ParallelDims(1, 1, 4), args, seq_len=18)
    six_kv_heads = ModelArgs(**{**small_args().__dict__, "n_heads": 12, "n_kv_heads": 6, "dim": 96})
    with pytest.raises(
        ValueError,
        match=r"model\.n_kv_heads=6 over parallel\.tp=1 leaves 6 key/value heads per tp rank, which neither "
        r"divide nor are divisible by parallel\.cp=4: choose a parallel\.cp that divides 6",
    ):
        validate_model(ParallelDims(1, 4, 1), six_kv_heads)
    with pytest.raises(ValueError, match=r"model\.vocab_size=66 is not divisible by parallel\.tp=4"):
        validate_model(ParallelDims(1, 1, 4), ModelArgs(**{**small_args().__dict__, "vocab_size": 66}))
    with pytest.raises(
        ValueError, match=r"parallel\.comm=symm_mem needs CUDA GPUs; on cpu use parallel\.comm=torch"
    ):
        validate_device(ParallelDims(1, 1, 2, comm="symm_mem"), torch.device("cpu"))
    # Every op the triton path calls has its kernel in kernels/; a missing one is refused up front,
    # naming the op (see test_triton_path_names_missing_ops).
    validate_comm_ops(ParallelDims(1, 1, 2, comm="triton"), training=True)
    validate_comm_ops(ParallelDims(1, 1, 2, comm="triton"), training=False)
    validate_comm_ops(ParallelDims(1, 2, 1, comm="triton"), training=True)
    with pytest.raises(ValueError, match=r"no comm op is named 'all_to_all'; the ops are all_gather_matmul"):
        check_ops("torch", ["all_to_all"])  # a misspelt op fails on every path, CPU included


def test_indivisible_vocabulary_names_a_change_a_loaded_model_can_make() -> None:
    """A checkpoint's (or Hugging Face model's) vocabulary cannot be padded from the config
    (checkpoint.init_from refuses model.vocab_size): the error offers another parallel.tp."""
    odd = ModelArgs(**{**small_args().__dict__, "vocab_size": 65})
    with pytest.raises(
        ValueError, match=r"vocab_size=65 is not divisible by parallel\.tp=2: choose a parallel\.tp"
    ):
        validate_model(ParallelDims(1, 1, 2), odd)


def _comm_errors(rank: int, world: int) -> None:
    for path in ("symm_mem", "triton"):
        try:
            make_comm(path, dist.group.WORLD)
        except CommUnavailable as err:
            assert "needs CUDA GPUs" in str(err) and "\n" not in str(err), str(err)
        else:
            raise AssertionError(f"{path} built on CPU")


def test_gpu_comm_paths_refuse_cpu() -> None:
    run_ranks(_comm_errors, 2)


def test_triton_path_names_missing_ops(monkeypatch) -> None:
    """An op whose kernel is not in kernels/ is refused by name: before any work (validate_comm_ops)
    and by the comm object itself; the ops whose kernels exist stay available."""
    import kernels.custom_all_reduce
    import parallel.comm as comm_module

    monkeypatch.setattr(comm_module, "_check_cuda_peers", lambda group, path: None)
    monkeypatch.setattr(kernels.custom_all_reduce, "get_custom_all_reduce", lambda group: None)
    monkeypatch.setitem(
        comm_module.TRITON_KERNELS, "matmul_reduce_scatter", ("kernels.matmul_rs", "no_such_kernel")
    )
    monkeypatch.setitem(comm_module.TRITON_KERNELS, "seq_to_heads", ("kernels.no_such_module", "f"))
    with pytest.raises(
        CommUnavailable,
        match=r"parallel\.comm=triton: matmul_reduce_scatter has no Triton kernel yet "
        r"\(kernels\.matmul_rs\.no_such_kernel does not exist\)",
    ):
        validate_comm_ops(ParallelDims(1, 1, 2, comm="triton"), training=True)
    with pytest.raises(CommUnavailable, match=r"seq_to_heads has no Triton kernel yet"):
        validate_comm_ops(ParallelDims(1, 2, 1, comm="triton"), training=True)
    validate_comm_ops(ParallelDims(1, 1, 2, comm="triton"), training=False)

    class Group:
        group_name = "fake"

    monkeypatch.setattr(comm_module.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(comm_module.dist, "get_rank", lambda group: 0)
    comm = comm_module.TritonComm(Group())
    assert comm.available("all_reduce") is None and comm.available("all_gather_matmul") is None
    with pytest.raises(CommUnavailable, match=r"parallel\.comm=triton: seq_to_heads has no Triton kernel"):
        comm.require(["all_gather_matmul", "seq_to_heads"])
    with pytest.raises(CommUnavailable, match=r"matmul_reduce_scatter has no Triton kernel yet"):
        comm.matmul_reduce_scatter(torch.zeros(2, 2), torch.zeros(2, 2), 0)


def _context_parallel_on_the_triton_path(rank: int, world: int) -> None:
    import parallel.comm as comm_module

    comm_module._check_cuda_peers = lambda group, path: None  # the CUDA checks, not under test here
    model = full_model(small_args())
    base = model.layers[0].attention.attention_fn
    mesh = build_mesh(ParallelDims(dp=1, cp=world, tp=1, comm="triton"), "cpu")
    parallelize_llama(model, mesh, ParallelizeConfig(comm="triton"))
    assert model.layers[0].attention.attention_fn is not base  # the Ulysses wrapper


def test_context_parallel_asks_the_triton_path_for_its_ops() -> None:
    """apply_context_parallel requires the ops the Ulysses wrapper calls (seq_to_heads, heads_to_seq),
    by the names the triton path knows them."""
    run_ranks(_context_parallel_on_the_triton_path, 2)


def _ops_a_step_calls(rank: int, world: int) -> None:
    import parallel.comm as comm_module

    called: set[str] = set()

    class Recording(TorchComm):
        pass

    def recorded(op: str):
        def call(self, *args, **kwargs):
            called.add(op)
            return getattr(TorchComm, op)(self, *args, **kwargs)

        return call

    for op in OPS:
        setattr(Recording, op, recorded(op))
    comm_module._PATHS["torch"] = Recording
    torch.manual_seed(0)
    tokens = torch.randint(0, small_args().vocab_size, (2, 8))
    for training in (True, False):
        called.clear()
        model = full_model(small_args())
        mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=world), "cpu")
        parallelize_llama(model, mesh, ParallelizeConfig(sequence_parallel=training, fsdp=False))
        if training:
            cross_entropy(model, model(tokens), torch.roll(tokens, -1, 1)).backward()
        else:
            with torch.no_grad():
                model(tokens)
        assert called == set(tensor_parallel_ops(sequence_parallel=training)), (training, called)


def test_the_ops_checked_up_front_are_the_ops_a_step_calls() -> None:
    """validate_comm_ops (before any work) and make_comm's `require` ask a comm path for exactly the
    dispatched ops a training step (forward and backward) or a decode step calls: an op left out would
    be found missing only at the first step."""
    run_ranks(_ops_a_step_calls, 2)


def test_check_comms_raises_a_kernel_timeout(monkeypatch) -> None:
    """train.py's per-step check asks every kernel module of the triton path for recorded timeouts."""
    import importlib

    import kernels.custom_all_reduce
    import parallel.comm as comm_module
    from kernels.symm_mem import SymmMemTimeout

    monkeypatch.setattr(comm_module, "_check_cuda_peers", lambda group, path: None)
    monkeypatch.setattr(kernels.custom_all_reduce, "get_custom_all_reduce", lambda group: None)
    monkeypatch.setattr(comm_module.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(comm_module.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(comm_module, "_BY_GROUP", {})

    class Group:
        group_name = "fake"

    comm = comm_module.TritonComm(Group())
    checked = []
    modules = {module for module, _ in comm_module.TRITON_KERNELS.values()}
    for module in modules:
        record = lambda group, module=module: checked.append((module, group))
        monkeypatch.setattr(importlib.import_module(module), "check", record)
    comm_module.check_comms()
    assert sorted(checked, key=lambda c: c[0]) == [(m, comm.group) for m in sorted(modules)]

    def timed_out(group) -> None:
        raise SymmMemTimeout("rank 0: matmul_reduce_scatter waiting for rank 1")

    monkeypatch.setattr(importlib.import_module("kernels.matmul_rs"), "check", timed_out)
    with pytest.raises(SymmMemTimeout, match="waiting for rank 1"):
        comm_module.check_comms()


# -- end to end: torchrun train.py / serve.py ------------------------------------------------------------


def test_torchrun_tp_train_resume_at_other_tp_then_serve(tmp_path: Path) -> None:
    """Training at tp=2, stopped and resumed at tp=4, logs the losses of a tp=1 run; the checkpoint
    and its Hugging Face export decode the same tokens at tp=2 as at tp=1."""
    import json

    from tests.test_train_serve import TINY, run_script

    common = [*TINY, "model.n_kv_heads=4", "device=cpu", "training.steps=6", "checkpoint.every=0"]

    def losses(run_dir: Path) -> list[float]:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    done = run_script("train.py", *common, f"hydra.run.dir={tmp_path / 'tp1'}")
    assert done.returncode == 0, done.stderr[-3000:]
    mixed = tmp_path / "mixed"
    for tp, extra in ((2, ["training.stop_at=3"]), (4, ["checkpoint.export_hf=true"])):
        done = run_script(
            "train.py", *common, f"parallel.tp={tp}", *extra, f"hydra.run.dir={mixed}", torchrun=tp
        )
        assert done.returncode == 0, done.stderr[-3000:]
    assert f"tp={tp}" in done.stdout and "resuming from" in done.stdout
    assert losses(mixed) == pytest.approx(losses(tmp_path / "tp1"), abs=2e-5)

    # The weft checkpoint and the Hugging Face export (gathered from the tp=4 run) at tp=1 and tp=2.
    for source in (mixed, mixed / "hf"):
        generate = [
            "mode=generate",
            f"checkpoint={source}",
            "prompt=def",
            "max_new_tokens=8",
            "dtype=float32",
        ]
        single = run_script("serve.py", *generate, "device=cpu", f"hydra.run.dir={tmp_path / 's1'}")
        tp2 = run_script(
            "serve.py",
            *generate,
            "device=cpu",
            "parallel.tp=2",
            f"hydra.run.dir={tmp_path / 's2'}",
            torchrun=2,
        )
        assert single.returncode == 0 and tp2.returncode == 0, (single.stderr[-2000:], tp2.stderr[-2000:])
        assert single.stdout == tp2.stdout and single.stdout.startswith("def"), source

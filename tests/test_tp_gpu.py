"""Tensor + sequence parallel on 4 ranks (4 GPUs, or ranks sharing GPUs, then without symm_mem): on
every comm path (torch, symm_mem, triton) logits, loss and every gradient of the TP + SP model (bf16
autocast) match the single-GPU model at bf16 tolerance, and TP decode (fp32, CUDA graphs) gives the
tp=1 tokens (eager, CUDA graph, compiled + graph; eager only on gloo); FSDP2 x TP (dp=2, tp=2, weights
gathered in bf16, activation checkpointing) trains, and so does TP x two replicas (HSDP).

    pytest -q tests/test_tp_gpu.py          # on a host with 4 GPUs
    python -m parallel.shared_gpu --ranks 4 -- python -m pytest -q tests/test_tp_gpu.py   # on one GPU
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from model.generate import generate
from parallel.checkpoint import _full, full_model_state, full_optimizer_state
from parallel.comm import all_gather
from parallel.distributed import shared_gpu
from parallel.loss import cross_entropy
from parallel.mesh import ParallelDims, build_mesh, data_parallel_rank
from parallel.parallelize import ParallelizeConfig, clip_grad_norm_, parallelize_llama
from tests.multiprocess import rank_gpu, run_ranks
from tests.test_tp import full_model, small_args

WORLD = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def _parity(comm: str, device: torch.device) -> None:
    args = small_args()
    args.dim, args.n_heads, args.n_kv_heads, args.ffn_hidden, args.vocab_size = 256, 8, 4, 512, 512
    reference = full_model(args).to(device)
    model = copy.deepcopy(reference)
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, 64), device=device)
    targets = torch.randint(0, args.vocab_size, (2, 64), device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_logits = reference(tokens)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1).float(), targets.flatten())
    ref_loss.backward()

    mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=WORLD, comm=comm), "cuda")
    parallelize_llama(model, mesh, ParallelizeConfig(comm=comm))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = cross_entropy(model, logits, targets)
    loss.backward()
    full_logits = all_gather(logits.float(), -1, model.parallel.tp_group)
    assert rel_err(full_logits, ref_logits) < 2e-2, (comm, rel_err(full_logits, ref_logits))
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        err = rel_err(_full(p.grad, name, model.parallel), ref_params[name].grad)
        assert err < 3e-2, (comm, name, err)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    assert abs(clip_grad_norm_(model, 1e9).item() - ref_norm.item()) < 3e-2 * ref_norm.item()


def _decode(comm: str, device: torch.device) -> None:
    args = small_args()
    reference = full_model(args, seed=3).to(device)
    model = copy.deepcopy(reference)
    mesh = build_mesh(ParallelDims(dp=1, cp=1, tp=WORLD, comm=comm), "cuda")
    parallelize_llama(model, mesh, ParallelizeConfig(comm=comm, sequence_parallel=False, fsdp=False))
    torch.manual_seed(2)
    prompt = torch.randint(0, args.vocab_size, (2, 5), device=device)
    expected = generate(reference, prompt, 16, cuda_graph=False)
    modes = ((False, False), (True, False), (True, True))
    if comm == "torch" and shared_gpu():  # gloo's collectives cannot be captured (validate_decode_graphs)
        modes = modes[:1]
    for graph, compile in modes:
        got = generate(model, prompt, 16, cuda_graph=graph, compile=compile)
        assert torch.equal(got, expected), (comm, graph, compile, got, expected)


def _fsdp_tp_trains(device: torch.device, dims: ParallelDims) -> None:
    args = small_args()
    model = full_model(args).to(device)
    mesh = build_mesh(dims, "cuda")
    plan = ParallelizeConfig(fsdp=True, activation_checkpointing=True, fsdp_param_dtype=torch.bfloat16)
    parallelize_llama(model, mesh, plan)
    assert model.parallel.fsdp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(10 + data_parallel_rank(mesh))  # each dp rank its own (fixed) batch
    tokens = torch.randint(0, args.vocab_size, (4, 32), device=device)
    losses = []
    for _ in range(50):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(model, model(tokens), torch.roll(tokens, -1, 1))
        loss.backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    # A checkpoint's gathers: one full tensor at a time on the GPU, each moved to the host before the
    # next (all of them at once would take a GPU 3x the model in fp32 at its first save).
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    weights = list(full_model_state(model).values())
    per_param = full_optimizer_state(model, opt)["state"].values()
    moments = [v for values in per_param for v in values.values() if v.dim() > 0]  # not AdamW's step
    tensors = weights + moments
    assert all(t.device.type == "cpu" for t in tensors)
    assert torch.cuda.max_memory_allocated() - before < sum(t.nbytes for t in tensors) / 4


def _worker(rank: int, world: int) -> None:
    device = rank_gpu()
    # PyTorch's fused ops refuse ranks sharing a GPU (tests/test_shared_gpu.py checks that error).
    for comm in ("torch", "triton") if shared_gpu() else ("torch", "symm_mem", "triton"):
        _parity(comm, device)
        _decode(comm, device)
    _fsdp_tp_trains(device, ParallelDims(dp=2, cp=1, tp=2))
    _fsdp_tp_trains(device, ParallelDims(dp=2, cp=1, tp=2, dp_replicate=2))  # HSDP: two replicas


@pytest.mark.multigpu(n=WORLD)
def test_tp_on_four_gpus() -> None:
    run_ranks(_worker, WORLD, backend="nccl")

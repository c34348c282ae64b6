"""The held-out loss (eval.path): the model's mean loss per token over a fixed set of windows of a corpus
it does not train on, measured without gradients by every rank of the layout it trains in."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from configs.schema import TrainConfig
from model.data import PackedDataset
from parallel.loss import cross_entropy

# The held-out windows' order: fixed, so that runs with different training.seed are measured alike.
ORDER_SEED = 0


class HeldOutLoss:
    """Batches of training.batch_size x training.seq_len windows per data-parallel rank (`dp_rank` of
    `dp_size`), eval.batches of them (None: the whole corpus, fewer where it holds fewer), the same
    windows at every evaluation. `path` names the corpus in errors."""

    def __init__(self, tokens: np.ndarray, cfg: TrainConfig, dp_rank: int, dp_size: int, path: str) -> None:
        t = cfg.training
        needed = dp_size * t.batch_size * t.seq_len + 1
        if len(tokens) < needed:
            raise ValueError(
                f"eval.path={path} holds {len(tokens):,} tokens, fewer than one batch of training.batch_size "
                f"x training.seq_len for each of the {dp_size} data-parallel rank(s) takes ({needed:,}): "
                "give a larger held-out corpus"
            )
        self.dataset = PackedDataset(tokens, t.seq_len, t.batch_size, dp_rank, dp_size, ORDER_SEED)
        whole = self.dataset.steps_per_epoch
        self.batches = whole if cfg.eval.batches is None else min(cfg.eval.batches, whole)
        self.tokens = self.batches * t.batch_size * t.seq_len * dp_size

    def __call__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        cp_chunk: slice | None,
    ) -> float:
        """The loss per token, averaged over every rank (all ranks call it; every rank gets it)."""
        self.dataset.load_state_dict({"epoch": 0, "step": 0})  # back to the first held-out window
        total = torch.zeros((), device=device)
        with torch.no_grad():
            for _ in range(self.batches):
                inputs, targets = (x.to(device, non_blocking=True) for x in self.dataset.next_batch())
                if cp_chunk is not None:
                    inputs, targets = inputs[:, cp_chunk], targets[:, cp_chunk]
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    total += cross_entropy(model, model(inputs), targets)
        # FSDP2 reshards a module's weights in its backward; with none, some stay gathered, registered
        # in place of the shards that the optimizer and the checkpoint hold. (Imported here: importing
        # torch.distributed.fsdp takes most of a second, which every train.py launch would pay.)
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        total /= self.batches
        if dist.is_initialized():  # (tp ranks hold the same loss, cp ranks equal shares of the tokens)
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total.item()

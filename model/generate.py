"""Prefill and token-by-token decoding over the model's static KV cache, with the decode step
optionally captured in a CUDA graph (gpt-fast style)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from model.llama import Llama


@dataclass
class Sampling:
    """How the next token is chosen. temperature 0 is greedy (argmax); otherwise a draw from
    softmax(logits / temperature) over the top_k most likely tokens (0: all), narrowed to the fewest
    whose probabilities sum to top_p (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def validate(self, sources: dict[str, str] | None = None) -> None:
        """ValueError naming the bad setting and, from `sources`, where its value came from."""
        where = lambda key: f" ({sources[key]})" if sources and key in sources else ""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"temperature={self.temperature}{where('temperature')} must be a finite number >= 0: set "
                "temperature (0 is greedy)"
            )
        if self.top_k < 0:
            raise ValueError(
                f"top_k={self.top_k}{where('top_k')} must be >= 0: set top_k (0 keeps every token)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(
                f"top_p={self.top_p}{where('top_p')} is outside (0, 1]: set top_p (1 keeps every token)"
            )


def sample_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Logits [B, V] / temperature (> 0), -inf outside the top_k most likely tokens and then outside
    top_p: transformers' warpers in its order and with its rules (ties at the k-th logit kept; top-p
    keeps the most likely token and drops the least likely ones whose probabilities sum to <= 1 - top_p)."""
    # Kept within float32's range: a smaller temperature would be 0 there, and 0 / 0 NaN.
    logits = logits.float() / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        ascending, order = torch.sort(logits, dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token per row of logits [B, V] as `Sampling` describes (a draw from `sample_logits`)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    # Shifted so that the largest is 0 (softmax, top-k and top-p do not change): a tiny temperature
    # then scales the others to -inf instead of every logit to +-inf (NaN probabilities).
    logits = logits.float()
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(sample_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def register_weft_ops_with_inductor() -> None:
    """Give every loaded weft op (torch.ops.weft) the inductor fallback it would get on first sight.

    torch 2.11's inductor builds its "Creating implicit fallback" log line for an op's first call in a
    graph eagerly, printing the IR of the op's arguments and, recursively, of their inputs. In the FP8
    blocks every op is opaque, and each (values, scales) pair and the residual is a separate path back
    to the previous block, so that text doubles with every block: an op first called after the 32
    blocks of Llama-3-8B (the logits' all-gather under tensor parallelism, say) keeps the compile
    from finishing. Registered up front, no weft op goes through that path."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for name in torch.ops.weft:
        packet = getattr(torch.ops.weft, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in lowering.lowerings:
                tag = get_layout_constraint_tag(op, with_default=True)
                lowering.make_fallback(op, layout_constraint=lowering.tag_to_layout_constraint(tag))


class DecodeStep:
    """One decode step, logits [B, V] for tokens [B, 1] at position `pos`. On CUDA with
    `cuda_graph=True` the step is captured once into a graph over static buffers and replayed, so a
    step costs one launch instead of hundreds; `compile=True` first fuses the step with torch.compile."""

    def __init__(
        self, model: Llama, batch: int, device: torch.device, cuda_graph: bool, compile: bool = False
    ) -> None:
        if compile:
            register_weft_ops_with_inductor()
        self.forward = torch.compile(model, dynamic=False, fullgraph=True) if compile else model
        self.use_graph = cuda_graph and device.type == "cuda"
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None

    def _run(self) -> torch.Tensor:
        return self.forward(self.tokens, self.pos)[:, -1]

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._run()

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        self.tokens.copy_(tokens.view_as(self.tokens))
        self.pos.fill_(pos)
        if not self.use_graph:
            return self._run()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits


@torch.no_grad()
def prefill(model: Llama, tokens: torch.Tensor) -> torch.Tensor:
    """Run the prompt [B, S] through the model, filling the KV cache; returns last logits [B, V]."""
    return model(tokens, torch.arange(tokens.shape[1], device=tokens.device))[:, -1]


def check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(
            f"token id {tokens.max().item()} is outside the model's vocabulary of {vocab_size}: "
            "the tokenizer does not match the model"
        )


def decode_tokens(
    model: Llama,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    cuda_graph: bool = True,
    compile: bool = False,
    generator: torch.Generator | None = None,
) -> Iterator[torch.Tensor]:
    """Complete prompt [B, S] token by token: yields each step's new tokens [B], up to `max_new_tokens`
    steps, and stops after the step in which every row has produced one of `stop_ids` (that token is
    yielded). A row that has stopped before the others gets stop_ids[0] from then on, as transformers
    pads it. `generator` makes sampling repeatable."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return
    s = sampling or Sampling()
    check_tokens(prompt, model.args.vocab_size)
    batch, prompt_len = prompt.shape
    model.setup_caches(batch, prompt_len + max_new_tokens)
    try:
        step = DecodeStep(model, batch, prompt.device, cuda_graph, compile)
        stops = torch.tensor(list(stop_ids), dtype=torch.long, device=prompt.device)
        choose = lambda logits: sample(logits, s.temperature, s.top_k, s.top_p, generator)
        token = choose(prefill(model, prompt))
        finished = torch.isin(token, stops)
        yield token
        for pos in range(prompt_len, prompt_len + max_new_tokens - 1):
            if bool(finished.all()):
                break
            token = choose(step(token, pos))
            if batch > 1 and len(stop_ids):  # (one row: the loop has ended once it stops)
                token = torch.where(finished, stops[0], token)
            finished |= torch.isin(token, stops)
            yield token
    finally:
        model.clear_caches()


def generate(
    model: Llama,
    prompt: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids: Sequence[int] = (),
    cuda_graph: bool = True,
    compile: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The new tokens [B, <= max_new_tokens] of `decode_tokens`, all at once."""
    steps = decode_tokens(model, prompt, max_new_tokens, sampling, stop_ids, cuda_graph, compile, generator)
    return torch.stack(list(steps), dim=1) if max_new_tokens else prompt.new_empty(prompt.shape[0], 0)

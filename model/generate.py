"""Prefill and token-by-token decoding over the model's static KV cache, with the decode step
optionally captured in a CUDA graph (gpt-fast style)."""

from __future__ import annotations

import torch

from model.llama import Llama


def sample(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Next token per row of logits [B, V]: argmax when temperature is 0, else a draw from the
    softmax of logits / temperature restricted to the top_k most likely tokens (0: all)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1).squeeze(-1)


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


@torch.no_grad()
def generate(
    model: Llama,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    cuda_graph: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """Complete prompt [B, S] by up to `max_new_tokens` tokens; returns only the new tokens
    [B, <= max_new_tokens] (stops early once every row has produced `eos_id`)."""
    check_tokens(prompt, model.args.vocab_size)
    batch, prompt_len = prompt.shape
    model.setup_caches(batch, prompt_len + max_new_tokens)
    step = DecodeStep(model, batch, prompt.device, cuda_graph, compile)
    token = sample(prefill(model, prompt), temperature, top_k)
    out = [token]
    finished = token == eos_id if eos_id is not None else torch.zeros_like(token, dtype=torch.bool)
    for pos in range(prompt_len, prompt_len + max_new_tokens - 1):
        if bool(finished.all()):
            break
        token = sample(step(token, pos), temperature, top_k)
        out.append(token)
        if eos_id is not None:
            finished |= token == eos_id
    model.clear_caches()
    return torch.stack(out, dim=1)

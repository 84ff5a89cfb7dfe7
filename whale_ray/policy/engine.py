"""Generation engines' common ground: requests, outputs, the Engine protocol, and the pieces both engines share.

Requests are chats (or raw text prompts) with per-request sampling parameters; outputs carry exact prompt and
completion token ids and the log-probs of the distribution each token was actually sampled from: logits /
temperature, then top-k, then top-p (the order of Hugging Face's logits warpers), then log-softmax. For greedy
requests (temperature == 0) they are the log-softmax of the raw logits.

The engines: `TransformersEngine` (whale_ray/policy/transformers_engine.py, the default: CPU or one GPU,
continuous batching over whale_ray/policy/continuous.py) and `VLLMEngine` (whale_ray/policy/vllm_engine.py).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from whale_ray.records import SamplingParams

FINISH_REASONS = ("stop", "length")
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass
class GenerationRequest:
    messages: list[dict[str, str]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # A raw text prompt (text completions), tokenised as given without a chat template; `messages` is then unused.
    prompt: Optional[str] = None
    # The prompt's ids as `encode_prompts` gives them, where the trusted side that made the request has already
    # counted them (the endpoint's replica, bounding the prompt by the context): the engine then skips its own
    # chat template and tokenisation, which would hold its process's GIL between forward passes.
    prompt_ids: Optional[list[int]] = None
    # Called from the engine's thread with (token id, weight version) as each token is sampled (streaming).
    # TransformersEngine calls it; engines that do not stream leave it uncalled and the caller sends the whole
    # completion at the end.
    on_token: Optional[Callable[[int, int], None]] = None


@dataclass
class GenerationOutput:
    text: str  # the completion decoded without special tokens, cut before a stop string
    prompt_ids: list[int]  # the chat template with add_generation_prompt, tokenised
    completion_ids: list[int]  # generated ids, including the eos when one was produced
    logprobs: list[float]  # one per completion id, under the sampling distribution used (module docstring)
    finish_reason: str  # "stop" (eos or stop string) | "length" (max_tokens or the context window)
    weight_version: int = 0  # the weights that generated it, read with the batch under the engine's lock
    # per completion id, its sampling.top_logprobs most likely alternatives [(id, log-prob)] under the same
    # distribution as `logprobs`; empty when none were asked for
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int: ...

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


def check_request(request: GenerationRequest) -> None:
    """ValueError naming the problem when a request cannot be served (bad messages or sampling values).

    Requests can come from untrusted harness code: a server should call this per request before batching,
    so that one bad request is refused alone instead of failing a whole batch.
    """
    msgs = request.messages
    if request.prompt is not None:
        if not isinstance(request.prompt, str) or not request.prompt:
            raise ValueError(f"prompt must be a non-empty string, got {request.prompt!r}")
    elif not isinstance(msgs, list) or not msgs:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    else:
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {m!r}")
    ids = request.prompt_ids
    if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
        raise ValueError(f"prompt_ids must be a non-empty list of token ids, got {ids!r:.80}")
    s = request.sampling
    if not isinstance(s.max_tokens, int) or s.max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {s.max_tokens!r}")
    if not isinstance(s.temperature, (int, float)) or not s.temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {s.temperature!r}")
    if not isinstance(s.top_k, int) or s.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {s.top_k!r}")
    if not isinstance(s.top_p, (int, float)) or not (0 < s.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p!r}")
    if isinstance(s.stop, str) or not all(isinstance(x, str) for x in s.stop):
        raise ValueError(f"stop must be a sequence of strings, got {s.stop!r}")
    if s.seed is not None and not isinstance(s.seed, int):
        raise ValueError(f"seed must be an integer or None, got {s.seed!r}")
    if not isinstance(s.top_logprobs, int) or not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs!r}")


def drain_commands(commands: queue.SimpleQueue, block: bool, take: Callable[[tuple], None]) -> bool:
    """An engine thread's inbox: hands every queued command to `take` (waiting for the first when `block`);
    False once a ("close",) comes."""
    try:
        cmd = commands.get() if block else commands.get_nowait()
    except queue.Empty:
        return True
    while cmd[0] != "close":
        take(cmd)
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            return True
    return False


def encode_prompts(tokenizer: Any, requests: list[GenerationRequest]) -> list[list[int]]:
    """The trusted side's prompt ids: the chat template with the generation prompt (or a raw `prompt` as given),
    tokenised without extra special tokens; a request's own `prompt_ids` where it carries them. Every engine uses
    this, so the same messages give the same ids everywhere."""
    todo = [r for r in requests if r.prompt_ids is None]
    texts = [r.prompt if r.prompt is not None else
             tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in todo]
    fresh = iter(tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else [])
    return [list(r.prompt_ids) if r.prompt_ids is not None else next(fresh) for r in requests]


def decode_completion(tokenizer: Any, ids: list[int]) -> str:
    """`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`. A fast tokenizer's
    Rust decoder is called directly: that is all Hugging Face's decode does without the clean-up, and it skips
    ~25 us of Python per call, which stop strings pay after every token of every request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.decode(ids, skip_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class StopMatcher:
    """Stop strings of a completion that grows token by token, found where decoding the whole completion after
    every token would find them (the rule `TransformersEngine` applies), while decoding only a short tail per token.

    `maybe(ids)` after each new token decodes the last `tail` tokens; only when a stop string shows there does
    `find(ids)` decode the whole completion. A stop string that spans more than `tail` tokens (tokens that print
    nothing: skipped special tokens, partial UTF-8 bytes) escapes `maybe`; the engine calls `find` once more when
    the completion ends, and `find` walks back to the shortest prefix that holds a stop string, so the cut is the
    same either way (assuming that once a prefix's text holds a stop string, every longer prefix's does too).
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]):
        if not stops:
            raise ValueError("StopMatcher needs at least one non-empty stop string")
        self.tokenizer, self.stops = tokenizer, stops
        self.tail = 2 * max(len(s) for s in stops) + 8  # tokens; a stop of L chars spans <= L printing tokens

    def cut(self, text: str) -> str | None:
        """`text` cut before its first stop string, or None when it holds none."""
        hits = [text.find(s) for s in self.stops if s in text]
        return text[: min(hits)] if hits else None

    def maybe(self, ids: list[int]) -> bool:
        return self.cut(decode_completion(self.tokenizer, ids[-self.tail :])) is not None

    def find(self, ids: list[int]) -> tuple[int, str] | None:
        """(n, text): ids[:n] is the shortest prefix whose text holds a stop string, `text` that text cut before it."""
        text = self.cut(decode_completion(self.tokenizer, ids))
        if text is None:
            return None
        n = len(ids)
        while n > 1 and (shorter := self.cut(decode_completion(self.tokenizer, ids[: n - 1]))) is not None:
            n, text = n - 1, shorter
        return n, text


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob, each row with its own temperature / top-k / top-p.

    logits [B, V] (float32); temperature, top_p [B] float; top_k [B] long (0 = off); u [B] uniforms in
    [0, 1) (the row's own random stream; inverse-CDF sampling). temperature 0 = greedy (raw log-probs).
    """
    token, lp, _, _ = sample_rows_top(logits, temperature, top_k, top_p, u, 0)
    return token, lp


def sample_rows_top(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
    top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample_rows`, plus each row's `top` most likely tokens [B, top] and their log-probs under the same
    distribution (the sort that sampling needs already ranks them)."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    k = torch.where(greedy | (top_k <= 0), torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    sorted_logits, sorted_ids = (logits / t[:, None]).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    # top-p: keep the smallest prefix whose mass reaches p (same rule as HF's TopPLogitsWarper)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= p[:, None]) & (p[:, None] < 1)
    drop[:, 0] = False
    logp = sorted_logits.masked_fill(drop, float("-inf")).log_softmax(dim=-1)
    cdf = logp.exp().cumsum(dim=-1)
    j = (cdf < u[:, None] * cdf[:, -1:]).sum(dim=-1)  # masked tokens add no mass: j stays on a kept token
    j = torch.where(greedy, torch.zeros_like(j), j)
    token = sorted_ids.gather(1, j[:, None]).squeeze(1)
    return token, logp.gather(1, j[:, None]).squeeze(1), sorted_ids[:, :top], logp[:, :top]


def logits_vocab(model: Any) -> int:
    """The width of the model's logits (its output embedding's rows)."""
    return int(model.get_output_embeddings().weight.shape[0])

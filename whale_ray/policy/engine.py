"""Generation engines: chat requests in, completions with exact token ids and log-probs out.

`TransformersEngine` is the default (CPU or one GPU, any local Hugging Face causal-LM checkpoint), with
continuous batching: one thread steps a single batched, KV-cached forward pass per decoding step over every
live request; requests join that batch at step boundaries and leave it as they finish (whale_ray/policy/
continuous.py), so a long completion never holds back a short one and a request that arrives mid-generation
need not wait for the others. Per-request sampling parameters (temperature, top-k, top-p, max_tokens, stop
strings, seed) are applied row by row inside the same batch, so requests need not be grouped by them.

Log-probs (`GenerationOutput.logprobs`) are those of the distribution each token was actually sampled
from: logits / temperature, then top-k, then top-p (the order of Hugging Face's logits warpers), then
log-softmax. For greedy requests (temperature == 0) they are the log-softmax of the raw logits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import inspect
import queue
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

from whale_ray.policy.tiny import load_policy
from whale_ray.records import SamplingParams

FINISH_REASONS = ("stop", "length")
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass
class GenerationRequest:
    messages: list[dict[str, str]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # A raw text prompt (text completions), tokenised as given without a chat template; `messages` is then unused.
    prompt: Optional[str] = None
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


def encode_prompts(tokenizer: Any, requests: list[GenerationRequest]) -> list[list[int]]:
    """The trusted side's prompt ids: the chat template with the generation prompt (or a raw `prompt` as given),
    tokenised without extra special tokens. Every engine uses this, so the same messages give the same ids
    everywhere."""
    texts = [r.prompt if r.prompt is not None else
             tokenizer.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True) for r in requests]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def eos_token_ids(generation_eos: int | list[int] | None, tokenizer: Any, model_path: Path | str) -> list[int]:
    """The ids that end a completion: the generation config's eos ids and the tokenizer's eos."""
    eos = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    if not eos:
        raise ValueError(f"policy checkpoint {model_path}: neither the generation config nor the tokenizer has an eos token")
    return sorted(set(eos))


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


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransformersEngine:
    """A Hugging Face causal LM behind a continuously batched, KV-cached sampling loop (module docstring).

    One thread owns the model and steps the running batch (`continuous.RunningBatch`) for as long as requests
    are live; `submit` (and `agenerate`, its asyncio form) hands a request to it through a queue, and it joins
    the batch at the next step boundary, at most `max_batch` rows at a time (the rest wait their turn, first
    come first served). A request's future resolves as soon as it finishes. `generate(requests)` submits them
    together (one prefill for all that fit) and waits for every one.

    Weights: `load_weights` waits for the requests in flight to finish on the old weights, while requests that
    arrive meanwhile wait, not admitted; then it loads and bumps the version, and the waiting requests run on
    the new weights. So every output was generated by one set of weights, the one its `weight_version` names
    (as in `VLLMEngine`). An error in a forward pass fails the requests in the batch then; the thread goes on
    serving the next ones.
    """

    # Newcomers wait up to this many decode steps for company before they join a running batch (an empty batch,
    # or enough of them to fill it, take them at once). The prefill of one short prompt costs about one decode
    # step of the whole batch (the tiny policy on 2 CPU cores: 3.3 ms for 1 row of 40 tokens, 3.6 ms for a
    # 32-row step): callers that come back one by one, as an HTTP endpoint's do, would each pay one, doubling
    # the forwards; grouped by ~4 they add a quarter. The cost: a newcomer's first token up to 4 steps later.
    JOIN_WAIT_STEPS = 4

    def __init__(
        self, model_path: Path | str, *, device: str = "auto", dtype: str = "auto", max_batch: int = 64, seed: int = 0,
        version: int = 0,
    ) -> None:
        from whale_ray.policy.continuous import RunningBatch, plain_kv  # it imports this module's helpers

        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if dtype != "auto" and dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
        self.device = _resolve_device(device)
        self.model, self.tokenizer = load_policy(model_path, device="cpu", dtype=_DTYPES.get(dtype, "auto"))
        if self.device.type == "cpu" and dtype == "auto" and self.model.dtype != torch.float32:
            self.model.float()  # half precision is slow and inexact on CPU
        self.model.to(self.device)
        self.model_path = Path(model_path)
        self.max_batch = max_batch
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self._rng = random.Random(seed)
        self._submit_lock = threading.Lock()  # seeds are drawn in submission order
        self._weights_lock = threading.Lock()  # state_dict never reads a half-loaded model
        self._version = int(version)  # the weights' version when the server restarts from a checkpoint
        self.eos_ids = eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer, model_path)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        # transformers 5 renamed the forward's `past_key_values` to `cache`; accept either
        params = inspect.signature(type(self.model).forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        self._batch = RunningBatch(self.model, self.tokenizer, self.eos_ids, self.pad_id, cache_kw, self._new_cache,
                                   self.device)
        # newcomers join a running batch only where its cache can be padded and merged (full-attention KV)
        self._joins = plain_kv(self._new_cache())
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque = deque()  # submitted, not admitted yet (no room, or a reload is waiting)
        self._reloads: list[tuple] = []  # load_weights commands, run once nothing is live
        self._waited = 0  # decode steps the waiting requests have been kept out of a running batch
        self._thread = threading.Thread(target=self._serve, name="transformers-engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def steps(self) -> int:
        """Forward passes so far (prefills included); `tokens` / `steps` is the mean batch per pass."""
        return self._batch.forwards

    @property
    def tokens(self) -> int:
        return self._batch.sampled

    # -- weights -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (tied weights appear under each of their names)."""
        with self._weights_lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the model in place and set `version`, once the requests in flight are done
        (class docstring); returns when it is loaded.

        Every key must be a model key with the same shape; keys may be left out only when they are tied to
        one that is given (lm_head.weight with tied embeddings). Checked before anything is copied.
        """
        own = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise ValueError(f"load_weights: keys not in the model: {', '.join(unknown[:5])}")
        bad = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if bad:
            raise ValueError(
                f"load_weights: shape mismatch for {bad[0]}: got {tuple(state_dict[bad[0]].shape)}, "
                f"model has {tuple(own[bad[0]].shape)}"
            )
        given = {own[k].data_ptr() for k in state_dict}
        missing = [k for k in own if k not in state_dict and own[k].data_ptr() not in given]
        if missing:
            raise ValueError(f"load_weights: missing keys: {', '.join(missing[:5])}")
        done: cf.Future = cf.Future()
        self._commands.put(("reload", state_dict, int(version), done))
        done.result()

    # -- requests ------------------------------------------------------------------------------------------

    def submit_many(self, requests: list[GenerationRequest]) -> list[cf.Future]:
        """Futures of the requests' GenerationOutputs; ValueError at once when one of them cannot be served
        (then none is submitted). They reach the engine together, so those that fit share one prefill."""
        from whale_ray.policy.continuous import Live

        for r in requests:
            check_request(r)
        if not requests:
            return []
        if not self._thread.is_alive():
            raise RuntimeError("TransformersEngine closed: no thread serves new requests")
        prompt_ids = encode_prompts(self.tokenizer, requests)
        futures, lives = [], []
        with self._submit_lock:  # seeds are drawn in request order, so results do not depend on batching
            seeds = [r.sampling.seed if r.sampling.seed is not None else self._rng.getrandbits(63) for r in requests]
        for r, ids, seed in zip(requests, prompt_ids, seeds):
            future: cf.Future = cf.Future()
            futures.append(future)
            if len(ids) >= self.max_context:  # no room for a single token: nothing is generated
                future.set_result(GenerationOutput("", list(ids), [], [], "length", self._version))
                continue
            s = r.sampling
            budget = min(s.max_tokens, self.max_context - len(ids))
            stops = tuple(x for x in s.stop if x)  # empty stop strings are ignored
            lives.append(Live(
                future, list(ids), budget, torch.rand(budget, generator=torch.Generator().manual_seed(seed)),
                float(s.temperature), int(s.top_k), float(s.top_p), int(s.top_logprobs),
                StopMatcher(self.tokenizer, stops) if stops else None, r.on_token,
            ))
        if lives:
            self._commands.put(("add", lives))
        return futures

    def submit(self, request: GenerationRequest) -> cf.Future:
        return self.submit_many([request])[0]

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        return [f.result() for f in self.submit_many(requests)]

    async def agenerate(self, request: GenerationRequest) -> GenerationOutput:
        return await asyncio.wrap_future(self.submit(request))

    def close(self) -> None:
        """Ends the engine thread; requests still live or waiting fail."""
        if self._thread.is_alive():
            self._commands.put(("close",))
            self._thread.join()

    # -- the engine thread ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        batch = self._batch
        while self._take_commands(block=not batch and not self._waiting and not self._reloads):
            if self._reloads and not batch:
                self._reload()
            room = self.max_batch - len(batch) if (self._joins or not batch) and not self._reloads else 0
            join = room and self._waiting and (not batch or len(self._waiting) >= room
                                               or self._waited >= self.JOIN_WAIT_STEPS)
            newcomers = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))] if join else []
            self._waited = 0 if join or not self._waiting else self._waited + 1
            try:
                if newcomers:
                    batch.admit(newcomers, self._version)
                if batch:
                    batch.step()
            except Exception as e:  # the engine failed: fail what is live, keep serving what comes next
                live = batch.clear() + [r for r in newcomers if not r.future.done()]
                for r in live:
                    if not r.future.done():
                        r.future.set_exception(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
        for r in self._batch.clear() + list(self._waiting):
            r.future.set_exception(RuntimeError("TransformersEngine closed"))

    def _take_commands(self, block: bool) -> bool:
        """Handle every queued command (waiting for one when `block`); False once asked to close."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "close":
                return False
            if cmd[0] == "reload":
                self._reloads.append(cmd)
            else:
                self._waiting.extend(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _reload(self) -> None:
        for _, state, version, done in self._reloads:
            try:
                with self._weights_lock, torch.no_grad():
                    self.model.load_state_dict(state, strict=False)
                    self._version = version
                done.set_result(None)
            except Exception as e:
                done.set_exception(RuntimeError(f"load_weights failed: {e}"))
        self._reloads.clear()

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

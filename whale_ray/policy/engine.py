"""Generation engines: chat requests in, completions with exact token ids and log-probs out.

`TransformersEngine` is the default (CPU or one GPU, any local Hugging Face causal-LM checkpoint). One
`generate` call decodes all its requests together: a single batched, KV-cached forward pass per decoding
step (chunks of `max_batch` requests; finished rows leave the batch). Per-request sampling parameters
(temperature, top-k, top-p, max_tokens, stop strings, seed) are applied row by row inside the same batch,
so requests need not be grouped by their parameters.

Log-probs (`GenerationOutput.logprobs`) are those of the distribution each token was actually sampled
from: logits / temperature, then top-k, then top-p (the order of Hugging Face's logits warpers), then
log-softmax. For greedy requests (temperature == 0) they are the log-softmax of the raw logits.
"""

from __future__ import annotations

import inspect
import random
import threading
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
    """A Hugging Face causal LM behind a batched, KV-cached sampling loop (see the module docstring)."""

    def __init__(
        self, model_path: Path | str, *, device: str = "auto", dtype: str = "auto", max_batch: int = 64, seed: int = 0,
        version: int = 0,
    ) -> None:
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
        self._lock = threading.Lock()
        self._version = int(version)  # the weights' version when the server restarts from a checkpoint
        self.eos_ids = eos_token_ids(self.model.generation_config.eos_token_id, self.tokenizer, model_path)
        self._eos = torch.tensor(self.eos_ids, device=self.device)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        # transformers 5 renamed the forward's `past_key_values` to `cache`; accept either
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def version(self) -> int:
        return self._version

    # -- weights -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the weights (tied weights appear under each of their names)."""
        with self._lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy `state_dict` into the model in place and set `version`; waits for a running generate.

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
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)
            self._version = int(version)

    # -- generation ----------------------------------------------------------------------------------------

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationOutput]:
        for r in requests:
            check_request(r)
        if not requests:
            return []
        with self._lock:  # one generate at a time; load_weights waits for it (and it for load_weights)
            version = self._version  # taken with the batch: a load_weights after it cannot relabel these outputs
            prompt_ids = encode_prompts(self.tokenizer, requests)
            # Seeds are drawn in request order, so results do not depend on how requests are chunked.
            seeds = [r.sampling.seed if r.sampling.seed is not None else self._rng.getrandbits(63) for r in requests]
            outputs: list[GenerationOutput | None] = [None] * len(requests)
            runnable = []
            for i, ids in enumerate(prompt_ids):
                if len(ids) >= self.max_context:  # no room for a single token: nothing is generated
                    outputs[i] = GenerationOutput("", list(ids), [], [], "length", version)
                else:
                    runnable.append(i)
            # Similar prompt lengths and budgets share a chunk: less padding, fewer idle rows.
            runnable.sort(key=lambda i: (len(prompt_ids[i]), requests[i].sampling.max_tokens))
            for s in range(0, len(runnable), self.max_batch):
                chunk = runnable[s : s + self.max_batch]
                outs = self._generate_chunk(
                    [requests[i] for i in chunk], [prompt_ids[i] for i in chunk], [seeds[i] for i in chunk]
                )
                for i, out in zip(chunk, outs):
                    out.weight_version = version
                    outputs[i] = out
        return outputs  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_chunk(
        self, requests: list[GenerationRequest], prompts: list[list[int]], seeds: list[int]
    ) -> list[GenerationOutput]:
        dev = self.device
        n = len(requests)
        width = max(len(p) for p in prompts)
        budgets = [min(r.sampling.max_tokens, self.max_context - len(p)) for r, p in zip(requests, prompts)]
        steps_max = max(budgets)

        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[row, width - len(p) :] = 1
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        noise = torch.zeros((n, steps_max))
        for row, (seed, budget) in enumerate(zip(seeds, budgets)):  # each row's own random stream
            noise[row, :budget] = torch.rand(budget, generator=torch.Generator().manual_seed(seed))
        temperature = torch.tensor([float(r.sampling.temperature) for r in requests], device=dev)
        top_k = torch.tensor([r.sampling.top_k for r in requests], dtype=torch.long, device=dev)
        top_p = torch.tensor([float(r.sampling.top_p) for r in requests], device=dev)
        budget_t = torch.tensor(budgets, device=dev)
        input_ids, attention, position_ids, noise = (t.to(dev) for t in (input_ids, attention, position_ids, noise))

        tokens = torch.zeros((n, steps_max), dtype=torch.long, device=dev)
        logprobs = torch.zeros((n, steps_max), device=dev)
        top = min(max(r.sampling.top_logprobs for r in requests), logits_vocab(self.model))
        top_ids = torch.zeros((n, steps_max, top), dtype=torch.long, device=dev)
        top_lps = torch.zeros((n, steps_max, top), device=dev)
        streams = [r.on_token for r in requests]
        lengths = [0] * n
        stop_hit = [False] * n
        stops = [tuple(x for x in r.sampling.stop if x) for r in requests]  # empty stop strings are ignored
        rows = torch.arange(n, device=dev)  # original row of each active batch row
        cache = self._new_cache()
        model_in = input_ids
        for step in range(steps_max):
            logits = self.model(
                input_ids=model_in, attention_mask=attention, position_ids=position_ids,
                use_cache=True, logits_to_keep=1, **{self._cache_kw: cache},
            ).logits[:, -1, :].float()
            tok, lp, alt_ids, alt_lps = sample_rows_top(
                logits, temperature[rows], top_k[rows], top_p[rows], noise[rows, step], top)
            tokens[rows, step] = tok
            logprobs[rows, step] = lp
            if top:
                top_ids[rows, step], top_lps[rows, step] = alt_ids, alt_lps
            done = torch.isin(tok, self._eos) | (budget_t[rows] <= step + 1)
            active = rows.tolist()
            if any(streams[r] for r in active):
                for r, t_id in zip(active, tok.tolist()):
                    if streams[r]:
                        streams[r](t_id, self._version)  # under the lock: the version cannot change mid-chunk
            if any(stops[r] for r in active):  # stop strings: only rows that have them are decoded
                done_l = done.tolist()
                for j, r in enumerate(active):
                    if stops[r]:
                        text = decode_completion(self.tokenizer, tokens[r, : step + 1].tolist())
                        if any(s in text for s in stops[r]):
                            stop_hit[r] = done_l[j] = True
                done = torch.tensor(done_l, device=dev)
            finished = done.nonzero().squeeze(1).tolist()
            for j in finished:
                lengths[active[j]] = step + 1
            if len(finished) == len(active):
                break
            if finished:  # finished rows leave the batch (and the KV cache)
                keep = (~done).nonzero().squeeze(1)
                cache.reorder_cache(keep)
                rows, tok = rows[keep], tok[keep]
                attention, position_ids = attention[keep], position_ids[keep]
            model_in = tok[:, None]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
            position_ids = position_ids[:, -1:] + 1

        tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
        top_ids_l, top_lps_l = (top_ids.tolist(), top_lps.tolist()) if top else ([], [])
        outs = []
        for r in range(n):
            ids, lps = tokens_l[r][: lengths[r]], logprobs_l[r][: lengths[r]]
            k = requests[r].sampling.top_logprobs
            alts = [list(zip(i_[:k], l_[:k])) for i_, l_ in zip(top_ids_l[r][: lengths[r]], top_lps_l[r][: lengths[r]])] \
                if k else []
            text = decode_completion(self.tokenizer, ids)
            if stop_hit[r]:
                text = text[: min(text.find(s) for s in stops[r] if s in text)]
            reason = "stop" if stop_hit[r] or (ids and ids[-1] in self.eos_ids) else "length"
            outs.append(GenerationOutput(text, list(prompts[r]), ids, lps, reason, top_logprobs=alts))
        return outs

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

"""The running decode batch of `TransformersEngine`: requests join it at step boundaries and leave it as they finish.

`RunningBatch` holds, per row, the KV cache, the attention mask, the next position id, the token sampled last
(not yet fed to the model) and the row's sampling parameters and random stream. Each engine iteration:
- `admit(newcomers)`: one prefill forward over the newcomers alone (left-padded to the longest of them, on a
  fresh cache), which samples their first token; their cache rows are then merged into the running cache,
  the shorter side left-padded with masked zero columns. A prefill of the newcomers alone costs one forward
  of their prompt tokens; prefilling them inside the running rows' decode step would make every running row
  compute the newcomers' prompt width too.
- `step()`: one decode forward for every row (each feeds its last token), which samples the next token.
Rows that finish leave the batch (and the cache) at once; columns that no remaining row attends to are cut.

Why this is exact: attention is a masked sum over cached keys whose RoPE positions were applied before
caching, so where a row's keys sit in the cache (how much masked padding is before them, which rows share the
batch) does not change what it attends to; position ids are per row. What can change is float rounding. On CPU
in float32 (the tiny policy, SDPA attention) a row's logits are bit for bit the same beside 1 or 7 other rows
of the same width, but masked padding columns before it move them by ~2e-6 (the attention reduces over a
longer key axis, in another order): a seeded request joining a batch samples the same tokens unless two are
that close, and its log-probs agree to ~1e-6 (tests/policy/test_policy.py pins tokens equal, log-probs to 1e-5).

Sampling per row is `sample_rows_top` with the row's own uniforms: `noise[row, k]` is the k-th draw of the
request's seeded generator, whatever batch the request runs in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from whale_ray.policy.engine import GenerationOutput, StopMatcher, decode_completion, logits_vocab, sample_rows_top


@dataclass
class Live:
    """One request from submission to its output (the engine thread alone touches it once admitted)."""

    future: Any  # concurrent.futures.Future of its GenerationOutput
    prompt_ids: list[int]
    budget: int  # max_tokens, cut to the context left after the prompt
    noise: torch.Tensor  # [budget] uniforms of the request's own seeded generator
    temperature: float
    top_k: int
    top_p: float
    top_logprobs: int
    stops: Optional[StopMatcher]
    on_token: Optional[Callable[[int, int], None]]
    submitted: float = 0.0  # perf_counter() when it reached the engine, and when it joined a batch
    admitted: float = 0.0
    version: int = 0  # the weights it runs on, set when it is admitted
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alternatives: list[list[tuple[int, float]]] = field(default_factory=list)


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zero columns prepended along `dim` up to `width`."""
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RunningBatch:
    def __init__(self, model: Any, tokenizer: Any, eos_ids: list[int], pad_id: int, cache_kw: str,
                 new_cache: Callable[[], Any], device: torch.device,
                 on_finish: Optional[Callable[[Live], None]] = None):
        self.model, self.tokenizer, self.pad_id, self.cache_kw = model, tokenizer, pad_id, cache_kw
        # called with each request as it finishes, before its future resolves: what the engine counts of it is
        # counted by the time its caller has the output
        self.on_finish = on_finish
        self.eos_ids = eos_ids
        self.new_cache, self.device = new_cache, device
        self.vocab = logits_vocab(model)
        self.rows: list[Live] = []
        self.cache: Any = None
        # per row, on the device: attention [B, T] (the cache's columns; 0 = padding), pos (the next position id),
        # last (the token sampled last, not in the cache yet), step (tokens sampled), noise [B, S] (its uniforms),
        # temperature, top_k, top_p
        self.t: dict[str, torch.Tensor] = {}
        self.forwards = 0  # forward passes, prefills included
        self.prefills = 0  # of them, those that admitted newcomers
        self.sampled = 0  # tokens sampled (rows summed over forwards)

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> list[Live]:
        rows, self.rows, self.cache, self.t = self.rows, [], None, {}
        return rows

    # -- the two kinds of forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def admit(self, newcomers: list[Live], version: int) -> list[Live]:
        """Prefill `newcomers`, sample their first token and merge them in; returns the rows that finished."""
        dev, n = self.device, len(newcomers)
        width = max(len(r.prompt_ids) for r in newcomers)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(newcomers):  # left padding
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            attention[i, width - len(r.prompt_ids):] = 1
            r.version = version
            r.admitted = time.perf_counter()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        ids, attention, positions = ids.to(dev), attention.to(dev), positions.to(dev)
        cache = self.new_cache()
        logits = self._forward(ids, attention, positions, cache)
        self.prefills += 1
        new = {
            "attention": attention, "pos": positions[:, -1] + 1,
            "noise": _padded([r.noise for r in newcomers]),
            "step": torch.zeros(n, dtype=torch.long),
            "temperature": torch.tensor([r.temperature for r in newcomers]),
            "top_k": torch.tensor([r.top_k for r in newcomers], dtype=torch.long),
            "top_p": torch.tensor([r.top_p for r in newcomers]),
        }
        new = {k: v.to(dev) for k, v in new.items()}
        if self.rows:
            self._merge(new, cache)
        else:
            self.t, self.cache = new, cache
        first = len(self.rows)
        self.rows += newcomers
        return self._sample(logits, range(first, first + n))

    @torch.inference_mode()
    def step(self) -> list[Live]:
        """One decode step for every row; returns the rows that finished."""
        t = self.t
        t["attention"] = torch.cat([t["attention"], t["attention"].new_ones((len(self.rows), 1))], dim=1)
        logits = self._forward(t["last"][:, None], t["attention"], t["pos"][:, None], self.cache)
        t["pos"] = t["pos"] + 1
        return self._sample(logits, range(len(self.rows)))

    def _forward(self, ids, attention, positions, cache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.cache_kw: cache})
        self.forwards += 1
        self.sampled += ids.shape[0]
        return out.logits[:, -1, :].float()

    # -- sampling, recording, leaving ----------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: range) -> list[Live]:
        t, sel = self.t, slice(rows.start, rows.stop)
        top = min(max(self.rows[i].top_logprobs for i in rows), self.vocab)
        u = t["noise"][sel].gather(1, t["step"][sel, None]).squeeze(1)
        tok, lp, alt_ids, alt_lps = sample_rows_top(
            logits, t["temperature"][sel], t["top_k"][sel], t["top_p"][sel], u, top)
        last = t.get("last")
        t["last"] = tok if last is None or rows.start == 0 else torch.cat([last[: rows.start], tok])
        t["step"][sel] += 1
        tok_l, lp_l = tok.tolist(), lp.tolist()
        alts = (alt_ids.tolist(), alt_lps.tolist()) if top else None
        done: list[int] = []
        for j, i in enumerate(rows):
            r = self.rows[i]
            r.ids.append(tok_l[j])
            r.logprobs.append(lp_l[j])
            if r.top_logprobs:
                k = r.top_logprobs
                r.alternatives.append(list(zip(alts[0][j][:k], alts[1][j][:k])))
            if r.on_token is not None:
                r.on_token(tok_l[j], r.version)
            if r.future.cancelled() or self._finished(r):
                done.append(i)
        return self._leave(done)

    def _finished(self, r: Live) -> bool:
        """Sets the future's result when `r` is complete (eos, stop string, budget)."""
        hit = r.stops.find(r.ids) if r.stops is not None and r.stops.maybe(r.ids) else None
        if hit is None and not (r.ids[-1] in self.eos_ids or len(r.ids) >= r.budget):
            return False
        if hit is None and r.stops is not None:  # a stop string longer than the tail check: cut where it began
            hit = r.stops.find(r.ids)
        if hit is not None:
            n, text = hit
            del r.ids[n:], r.logprobs[n:], r.alternatives[n:]
            reason = "stop"
        else:
            text = decode_completion(self.tokenizer, r.ids)
            reason = "stop" if r.ids[-1] in self.eos_ids else "length"
        out = GenerationOutput(text, list(r.prompt_ids), r.ids, r.logprobs, reason, r.version, r.alternatives)
        if self.on_finish is not None:
            self.on_finish(r)
        try:
            r.future.set_result(out)
        except Exception:  # cancelled by its caller meanwhile: nobody waits for it
            pass
        return True

    def _leave(self, done: list[int]) -> list[Live]:
        if not done:
            return []
        gone = [self.rows[i] for i in done]
        if len(done) == len(self.rows):
            self.clear()
            return gone
        drop = set(done)
        keep_l = [i for i in range(len(self.rows)) if i not in drop]
        keep = torch.tensor(keep_l, device=self.device)
        self.cache.reorder_cache(keep)
        self.rows = [self.rows[i] for i in keep_l]
        self.t = {k: v[keep] for k, v in self.t.items()}
        # columns no remaining row attends to (the padding that a longer row that left needed) are cut
        used = self.t["attention"].any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first:
            self.t["attention"] = self.t["attention"][:, first:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
        return gone

    def _merge(self, new: dict[str, torch.Tensor], cache: Any) -> None:
        """The newcomers' rows (`new`, `cache`) appended to the running ones, both left-padded to one width."""
        t = self.t
        width = max(t["attention"].shape[1], new["attention"].shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):
                a, b = getattr(mine, name), getattr(theirs, name)
                setattr(mine, name, torch.cat([_left_pad(a, width, -2), _left_pad(b, width, -2)], dim=0))
        steps = max(t["noise"].shape[1], new["noise"].shape[1])
        for k in new:
            a, b = t[k], new[k]
            if k == "attention":
                a, b = _left_pad(a, width, 1), _left_pad(b, width, 1)
            elif k == "noise":  # right-padded: a row's draws start at column 0
                a, b = _right_pad(a, steps), _right_pad(b, steps)
            t[k] = torch.cat([a, b])


def _right_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((t.shape[0], width - t.shape[1]))], dim=1) if t.shape[1] < width else t


def _padded(noises: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(x) for x in noises)
    return torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in noises])


def plain_kv(cache: Any) -> bool:
    """Whether every layer of a `DynamicCache` is plain full attention keys/values (what `_merge` pads and
    cuts); sliding-window or recurrent layers are not, and such models admit newcomers only into an empty batch."""
    return all(type(layer).__name__ == "DynamicLayer" and not getattr(layer, "is_sliding", False)
               for layer in cache.layers)

"""Online rejection-sampling fine-tuning (RSFT): the weight-phase learner. Plain PyTorch, no Ray.

An accepted model call is an `SFTExample`: `(prompt_ids, completion_ids)`. Which calls of an accepted
episode train is `accepted_calls`' rule (a losing vote does not); each gives one example; tool outputs and observations only ever appear inside later prompts,
so masking every prompt token masks them too. The loss is the mean negative log-likelihood over all
completion tokens of a step (a token mean over the whole step, not a mean of per-example means).

`RSFTLearner.train_step(examples)` makes one AdamW update per epoch (`epochs_per_step`) over the step's
examples, accumulating gradients over micro-batches so any number of examples fits in memory; the
gradient equals the one of a single big batch. Its global norm is clipped to `max_grad_norm`, and the rate
ramps up linearly over the learner's first `warmup_steps` updates, counted over its whole life (saved with the
optimizer state, so a resumed run, another weight phase or a new Ray Train run goes on where the ramp was).
`precision` bfloat16 runs the passes under bf16 autocast; the weights and AdamW's state stay float32.
It also runs data-parallel: give it `rank`/`world_size` and a `wrap_model` (DDP;
`ray.train.torch.prepare_model`), and every rank passes the *whole* example list — each takes its shard
`examples[rank::world_size]` (after a length sort), and the global token count that normalises the loss is
computed locally from the full list, so no extra collective is needed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from whale_ray.records import ModelCall

log = logging.getLogger(__name__)

SFTExample = tuple[list[int], list[int]]  # (prompt_ids, completion_ids) of one accepted model call

IGNORE_INDEX = -100


class InvalidExamples(ValueError):
    """The step's examples cannot be trained on (e.g. a token id outside the vocabulary); nothing changed."""


STATE_FILE = "rsft_state.json"  # written last by `save`: its presence marks a complete checkpoint
OPTIMIZER_FILE = "optimizer.pt"
WARM_UP_TOKENS = 128  # the width of `RSFTLearner.warm_up`'s batch: the order of a step's prompts and completions
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


# ---------------------------------------------------------------------------------------------- data
def conversations(calls: list[ModelCall]) -> list[list[int]]:
    """The model calls of one episode as conversations: index chains from a first call to a last one. Call j
    continues call i when j's messages begin with i's and the next message is an assistant turn (the one with
    i's completion, where several calls qualify)."""
    parent: list[int | None] = []
    for j, cj in enumerate(calls):
        mj = cj.messages
        fits = [i for i in range(j) if len(mj) > len(calls[i].messages)
                and mj[:len(calls[i].messages)] == calls[i].messages
                and (mj[len(calls[i].messages)] or {}).get("role") == "assistant"]
        exact = [i for i in fits if mj[len(calls[i].messages)].get("content") == calls[i].text]
        parent.append((exact or fits or [None])[-1])
    leaves = [j for j in range(len(calls)) if j not in parent]
    chains = []
    for leaf in leaves:
        chain, node = [], leaf
        while node is not None:
            chain.append(node)
            node = parent[node]
        chains.append(chain[::-1])
    return chains


def accepted_calls(calls: list[ModelCall], accepts: Callable[[str], bool],
                   states_answer: Callable[[str], bool]) -> list[int]:
    """Which calls of an accepted episode may train. When at most one conversation of the episode ends in a
    completion that states an answer in the domain's format (`states_answer`), the episode is one attempt and
    its reward is that attempt's: every call trains (a chat per move, tool turns, a harness that extracts the
    answer itself). When several do (votes, restarts), only the conversations whose last completion the
    verifier `accepts` train: a losing vote is not a verified sample."""
    chains = conversations(calls)
    answering = [c for c in chains if states_answer(calls[c[-1]].text)]
    if len(answering) <= 1:
        return list(range(len(calls)))
    return sorted({i for c in answering if accepts(calls[c[-1]].text) for i in c})


def truncate(prompt: list[int], completion: list[int], max_len: int | None) -> SFTExample:
    """Fit one example into `max_len` tokens.

    Over the limit, the prompt loses tokens from its left (its start) first. If the completion alone is
    longer than `max_len`, it keeps its first `max_len` tokens and the prompt is dropped entirely; the
    first completion token then has no context and is not trained (see `n_target_tokens`). Completion
    tokens are never dropped silently: `RSFTLearner.train_step` counts and logs such examples."""
    prompt, completion = list(prompt), list(completion)
    if max_len is None or len(prompt) + len(completion) <= max_len:
        return prompt, completion
    if len(completion) >= max_len:
        return [], completion[:max_len]
    return prompt[len(prompt) - (max_len - len(completion)):], completion


def n_target_tokens(prompt: list[int], completion: list[int]) -> int:
    """Completion tokens that are predicted (every one that has a token before it)."""
    return len(completion) - (1 if completion and not prompt else 0)


def collate(examples: list[SFTExample], pad_id: int, max_len: int | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, and labels that hold the token id on completion
    tokens and -100 on prompt tokens and padding. Labels are *not* shifted (position t holds token t);
    the loss shifts them. Over-long examples are cut by `truncate`."""
    rows = [truncate(p, c, max_len) for p, c in examples]
    width = max((len(p) + len(c) for p, c in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c, dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def completion_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(sum of the token NLLs over completion tokens, their number) for one collated batch."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    targets = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                          ignore_index=IGNORE_INDEX, reduction="sum")
    return nll, int((targets != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------------- learner
def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@contextlib.contextmanager
def _writing(path: Path, what: str):
    """Names the checkpoint, the file and the space left when a write fails: torch's own error for a full disk
    reads "unexpected pos ... vs ..." and says neither."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        try:
            free = f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free on its filesystem"
        except OSError:
            free = "free space unknown"
        raise RuntimeError(f"checkpoint {path}: writing {what} failed ({free}): {e}") from e


class RSFTLearner:
    """A causal LM, its AdamW optimizer, and the SFT step on accepted examples."""

    def __init__(
        self, model_path: str | Path, *, lr: float, micro_batch: int, epochs_per_step: int = 1, seed: int = 0,
        device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, max_len: int | None = None,
        weight_decay: float = 0.0, max_grad_norm: float = 1.0, warmup_steps: int = 0, precision: str = "float32",
        rank: int = 0, world_size: int = 1, wrap_model: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if micro_batch <= 0 or epochs_per_step <= 0:
            raise ValueError("micro_batch and epochs_per_step must be positive")
        if precision not in ("float32", "bfloat16"):
            raise ValueError(f"precision must be float32 or bfloat16, got {precision!r}")
        torch.manual_seed(seed)
        self.model_path = Path(model_path)
        self.lr, self.micro_batch, self.epochs_per_step, self.seed = lr, micro_batch, epochs_per_step, seed
        self.max_grad_norm, self.rank, self.world_size = max_grad_norm, rank, world_size
        self.warmup_steps, self.precision = warmup_steps, precision
        self.device = device if isinstance(device, torch.device) else _resolve_device(device)
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device)
        self.model.train()
        cfg = self.model.config
        self.max_len = max_len or getattr(cfg, "max_position_embeddings", None)
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
        self.pad_id = int((pad[0] if isinstance(pad, (list, tuple)) else pad) or 0)
        # The module that runs forward/backward: the model itself, or its DDP wrapper (same parameters).
        self.train_model = wrap_model(self.model) if wrap_model is not None else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.step = 0  # optimizer-steps-that-trained counter: one per train_step with examples
        self.updates = 0  # AdamW updates made (epochs_per_step per step): the warm-up's clock

    # ------------------------------------------------------------------------------------ training
    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device) for k, v in batch.items()}

    def lr_at(self, update: int) -> float:
        """The rate of update number `update` (0 = the learner's first): linear warm-up, then constant."""
        if update < self.warmup_steps:
            return self.lr * (update + 1) / self.warmup_steps
        return self.lr

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bfloat16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def warm_up(self) -> float:
        """One forward and backward pass over a micro-batch of padding, its gradients thrown away; its seconds. On
        a fresh CUDA context the first pass loads the kernels and makes cuBLAS's handles, seconds that a Trainer's
        worker pays here, as it starts (beside the run's first rollouts), rather than in its first step. The
        weights, the optimizer's state and the RNGs stay as they were. Under DDP every rank calls it together: the
        backward all-reduces, which opens the gradients' collective too."""
        t0 = time.perf_counter()
        width = min(WARM_UP_TOKENS, self.max_len or WARM_UP_TOKENS)
        row = ([self.pad_id] * (width // 2), [self.pad_id] * (width - width // 2))
        batch = self._to_device(collate([row] * self.micro_batch, self.pad_id))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            with self._autocast():
                nll, _ = completion_nll(self.train_model, batch)
            nll.backward()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def train_step(self, examples: list[SFTExample]) -> dict[str, Any]:
        """Train on one step's accepted examples; every rank passes the same full list.

        Metrics: loss (mean completion-token NLL before the update, i.e. over the first epoch),
        last_epoch_loss, grad_norm (before clipping, last epoch), clipped (whether any epoch's norm was over
        max_grad_norm), lr (the last update's rate, after warm-up), updates (AdamW updates so far), n_examples,
        n_tokens (trained completion tokens), n_truncated, step, trained (False for a no-op); the shape of this rank's
        passes: max_width (its widest micro-batch) and padded_tokens (the positions its micro-batches run, padding
        included); and where the step's time went: prepare_s (checks, truncation, the length sort), pass_s (forward,
        backward and the clip; the norm's read waits for the GPU), update_s (AdamW and the loss's read)."""
        t_start = time.perf_counter()
        vocab = self.model.get_input_embeddings().num_embeddings
        for p, c in examples:
            bad = [t for t in (*p, *c) if not 0 <= t < vocab]
            if bad:
                raise InvalidExamples(f"token id {bad[0]} outside the model's vocabulary [0, {vocab})")
        rows = [truncate(p, c, self.max_len) for p, c in examples]
        n_truncated = sum(len(p) + len(c) != len(rp) + len(rc) for (p, c), (rp, rc) in zip(examples, rows))
        n_cut_completion = sum(len(c) != len(rc) for (_, c), (_, rc) in zip(examples, rows))
        if n_cut_completion:
            log.warning("rsft: %d completion(s) longer than max_len=%s were cut to their first tokens",
                        n_cut_completion, self.max_len)
        n_tokens = sum(n_target_tokens(p, c) for p, c in rows)
        metrics: dict[str, Any] = {
            "n_examples": len(rows), "n_tokens": n_tokens, "n_truncated": n_truncated,
            "epochs": self.epochs_per_step, "world_size": self.world_size, "max_grad_norm": self.max_grad_norm,
            "precision": self.precision,
        }
        if n_tokens == 0:
            return {**metrics, "trained": False, "step": self.step, "updates": self.updates, "loss": math.nan,
                    "last_epoch_loss": math.nan, "grad_norm": 0.0, "clipped": False, "lr": self.lr_at(self.updates)}

        # A length sort keeps padding low; the stride shard gives every rank a similar token count.
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]), reverse=True)
        mine = [rows[i] for i in order[self.rank::self.world_size]]
        chunks = [mine[i:i + self.micro_batch] for i in range(0, len(mine), self.micro_batch)] or [[]]
        widths = [max((len(p) + len(c) for p, c in chunk), default=0) for chunk in chunks]
        metrics.update(max_width=max(widths), padded_tokens=sum(len(ch) * w for ch, w in zip(chunks, widths)))
        scale = self.world_size / n_tokens  # DDP averages gradients over ranks: this makes it a global token mean

        epoch_losses, grad_norm, clipped, lr = [], 0.0, False, self.lr
        prepare_s, pass_s, update_s = time.perf_counter() - t_start, 0.0, 0.0
        for _ in range(self.epochs_per_step):
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            nll_sum = torch.zeros((), device=self.device, dtype=torch.float64)
            for j, chunk in enumerate(chunks):
                sync = j == len(chunks) - 1  # one gradient all-reduce per epoch, on the last micro-batch
                no_sync = getattr(self.train_model, "no_sync", None)
                with no_sync() if (no_sync is not None and not sync) else contextlib.nullcontext():
                    if chunk:
                        with self._autocast():
                            nll, _ = completion_nll(self.train_model, self._to_device(collate(chunk, self.pad_id)))
                        (nll * scale).backward()
                        nll_sum += nll.detach().double()
                    else:  # this rank has no examples: a zero-weight pass so the DDP all-reduce still meets
                        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
                        (self.train_model(input_ids=ids).logits.sum() * 0.0).backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
            clipped = clipped or grad_norm > self.max_grad_norm
            t1 = time.perf_counter()
            lr = self.lr_at(self.updates)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.updates += 1
            epoch_losses.append(float(self._all_reduce_sum(nll_sum)) / n_tokens)
            pass_s, update_s = pass_s + t1 - t0, update_s + time.perf_counter() - t1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {**metrics, "trained": True, "step": self.step, "updates": self.updates, "loss": epoch_losses[0],
                "last_epoch_loss": epoch_losses[-1], "grad_norm": grad_norm, "clipped": clipped, "lr": lr,
                "prepare_s": prepare_s, "pass_s": pass_s, "update_s": update_s}

    @torch.no_grad()
    def evaluate_loss(self, examples: list[SFTExample]) -> float:
        """Mean completion-token NLL of `examples` under the current weights (no update; this rank only)."""
        rows = [truncate(p, c, self.max_len) for p, c in examples]
        total, n = 0.0, 0
        for i in range(0, len(rows), self.micro_batch):
            with self._autocast():
                nll, k = completion_nll(self.model, self._to_device(collate(rows[i:i + self.micro_batch], self.pad_id)))
            total, n = total + float(nll), n + k
        return total / n if n else math.nan

    # ---------------------------------------------------------------------------------- state I/O
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as CPU tensors (HF parameter names), detached copies."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, path: str | Path) -> Path:
        """An HF-format checkpoint (safetensors + config + tokenizer files of the original model dir)
        plus the optimizer state and `rsft_state.json` (step and hyper-parameters), written last."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with _writing(path, "the weights"):
            self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:
            src = self.model_path / name
            if src.is_file() and src.resolve() != (path / name).resolve():
                with _writing(path, name):
                    shutil.copy2(src, path / name)
        with _writing(path, OPTIMIZER_FILE):
            torch.save({"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state()}, path / OPTIMIZER_FILE)
        state = {"format": "whale_ray.rsft/1", "step": self.step, "updates": self.updates, "lr": self.lr,
                 "warmup_steps": self.warmup_steps, "max_grad_norm": self.max_grad_norm, "precision": self.precision,
                 "micro_batch": self.micro_batch, "epochs_per_step": self.epochs_per_step, "seed": self.seed,
                 "base_model": str(self.model_path)}
        with _writing(path, STATE_FILE):
            (path / STATE_FILE).write_text(json.dumps(state, indent=1))
        return path

    def load(self, path: str | Path) -> None:
        """Restore model weights, optimizer state, RNG, step and update count from a `save` directory (exact resume).
        The learning rate, warm-up and clipping stay the ones this learner was built with (the config is the source
        of truth); the warm-up goes on from the saved update count."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path}: not an RSFT checkpoint (no {STATE_FILE})")
        state = json.loads((path / STATE_FILE).read_text())
        weights = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).state_dict()
        self.model.load_state_dict(weights, strict=True)
        del weights
        extra = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        self.optimizer.load_state_dict(extra["optimizer"])
        torch.set_rng_state(extra["rng"])
        self.step = int(state["step"])
        # a checkpoint from before the count was saved made epochs_per_step updates per step
        self.updates = int(state.get("updates", self.step * int(state.get("epochs_per_step", self.epochs_per_step))))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.updates)

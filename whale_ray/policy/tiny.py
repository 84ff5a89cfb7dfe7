"""The embedded tiny policy: a small Qwen3 model and byte-level BPE tokenizer, built offline for a domain.

`build_embedded_policy(domain)` trains a tokenizer on the domain's warm-start conversations, warm-starts a
~1M-parameter `Qwen3ForCausalLM` on them by supervised fine-tuning (loss on assistant tokens only), and
saves an ordinary Hugging Face checkpoint directory (safetensors weights, tokenizer, chat template,
generation config) that `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained` load with no network.

Builds are cached under `$WHALE_CACHE` (default `~/.cache/whale-ray`): the directory name is a hash of
everything that determines the checkpoint, a build happens in a temporary directory that is renamed into
place only when complete, and concurrent builders of the same key are serialised by a file lock.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from whale_ray.storage import default_cache_dir, file_lock

if TYPE_CHECKING:
    from whale_ray.domain import Domain

# Bump when the corpus preparation, tokenizer recipe or training recipe changes: it is part of the cache key.
DATA_VERSION = "tiny-v1"

IM_START, IM_END, PAD = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# ChatML as in Qwen: every message is `<|im_start|>role\ncontent<|im_end|>\n`; the generation prompt opens
# an assistant turn. `_render_chat` below is the same function in Python (checked against this at build time).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

BUILD_INFO = "whale_build.json"  # written into every built checkpoint: key inputs, loss curve ends, timing


@dataclass(frozen=True)
class TinyConfig:
    """Everything about the model and the warm-start recipe besides domain, steps and seed."""

    vocab_size: int = 768
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    batch_size: int = 24  # 24 x ~100 tokens: small enough that the warm-start takes minutes on CPU
    learning_rate: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.01
    max_conversations: int = 20_000  # asked of the domain; cycled when the run needs more sequences
    tokenizer_conversations: int = 2_000


# ---------------------------------------------------------------------------------------------------------
# Public entry points


def build_embedded_policy(
    domain: "Domain",
    *,
    cache_dir: Path | None = None,
    warmstart_steps: int = 1200,
    seed: int = 0,
    progress: bool = True,
    config: TinyConfig | None = None,
    device: str = "cpu",
) -> Path:
    """The checkpoint directory of the tiny policy warm-started on `domain`; built once, then cached.
    `device` only says where the warm-start runs (a GPU box can build the cache for CPU machines); it
    is recorded in the build info, not in the cache key."""
    if warmstart_steps < 0:
        raise ValueError(f"warmstart_steps must be >= 0, got {warmstart_steps}")
    cfg = config or TinyConfig()
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key_inputs = {
        "domain": domain.name,
        "data_version": DATA_VERSION,
        "domain_data_version": str(getattr(domain, "warmstart_version", "")),
        "domain_fingerprint": _corpus_fingerprint(domain, seed),
        "warmstart_steps": warmstart_steps,
        "seed": seed,
        "config": asdict(cfg),
    }
    digest = hashlib.sha256(json.dumps(key_inputs, sort_keys=True).encode()).hexdigest()[:16]
    final = cache_dir / f"tiny-{domain.name}-{digest}"
    if _is_complete(final):
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{final.name}.lock"):
        if _is_complete(final):  # another process finished it while we waited
            return final
        for stale in cache_dir.glob(f".{final.name}.tmp-*"):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
        try:
            info = _build(domain, tmp, steps=warmstart_steps, seed=seed, cfg=cfg, progress=progress, device=device)
            info["key"] = key_inputs
            (tmp / BUILD_INFO).write_text(json.dumps(info, indent=2))
            if final.exists():  # incomplete leftover under the final name (should not happen): replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def read_build_info(model_path: Path) -> dict[str, Any]:
    """The build record of a tiny-policy checkpoint (loss curve ends, time, steps/s), {} for other checkpoints."""
    p = Path(model_path) / BUILD_INFO
    return json.loads(p.read_text()) if p.is_file() else {}


# ---------------------------------------------------------------------------------------------------------
# Tokenizer


def _render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + f"{IM_START}assistant\n" if add_generation_prompt else text


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int = TinyConfig.max_position_embeddings):
    """A byte-level BPE `PreTrainedTokenizerFast`, digits split one by one, ChatML specials and template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # BPE training does not split out special tokens: train on the text between them, so that no merge
    # such as "```<|" wastes the small vocabulary.
    specials = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
    texts = [piece for text in texts for piece in specials.split(text) if piece]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )


# ---------------------------------------------------------------------------------------------------------
# Warm-start data: one token sequence per conversation (split where re-tokenisation would disagree)


def _check_conversation(conv: Any, where: str) -> None:
    if not isinstance(conv, list) or not conv:
        raise ValueError(f"{where}: a conversation must be a non-empty list of messages")
    for m in conv:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: every message needs string 'role' and 'content', got {m!r}")
    if not any(m["role"] == "assistant" for m in conv):
        raise ValueError(f"{where}: a warm-start conversation needs at least one assistant turn")


def encode_sft_examples(
    tokenizer, conversations: list[list[dict[str, str]]], max_len: int
) -> tuple[list[tuple[list[int], list[int]]], int]:
    """(input_ids, labels) pairs: labels are -100 except on assistant content + its closing <|im_end|>.

    For assistant turn i the context is exactly `encode(template(messages[:i], add_generation_prompt=True))`
    (what the engine feeds the model) and the target is `encode(content + "<|im_end|>")`. Turns of one
    conversation share a sequence when the earlier turns' ids are a prefix of the later prompt; otherwise a
    new sequence starts, so every target sees exactly its inference-time prompt. Returns (examples, dropped),
    where dropped counts sequences longer than max_len.
    """
    prompts: list[str] = []
    targets: list[str] = []
    owner: list[int] = []
    for ci, conv in enumerate(conversations):
        for i, m in enumerate(conv):
            if m["role"] == "assistant":
                prompts.append(_render_chat(conv[:i], add_generation_prompt=True))
                targets.append(m["content"] + IM_END)
                owner.append(ci)
    backend = tokenizer.backend_tokenizer
    p_ids = [e.ids for e in backend.encode_batch(prompts, add_special_tokens=False)]
    t_ids = [e.ids for e in backend.encode_batch(targets, add_special_tokens=False)]

    examples: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    prev_owner = -1
    for p, t, o in zip(p_ids, t_ids, owner):
        if o == prev_owner and len(p) >= len(ids) and p[: len(ids)] == ids:
            labels += [-100] * (len(p) - len(ids))
            ids = list(p)
        else:
            if ids:
                examples.append((ids, labels))
            ids, labels = list(p), [-100] * len(p)
        ids += t
        labels += t
        prev_owner = o
    if ids:
        examples.append((ids, labels))
    kept = [e for e in examples if len(e[0]) <= max_len]
    return kept, len(examples) - len(kept)


def _corpus_fingerprint(domain: "Domain", seed: int) -> str:
    """A hash of a small sample of the domain's warm-start data, so a changed generator changes the cache key."""
    sample = domain.warmstart_conversations(16, seed)
    return hashlib.sha256(json.dumps(sample, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# The build


def tiny_model_config(cfg: TinyConfig, tokenizer):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        use_cache=True,
    )


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _build(
    domain: "Domain", out: Path, *, steps: int, seed: int, cfg: TinyConfig, progress: bool, device: str = "cpu"
) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    t0 = time.perf_counter()
    n_conv = min(max(steps * cfg.batch_size, cfg.tokenizer_conversations), cfg.max_conversations)
    conversations = domain.warmstart_conversations(n_conv, seed)
    if not conversations:
        raise ValueError(f"domain {domain.name!r}: warmstart_conversations returned no conversations")
    for i, conv in enumerate(conversations):
        _check_conversation(conv, f"domain {domain.name!r} warm-start conversation {i}")

    tokenizer = train_tokenizer(
        [_render_chat(c, False) for c in conversations[: cfg.tokenizer_conversations]], cfg.vocab_size,
        cfg.max_position_embeddings,
    )
    for conv in conversations[:20]:  # the fast Python renderer must agree with the saved Jinja template
        for add_gen in (False, True):
            if tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_gen) != _render_chat(conv, add_gen):
                raise AssertionError("chat template and _render_chat disagree")
    examples, dropped = encode_sft_examples(tokenizer, conversations, cfg.max_position_embeddings)
    if not examples:
        raise ValueError(f"domain {domain.name!r}: no warm-start sequence fits {cfg.max_position_embeddings} tokens")
    t_data = time.perf_counter() - t0

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_model_config(cfg, tokenizer))
    n_params = sum(p.numel() for p in model.parameters())
    losses: list[float] = []
    t1 = time.perf_counter()
    if steps > 0:
        with _torch_threads(2):
            losses = _train(
                model, examples, steps=steps, seed=seed, cfg=cfg, pad_id=tokenizer.pad_token_id, progress=progress,
                device=device,
            )
    t_train = time.perf_counter() - t1
    model.to("cpu").eval()

    model.generation_config = GenerationConfig(  # Qwen's: both <|im_end|> and <|endoftext|> end a generation
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=20,
        top_p=1.0,
        max_new_tokens=64,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    head = losses[: max(1, min(20, len(losses) // 10))]
    tail = losses[-max(1, min(50, len(losses) // 10)):]
    return {
        "domain": domain.name,
        "device": device,
        "n_params": n_params,
        "vocab_size": len(tokenizer),
        "conversations": len(conversations),
        "sequences": len(examples),
        "sequences_dropped_too_long": dropped,
        "mean_sequence_tokens": sum(len(e[0]) for e in examples) / len(examples),
        "steps": steps,
        "loss_first": losses[0] if losses else None,
        "loss_start": sum(head) / len(head) if losses else None,
        "loss_end": sum(tail) / len(tail) if losses else None,
        "loss_curve_every_10": losses[::10],
        "data_seconds": round(t_data, 2),
        "train_seconds": round(t_train, 2),
        "steps_per_second": round(steps / t_train, 2) if steps else None,
        "build_seconds": round(time.perf_counter() - t0, 2),
    }


def _batches(examples: list[tuple[list[int], list[int]]], batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless index batches: each epoch shuffled, grouped by similar length (less padding), batches shuffled."""
    rng = random.Random(seed)
    order = list(range(len(examples)))
    while True:
        rng.shuffle(order)
        chunk = batch_size * 32
        batches = []
        for s in range(0, len(order), chunk):
            group = sorted(order[s : s + chunk], key=lambda i: len(examples[i][0]))
            batches += [group[j : j + batch_size] for j in range(0, len(group), batch_size)]
        rng.shuffle(batches)
        yield from batches


def _train(
    model, examples, *, steps: int, seed: int, cfg: TinyConfig, pad_id: int, progress: bool, device: str = "cpu"
) -> list[float]:
    import torch
    from tqdm.auto import tqdm

    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.learning_rate, betas=(0.9, 0.98), eps=1e-8,
    )
    warmup = min(cfg.warmup_steps, max(1, steps // 10))

    def lr_at(step: int) -> float:  # linear warm-up, then cosine down to min_lr_ratio
        if step < warmup:
            return cfg.learning_rate * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return cfg.learning_rate * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    losses: list[float] = []
    batches = _batches(examples, cfg.batch_size, seed)
    bar = tqdm(total=steps, desc="warm-start tiny policy", disable=not progress, leave=False)
    for step in range(steps):
        idx = next(batches)
        width = max(len(examples[i][0]) for i in idx)
        # Right padding needs no attention mask for a causal LM: real tokens never attend to later pads,
        # and pad positions carry label -100.
        input_ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        labels = torch.full((len(idx), width), -100, dtype=torch.long)
        for r, i in enumerate(idx):
            ids, lab = examples[i]
            input_ids[r, : len(ids)] = torch.tensor(ids)
            labels[r, : len(lab)] = torch.tensor(lab)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        bar.update(1)
    bar.close()
    return losses


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and (path / BUILD_INFO).is_file()

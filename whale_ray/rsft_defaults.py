"""RSFT's optimiser settings when the config leaves them to the run: chosen from the checkpoint and the device.

`weight.learning_rate`, `warmup_steps`, `max_grad_norm` (None) and `precision` ("auto") are resolved once, when a
run starts (`resolve_run_config`, from the Coordinator), and the resolved values are what its config.yaml records,
so a resumed run, `whale status` and `whale report` show the values it trained with. A resumed run keeps its
recorded values for the keys the relaunch leaves unset (a later whale-ray may choose differently; the run must
not change its optimiser half way), and `RunDirectory.config_conflicts` compares only the keys that are set.

The choice:
- the embedded tiny policy (a checkpoint with tiny.BUILD_INFO, or no `policy.model`): the settings it was tuned
  with and every earlier run used (lr 3e-4, no warm-up, clipping at 1.0, float32), so its results do not move;
- any other checkpoint, by its parameter count (safetensors headers, else an estimate from config.json):
  a learning rate that shrinks with size. The WHALE repository's launchers fine-tune Qwen3.5-2B at 1e-6 (search)
  and 1e-7 (math) with 256 prompts x 8 samples per step; our steps are smaller (16 prompts x 8 by default) and
  noisier, so a model in that band starts at its search value, and a model below 1B, whose weights are fewer and
  larger, at 1e-5 (docs/results.md, "RSFT learning rate on a real model", measures it against the embedded
  policy's 3e-4). Math's 1e-7 is one task's tuning, not a default for every domain.
  Warm-up over the first updates: AdamW's first update moves every weight by about the full rate whatever its
  gradient (the moment estimates start from one sample), the largest relative change a run makes.
  Clipping at a global norm of 1.0, as the embedded policy and most fine-tuning recipes do.
  bfloat16 autocast on a GPU (the tensor cores' type; float32 weights and optimiser state underneath), float32
  on CPU, where bf16 matmuls are not faster on every machine and the embedded results were made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from whale_ray.config import WeightPhaseConfig, WhaleConfig

# The keys resolved here: "unset" in a config means None, or "auto" for precision.
RESOLVED_KEYS = ("weight.learning_rate", "weight.warmup_steps", "weight.max_grad_norm", "weight.precision")


def unset(value: Any) -> bool:
    return value is None or value == "auto"


@dataclass(frozen=True)
class CheckpointFacts:
    """What the choice looks at: whether the checkpoint is the embedded tiny policy, and its parameter count."""

    embedded: bool
    n_params: Optional[int]  # None: neither the weights' headers nor config.json tell


EMBEDDED = CheckpointFacts(embedded=True, n_params=None)


@dataclass(frozen=True)
class Band:
    """The settings for real checkpoints up to `max_params` parameters."""

    max_params: float
    learning_rate: float


BANDS = (Band(1e9, 1e-5), Band(1e10, 1e-6), Band(float("inf"), 5e-7))
REAL_WARMUP_STEPS = 5
MAX_GRAD_NORM = 1.0
EMBEDDED_LEARNING_RATE = 3e-4


def _config_estimate(config: dict[str, Any]) -> Optional[int]:
    """A decoder's parameter count from config.json (embeddings, attention, MLP); None if the keys are missing."""
    cfg = config.get("text_config") or config  # multimodal configs keep the language model's keys there
    try:
        vocab, hidden, layers = int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
        inter = int(cfg.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError):
        return None
    heads = int(cfg.get("num_attention_heads") or 1)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kv = int(cfg.get("num_key_value_heads") or heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
    return embeddings + layers * (attention + 3 * hidden * inter)


def describe_checkpoint(model_path: str | Path | None) -> CheckpointFacts:
    """The facts of a checkpoint directory (None: the embedded policy, which the run builds)."""
    if model_path is None:
        return EMBEDDED
    from whale_ray.policy.tiny import BUILD_INFO

    path = Path(model_path)
    if (path / BUILD_INFO).is_file():
        return EMBEDDED
    if any(path.glob("*.safetensors")):
        from safetensors import SafetensorError

        from whale_ray.policy.checkpoint import checkpoint_shapes

        try:
            return CheckpointFacts(embedded=False, n_params=sum(math.prod(s) for s in checkpoint_shapes(path).values()))
        except (OSError, ValueError, SafetensorError):
            pass  # a damaged file: the loader names it; the size then comes from config.json
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return CheckpointFacts(embedded=False, n_params=None)
    return CheckpointFacts(embedded=False, n_params=_config_estimate(config) if isinstance(config, dict) else None)


def chosen(facts: CheckpointFacts, use_gpu: bool) -> dict[str, Any]:
    """The settings the run takes for every key left unset."""
    if facts.embedded:
        return {"learning_rate": EMBEDDED_LEARNING_RATE, "warmup_steps": 0, "max_grad_norm": MAX_GRAD_NORM,
                "precision": "float32"}
    # size unknown: the band of the models the reference launchers train (1e-6), not the small models' rate
    n = facts.n_params if facts.n_params is not None else BANDS[1].max_params
    band = next(b for b in BANDS if n <= b.max_params)
    return {"learning_rate": band.learning_rate, "warmup_steps": REAL_WARMUP_STEPS, "max_grad_norm": MAX_GRAD_NORM,
            "precision": "bfloat16" if use_gpu else "float32"}


def resolve_weight_phase(w: WeightPhaseConfig, facts: CheckpointFacts,
                         recorded: WeightPhaseConfig | None = None) -> WeightPhaseConfig:
    """`w` with every unset key filled: from `recorded` (the run's config.yaml) where it has a value, else chosen."""
    choice = chosen(facts, w.use_gpu)
    fill = {}
    for dotted in RESOLVED_KEYS:
        key = dotted.removeprefix("weight.")
        if unset(getattr(w, key)):
            old = getattr(recorded, key) if recorded is not None else None
            fill[key] = old if not unset(old) else choice[key]
    return w.model_copy(update=fill)


def resolve_run_config(cfg: WhaleConfig, model_path: str | Path | None,
                       recorded: WhaleConfig | None = None) -> WhaleConfig:
    """`cfg` with `weight`'s unset optimiser settings resolved for the checkpoint at `model_path`."""
    weight = resolve_weight_phase(cfg.weight, describe_checkpoint(model_path),
                                  recorded.weight if recorded is not None else None)
    return cfg.model_copy(update={"weight": weight})

"""A policy checkpoint: any local Hugging Face causal-LM directory (the embedded tiny policy, an imported GGUF, a
Qwen3.5-2B folder, ...) or a hub id the local hub cache holds (whale_ray/hub.py), checked and loaded without touching
the network.

A usable checkpoint has a config, a tokenizer with a chat template (every engine renders prompts with it on the
trusted side) and at least one eos id (the generation config's, else the model config's, and the tokenizer's):
without one a completion could only end at its token budget. `check_checkpoint` checks all of that up front, so a
command refuses a bad `--model` in one line before it creates anything; the loaders raise the same errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from whale_ray.hub import hub_id, not_cached, resolve_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class CheckpointError(ValueError):
    """A policy checkpoint path is not usable; the message names the path and what is missing, in one line."""


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def check_checkpoint_dir(model_path: Path | str) -> Path:
    """`model_path` as a Path (a hub id as its cached snapshot), after checking its files look like a local HF
    causal-LM checkpoint; CheckpointError if not. Reads no weights and loads no tokenizer (`check_checkpoint` does)."""
    path = resolve_model(Path(model_path).expanduser())
    if not path.exists():
        repo = hub_id(path)
        raise CheckpointError(f"policy checkpoint {path}: {not_cached(repo) if repo else 'no such directory'}")
    if not path.is_dir():
        raise CheckpointError(f"policy checkpoint {path}: not a directory (expected a Hugging Face checkpoint folder)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"policy checkpoint {path}: no config.json (not a Hugging Face model directory)")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise CheckpointError(
            f"policy checkpoint {path}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})"
        )
    return path


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape from the checkpoint's safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"policy checkpoint {path}: no *.safetensors files (vLLM reloads need named weights)")
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    return shapes


def _read_json(path: Path, name: str) -> dict[str, Any]:
    file = path / name
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"policy checkpoint {path}: {name} is not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"policy checkpoint {path}: {name} is not a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    return [value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)]


def eos_token_ids(model_path: Path | str, tokenizer: "PreTrainedTokenizerBase") -> list[int]:
    """The ids that end a completion: the generation config's eos ids (the model config's when the generation
    config names none, as transformers falls back) and the tokenizer's eos; CheckpointError when there is none."""
    path = Path(model_path)
    generation = _read_json(path, "generation_config.json").get("eos_token_id")
    eos = _ids(generation if generation is not None else _read_json(path, "config.json").get("eos_token_id"))
    if tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    if not eos:
        raise CheckpointError(f"policy checkpoint {path}: no eos token (none in generation_config.json, "
                              "config.json or the tokenizer), so a completion could never end")
    return sorted(set(eos))


def load_tokenizer(model_path: Path | str) -> "PreTrainedTokenizerBase":
    """The checkpoint's tokenizer (it must have a chat template), never touching the network; every engine
    renders prompts with it on the trusted side."""
    from transformers import AutoTokenizer

    path = check_checkpoint_dir(model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"policy checkpoint {path}: the tokenizer could not be loaded ({_line(e)})") from e
    if not tokenizer.chat_template:
        raise CheckpointError(f"policy checkpoint {path}: the tokenizer has no chat template (a base model? "
                              "an instruct checkpoint ships one in chat_template.jinja or tokenizer_config.json)")
    return tokenizer


def check_checkpoint(model_path: Path | str) -> Path:
    """Everything about a checkpoint that can be checked before anything starts: its files, a model config
    transformers knows, a tokenizer with a chat template, an eos id. The weights are not read."""
    path = check_checkpoint_dir(model_path)
    _read_json(path, "config.json")
    from transformers import AutoConfig  # here: a folder that is no checkpoint is named without loading torch

    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"policy checkpoint {path}: config.json is not a model config transformers "
                              f"knows ({_line(e)})") from None
    eos_token_ids(path, load_tokenizer(path))
    return path


def load_policy(
    model_path: Path | str, *, device: str = "cpu", dtype: Any = "auto"
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """(model, tokenizer) from a local checkpoint directory, in eval mode, never touching the network."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    path = check_checkpoint_dir(model_path)
    tokenizer = load_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as e:  # a truncated or corrupt weights file is the checkpoint's
        raise CheckpointError(f"policy checkpoint {path}: could not be loaded ({_line(e)})") from e
    model.to(device)
    model.eval()
    return model, tokenizer


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

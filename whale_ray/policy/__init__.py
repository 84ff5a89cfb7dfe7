"""The policy: checkpoints (checkpoint.py: checked and loaded; model_import.py: made from a GGUF file), the
embedded tiny model (tiny.py) and the generation engines (transformers_engine.py, vllm_engine.py; their common
types in engine.py), by name."""

from pathlib import Path
from typing import Any

from whale_ray.policy.engine import Engine, GenerationOutput, GenerationRequest, check_request
from whale_ray.policy.tiny import build_embedded_policy, read_build_info
from whale_ray.policy.transformers_engine import TransformersEngine
from whale_ray.policy.vllm_engine import VLLMEngine

ENGINES = ("transformers", "vllm")


def make_engine(kind: str, model_path: Path | str, **kw: Any) -> Engine:
    """An engine by name: 'transformers' (default, CPU or GPU) or 'vllm' (GPU; needs the vllm extra)."""
    if kind not in ENGINES:
        raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")
    if kind == "vllm":
        return VLLMEngine(model_path, **kw)
    return TransformersEngine(model_path, **kw)


__all__ = [
    "ENGINES",
    "Engine",
    "GenerationOutput",
    "GenerationRequest",
    "TransformersEngine",
    "VLLMEngine",
    "build_embedded_policy",
    "check_request",
    "make_engine",
    "read_build_info",
]

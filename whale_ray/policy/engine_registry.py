"""Generation engines by name: `policy.engine` -> the class, imported only when asked for (as the proposers'
registry does), so that reading a config never imports torch and a CPU run never imports the vLLM engine.

The config's choice list is `ENGINE_NAMES` (whale_ray/config.py), so a name is known here or refused there."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from whale_ray.policy.engine import Engine


def _transformers() -> type[Engine]:
    from whale_ray.policy.transformers_engine import TransformersEngine

    return TransformersEngine


def _vllm() -> type[Engine]:
    from whale_ray.policy.vllm_engine import VLLMEngine  # vllm itself is imported when one is built

    return VLLMEngine


ENGINES: dict[str, Callable[[], type[Engine]]] = {"transformers": _transformers, "vllm": _vllm}
ENGINE_NAMES = tuple(ENGINES)


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
    return ENGINES[name]()


def make_engine(name: str, model_path: Path | str, **kw: Any) -> Engine:
    """An engine by name: 'transformers' (default, CPU or GPU) or 'vllm' (GPU; needs the vllm extra)."""
    return engine_class(name)(model_path, **kw)


__all__ = ["ENGINES", "ENGINE_NAMES", "engine_class", "make_engine"]

"""The policy: the embedded tiny model (tiny.py) and the generation engines (engine.py)."""

from whale_ray.policy.engine import (
    Engine,
    GenerationOutput,
    GenerationRequest,
    TransformersEngine,
    check_request,
    make_engine,
)
from whale_ray.policy.tiny import (
    CheckpointError,
    build_embedded_policy,
    check_checkpoint_dir,
    default_cache_dir,
    load_policy,
    read_build_info,
)
from whale_ray.policy.vllm_engine import VLLMEngine

__all__ = [
    "CheckpointError",
    "Engine",
    "GenerationOutput",
    "GenerationRequest",
    "TransformersEngine",
    "VLLMEngine",
    "build_embedded_policy",
    "check_checkpoint_dir",
    "check_request",
    "default_cache_dir",
    "load_policy",
    "make_engine",
    "read_build_info",
]

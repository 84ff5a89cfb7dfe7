"""One typed config for a run: YAML file values, overridden by command-line flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

CONDITIONS = ("rsft_only", "mh_only", "whale", "adaptive_whale", "stagewise")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    source: Literal["generated", "files"] = "generated"
    train_path: Optional[Path] = None  # DAPO-Math-17K style parquet: D_weight, D_harness, D_val come from it
    test_paths: list[Path] = Field(default_factory=list)  # AIME style parquet/JSONL: D_test
    n_weight: int = Field(160, gt=0)
    n_harness: int = Field(48, gt=0)
    n_val: int = Field(32, gt=0)
    n_test: int = Field(32, gt=0)

    @model_validator(mode="after")
    def _files_given(self) -> "DataConfig":
        if self.source == "files" and (self.train_path is None or not self.test_paths):
            raise ValueError("data.source 'files' needs data.train_path and data.test_paths")
        return self


class PolicyConfig(_Strict):
    model: Optional[Path] = None  # a local Hugging Face checkpoint directory; None builds the embedded tiny policy
    engine: Literal["transformers", "vllm"] = "transformers"
    max_batch: int = Field(64, gt=0)
    batch_wait_ms: float = Field(5.0, ge=0)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    warmstart_steps: int = Field(1200, ge=0)


class WeightPhaseConfig(_Strict):
    # Sampling (temperature, top-k) is the harness' to decide: it is part of the agent being optimised.
    samples_per_prompt: int = Field(8, gt=0)  # k
    prompts_per_step: int = Field(16, gt=0)
    learning_rate: float = Field(3e-4, gt=0)
    micro_batch: int = Field(32, gt=0)
    sft_epochs_per_step: int = Field(1, gt=0)
    num_workers: int = Field(1, gt=0)  # Ray Train workers
    use_gpu: bool = False


class HarnessPhaseConfig(_Strict):
    candidates_per_iteration: int = Field(3, gt=0)  # M
    proposer: Literal["offline"] = "offline"
    rollouts_per_example: int = Field(1, gt=0)
    noise_margin: float = Field(0.0, ge=0)


class AdaptiveConfig(_Strict):
    weight_min_epochs: float = Field(0.2, gt=0)
    weight_window: int = Field(3, gt=0)  # steps in the sliding window of training reward
    weight_max_epochs: float = Field(2.0, gt=0)
    harness_min_iterations: int = Field(5, gt=0)
    harness_patience: int = Field(2, gt=0)
    harness_max_iterations: int = Field(15, gt=0)


class SandboxConfig(_Strict):
    slots: int = Field(16, gt=0)  # concurrent episodes per evaluator
    evaluators: int = Field(1, gt=0)
    wall_s: float = Field(20.0, gt=0)
    memory_mb: int = Field(1024, gt=0)
    max_processes: int = Field(64, gt=0)
    max_output_bytes: int = Field(1 << 20, gt=0)
    max_rpc_calls: int = Field(256, gt=0)
    max_message_bytes: int = Field(1 << 20, gt=0)
    # "auto" uses bubblewrap and refuses to run without it; "unsafe_none" runs harnesses with rlimits only.
    isolation: Literal["auto", "bwrap", "unsafe_none"] = "auto"


class EvalConfig(_Strict):
    test_samples: int = Field(8, gt=0)  # mean@8
    val_samples: int = Field(4, gt=0)


class WhaleConfig(_Strict):
    domain: str = "math_reasoning"
    condition: str = "whale"
    E: float = Field(0.6, description="weight-phase budget per cycle, in epochs of D_weight")
    I: int = Field(6, description="harness-phase budget per cycle, in iterations (1 = evaluate the incoming harness)")
    cycles: int = Field(3, gt=0)
    seed: int = 0
    run_dir: Path = Path("runs/default")
    harness: Optional[Path] = None  # starting h0; None takes the domain's own
    data: DataConfig = Field(default_factory=DataConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    weight: WeightPhaseConfig = Field(default_factory=WeightPhaseConfig)
    harness_phase: HarnessPhaseConfig = Field(default_factory=HarnessPhaseConfig)
    adaptive: AdaptiveConfig = Field(default_factory=AdaptiveConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("E")
    @classmethod
    def _positive_e(cls, v: float) -> float:
        if v <= 0:
            raise ValueError(f"E must be a positive number of epochs, got {v}")
        return v

    @field_validator("I")
    @classmethod
    def _positive_i(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"I must be a positive number of iterations, got {v}")
        return v

    @field_validator("condition")
    @classmethod
    def _known_condition(cls, v: str) -> str:
        if v not in CONDITIONS:
            raise ValueError(f"unknown condition {v!r}; choose one of {', '.join(CONDITIONS)}")
        return v

    @field_validator("domain")
    @classmethod
    def _known_domain(cls, v: str) -> str:
        from whale_ray.domain import DOMAIN_NAMES

        if v not in DOMAIN_NAMES:
            raise ValueError(f"unknown domain {v!r}; choose one of {', '.join(DOMAIN_NAMES)}")
        return v


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"config key {dotted!r}: {p!r} is not a section")
    tree[leaf] = value


def _describe(err: ValidationError, origin: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    msg = first["msg"].removeprefix("Value error, ")
    return f"{origin}: {where}: {msg}" + (f" (got {first['input']!r})" if first["type"] == "extra_forbidden" else "")


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> WhaleConfig:
    """Values from the YAML file at `path`, then `overrides` (dotted keys, as from the CLI) on top."""
    tree: dict[str, Any] = {}
    origin = "config"
    if path is not None:
        origin = str(path)
        if not Path(path).is_file():
            raise ConfigError(f"config file {path}: not found")
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({e.__class__.__name__})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping, got {type(loaded).__name__}")
        tree = loaded or {}
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    try:
        return WhaleConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e, origin)) from None


def dump_config(cfg: WhaleConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

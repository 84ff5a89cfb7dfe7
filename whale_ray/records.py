"""The records every part of whale-ray exchanges: tasks, model calls, episodes, rollout tables."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

# The fixed set of episode statuses. Anything but "ok" scores 0.
STATUSES = (
    "ok",  # the harness returned an answer (which may still be wrong)
    "timeout",  # wall-clock deadline hit; the whole process group was killed
    "memory_limit",  # address-space limit hit (MemoryError or killed)
    "output_limit",  # captured output or RPC traffic over its cap
    "protocol_error",  # the child broke the RPC protocol
    "harness_exception",  # the harness raised
    "sandbox_setup_error",  # the sandbox could not be started
    "crashed",  # the child died without a result (signal, exit code)
    "sandbox_error",  # the trusted side failed on this episode (a host bug); the traceback is in the reason
)


@dataclass(frozen=True)
class Task:
    """One problem. `answer` is the gold answer: it never leaves the trusted process."""

    id: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        """What the harness may see: everything but the gold answer and private meta (keys starting with '_')."""
        public_meta = {k: v for k, v in self.meta.items() if not k.startswith("_")}
        return {"id": self.id, "question": self.question, **public_meta}


@dataclass(frozen=True)
class EpisodeJob:
    """One episode to run: the evaluator is trusted; only task.public() enters the sandbox."""

    task: Task
    seed: int


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0  # alternatives per token to report (the OpenAI endpoint's top_logprobs); 0 = none


@dataclass
class ModelCall:
    """One call to the policy, recorded on the trusted side with exact token ids."""

    messages: list[dict[str, str]]
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str  # "stop" | "length"


@dataclass
class EpisodeResult:
    status: str
    reason: str
    answer: str | None
    calls: list[ModelCall]
    events: list[dict[str, Any]]  # the harness's own trace: tool calls, observations, notes
    wall_s: float
    # Every host/episode tool call as the trusted side saw it: {"name", "args", "output"} or {..., "error"}
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # The kernel's count of the episode's memory at its peak (its cgroup's); None without the cgroup layer
    peak_memory_bytes: int | None = None
    node: str = ""  # the Ray node id of the evaluator that ran it
    # Seconds of wall_s: "start" (until the sandbox's runtime said hello), "model" and "tools" (in the host's
    # callbacks), "teardown" (after the harness ended); the rest is the harness's own. Empty: it never started.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        return len(self.calls)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown episode status {self.status!r}; expected one of {STATUSES}")


@dataclass
class Rollout:
    """One scored episode, as stored in rollouts/*.parquet."""

    phase: str  # "weight" | "harness" | "val" | "test" | "validate"
    cycle: int
    harness_id: str
    task_id: str
    sample: int
    seed: int
    weight_version: int
    status: str
    reason: str
    reward: float
    answer: str | None
    turns: int
    truncated: bool  # the harness ran out of its turn budget without an answer
    prompt_tokens: int
    completion_tokens: int
    wall_s: float
    calls: list[dict[str, Any]]  # ModelCall fields without messages
    trace: str  # JSON: messages, events and tool calls, for the archive and the proposer
    metrics: dict[str, float] = field(default_factory=dict)  # the domain's per-episode metrics (retrieval_hit...)
    node: str = ""  # the Ray node it ran on
    timings: dict[str, float] = field(default_factory=dict)  # EpisodeResult.timings
    # The episode's model calls whole, each one record from the sandbox (messages, completion and token ids
    # together): what the weight phase trains on. Not stored: `calls` and `trace` are its columns on disk.
    model_calls: list[ModelCall] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def from_episode(
        cls, ep: EpisodeResult, *, phase: str, cycle: int, harness_id: str, task: Task, sample: int,
        seed: int, weight_version: int, reward: float, metrics: dict[str, float] | None = None,
    ) -> "Rollout":
        calls = [
            {
                "prompt_ids": c.prompt_ids,
                "completion_ids": c.completion_ids,
                "logprobs": c.logprobs,
                "weight_version": c.weight_version,
                "finish_reason": c.finish_reason,
            }
            for c in ep.calls
        ]
        trace = {
            "task": task.public(),
            "calls": [{"messages": c.messages, "completion": c.text, "finish_reason": c.finish_reason} for c in ep.calls],
            "events": ep.events,
            "tool_calls": ep.tool_calls,
            "answer": ep.answer,
            "status": ep.status,
            "reason": ep.reason,
        }
        return cls(
            phase=phase, cycle=cycle, harness_id=harness_id, task_id=task.id, sample=sample, seed=seed,
            weight_version=weight_version, status=ep.status, reason=ep.reason, reward=reward, answer=ep.answer,
            turns=ep.turns, truncated=any(e.get("type") == "turn_budget_exhausted" for e in ep.events),
            prompt_tokens=sum(len(c.prompt_ids) for c in ep.calls),
            completion_tokens=sum(len(c.completion_ids) for c in ep.calls),
            wall_s=ep.wall_s, calls=calls, trace=json.dumps(trace), metrics=dict(metrics or {}), node=ep.node,
            timings=dict(ep.timings), model_calls=list(ep.calls),
        )


CALL_TYPE = pa.struct(
    [
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),
        ("weight_version", pa.int32()),
        ("finish_reason", pa.string()),
    ]
)

ROLLOUT_SCHEMA = pa.schema(
    [
        ("phase", pa.string()),
        ("cycle", pa.int32()),
        ("harness_id", pa.string()),
        ("task_id", pa.string()),
        ("sample", pa.int32()),
        ("seed", pa.int64()),
        ("weight_version", pa.int32()),
        ("status", pa.string()),
        ("reason", pa.string()),
        ("reward", pa.float32()),
        ("answer", pa.string()),
        ("turns", pa.int32()),
        ("truncated", pa.bool_()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("wall_s", pa.float32()),
        ("calls", pa.list_(CALL_TYPE)),
        ("trace", pa.string()),
        ("metrics", pa.map_(pa.string(), pa.float32())),
        ("node", pa.string()),
        ("timings", pa.map_(pa.string(), pa.float32())),
    ]
)


def rollouts_to_table(rollouts: list[Rollout]) -> pa.Table:
    return pa.Table.from_pylist([{name: getattr(r, name) for name in ROLLOUT_SCHEMA.names} for r in rollouts],
                                schema=ROLLOUT_SCHEMA)

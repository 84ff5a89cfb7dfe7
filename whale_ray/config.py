"""One typed config for a run: YAML file values, overridden by command-line flags.

The core's sections are the models below. A domain's own sections (search_qa: `retrieval`, `judge`) are
written at the top level of the YAML too; the registry names the domain's model (`Domain.config_model`),
which validates them, and `cfg.domain_config` holds them. A section of another domain is an error naming
the key and the domain it belongs to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from whale_ray.domain import DomainConfig, get_domain, section_owner
from whale_ray.policy.engine_registry import ENGINE_NAMES
from whale_ray.resources import ResourcesConfig, storage_root
from whale_ray.sandbox.limits import SandboxLimits

CONDITIONS = ("rsft_only", "mh_only", "whale", "adaptive_whale", "stagewise")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Strict):
    source: Literal["generated", "files"] = "generated"
    # D_weight, D_harness and D_val come from train_path, D_test from test_paths, in the domain's public
    # format: math DAPO-Math-17K parquet / AIME parquet or JSONL; search_qa Search-R1 parquet; chess Lichess CSV
    train_path: Optional[Path] = None
    test_paths: list[Path] = Field(default_factory=list)
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
    # a local Hugging Face checkpoint directory, or a hub id ("Qwen/Qwen3-1.7B") the local hub cache holds; None builds
    # the embedded tiny policy
    model: Optional[Path] = None
    engine: Literal[ENGINE_NAMES] = "transformers"  # the registry's names (whale_ray/policy/engine_registry.py)
    max_batch: int = Field(64, gt=0)
    batch_wait_ms: float = Field(5.0, ge=0)  # batching "pass" only: how long a pass waits for company
    # continuous: requests join the engine's running batch at its next step and leave it as they finish (both
    # engines); pass: concurrent calls are gathered into one generate pass at a time (a baseline that
    # benchmarks/serve_throughput.py measures continuous batching against)
    batching: Literal["continuous", "pass"] = "continuous"
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    warmstart_steps: int = Field(1200, ge=0)
    # PolicyServer replicas (each with resources.policy_server): every evaluator sends each model call to the one
    # it has the fewest calls waiting on, and every new weight version reaches all of them before the next rollouts
    replicas: int = Field(1, gt=0)
    # vllm only: the share of the GPU's memory vLLM takes (weights, activations, KV cache), so that a Trainer on
    # the same GPU has the rest; the transformers engine allocates as it goes.
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    # vllm only: vLLM's sleep mode during each Trainer step of the weight phase, so the Trainer on the same GPU
    # gets vLLM's memory back. 1: weights copied to CPU and KV cache dropped; 2: both dropped (the step's new
    # weights are loaded right after it anyway; a step that did not train reloads the Trainer's current ones).
    # 0: off (the two share the GPU by gpu_memory_utilization alone).
    sleep_level: Literal[0, 1, 2] = 0

    @field_validator("model")
    @classmethod
    def _hub_snapshot(cls, model: Optional[Path]) -> Optional[Path]:
        """A hub id becomes its cached snapshot here, where every command's config is made, so that the run's
        config.yaml records the snapshot: it names the model (models--ORG--NAME) and pins its revision, so a resumed
        run finds the same weights, and a cache moved on to a newer revision is a config conflict, not a silent
        switch. An id the cache lacks stays as it is, for check_checkpoint to refuse in one line."""
        from whale_ray.hub import resolve_model

        return resolve_model(model) if model is not None else None

    def engine_options(self) -> dict[str, float]:
        """The engine's own keyword arguments beyond device and dtype (PolicyServer -> make_engine)."""
        if self.engine != "vllm":
            return {}
        return {"gpu_memory_utilization": self.gpu_memory_utilization, "sleep_level": self.sleep_level}


class WeightBroadcastConfig(_Strict):
    """`weight.weight_sync: broadcast`: the group of the Trainer's rank 0 and the PolicyServer replicas
    (whale_ray/policy/weight_broadcast.py, actors/broadcast_sync.py)."""

    # A member that does not take its part within this fails the broadcast, named; that version then reaches the
    # replicas through the object store and the next one rebuilds the group.
    timeout_s: float = Field(60.0, gt=0)
    bucket_mb: int = Field(512, gt=0)  # one broadcast per bucket: a few large ones, not one per tensor
    port: int = Field(0, ge=0, le=65535)  # the group's TCPStore, on the Coordinator's node; 0: any free port


class WeightPhaseConfig(_Strict):
    # Sampling (temperature, top-k) is the harness' to decide: it is part of the agent being optimised.
    samples_per_prompt: int = Field(8, gt=0)  # k
    prompts_per_step: int = Field(16, gt=0)
    # The optimiser's settings: None ("auto") leaves each to the run, which chooses it from the checkpoint (its size,
    # or the embedded policy) and use_gpu when it starts (whale_ray/rsft_defaults.py) and writes the choice into the
    # run directory's config.yaml; a resumed run keeps what its config.yaml holds.
    learning_rate: Optional[float] = Field(None, gt=0)
    warmup_steps: Optional[int] = Field(None, ge=0)  # the run's first N optimizer updates ramp the rate up linearly
    max_grad_norm: Optional[float] = Field(None, gt=0)  # the gradient's global norm is clipped to this
    # bfloat16: the forward and backward passes under bf16 autocast; weights and AdamW state stay float32, so an
    # update far below bf16's resolution of a weight (lr 1e-6) is not rounded away
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    micro_batch: int = Field(32, gt=0)
    sft_epochs_per_step: int = Field(1, gt=0)
    num_workers: int = Field(1, gt=0)  # Ray Train workers
    use_gpu: bool = False
    # Checkpoint (and put on record) every N trained steps and at the phase's end; a relaunch redoes the steps
    # after the last checkpoint with the same prompts and seeds.
    checkpoint_every: int = Field(1, gt=0)
    # End the Ray Train run after every weight phase, freeing its workers' CPUs/GPUs for the harness phase, at the
    # price of a new run (seconds: processes, the model, a process group) in the next cycle. Off by default: the
    # workers need no more memory across the harness phase than they held beside the engine during the rollouts.
    release_workers: bool = False
    # 1: the next step's rollouts run on the weights the servers hold while the Trainer takes the current step, so a
    # step trains on samples one version old (every trained call's version is in its train/ record). The engine
    # stays awake through the step (no sleep), so it and the Trainer must fit side by side. 0: on-policy, each
    # step's rollouts from the weights it trains. A PolicyServer that Ray restarts during such a step gets the
    # version on record from the object_store sync's last ref; under cuda_ipc or broadcast the Trainer's weights
    # have moved on, and the run goes back to its last commit.
    max_staleness: int = Field(0, ge=0, le=1)
    # How new weights reach the PolicyServer. object_store: a CPU state dict through the object store.
    # cuda_ipc (when training on a GPU; CPU training keeps the object store): CUDA IPC handles of the Trainer's
    # parameters themselves, copied GPU to GPU by a server on the same host; one on another host fetches them
    # through the object store once. Nothing passes through host memory and per version the only copy is the
    # engine's own (docs/performance.md); opt-in until it has run on more than one machine kind.
    # broadcast: the Trainer's rank-0 worker sends them to every replica over a process group of their own (gloo
    # when training on CPU, nccl on GPU), in flat buckets (`broadcast`); not yet run on several GPUs.
    weight_sync: Literal["object_store", "cuda_ipc", "broadcast"] = "object_store"
    broadcast: WeightBroadcastConfig = Field(default_factory=WeightBroadcastConfig)

    @property
    def sync_mode(self) -> str:
        """The weight_sync in effect: cuda_ipc shares GPU memory, so training on CPU keeps the object store."""
        return "object_store" if self.weight_sync == "cuda_ipc" and not self.use_gpu else self.weight_sync




class ModelPrice(_Strict):
    """What a proposer model costs, in USD per 1M tokens."""

    prompt: float = Field(0.0, ge=0)  # prompt tokens not served from the provider's cache
    completion: float = Field(0.0, ge=0)
    cached: Optional[float] = Field(None, ge=0)  # cached prompt tokens; None: the prompt price


class LLMProposerConfig(_Strict):
    """The built-in proposer agent loop (`harness_phase.proposer: llm`) over `harness_phase.endpoint`."""

    max_turns: int = Field(40, gt=0)  # model calls per session
    max_output_tokens: int = Field(8192, gt=0)  # per reply
    temperature: Optional[float] = Field(None, ge=0)  # None: the server's default
    read_max_chars: int = Field(20000, gt=0)  # per tool result
    context_max_chars: int = Field(600_000, gt=0)  # past this, the oldest tool results are elided
    nudges: int = Field(2, ge=0)  # replies without a tool call that get a reminder before the session ends
    retry_backoff_s: float = Field(2.0, ge=0)  # first wait after a 429, 5xx or timeout; doubles per attempt
    retry_max_backoff_s: float = Field(60.0, ge=0)
    # the request field for the reply cap: OpenAI's current name, or the older one some servers still want
    max_tokens_param: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens"


class AgentCLIConfig(_Strict):
    """An external coding agent as proposer (`harness_phase.proposer: agent-cli`), run in a bubblewrap jail
    where only its workspace is writable and the archive is mounted read-only at /archive."""

    # argv; each item may hold {prompt} {prompt_file} {workspace} {archive} {n} {iteration} {model}
    command: list[str] = Field(default_factory=list)
    timeout_s: float = Field(1800.0, gt=0)
    network: bool = True  # a real CLI agent needs its API; False cuts the jail off every network
    path: str = "/usr/local/bin:/usr/bin:/bin"  # PATH inside the jail
    env_allow: list[str] = Field(default_factory=lambda: [
        "LANG", "LC_ALL", "TERM", "TZ", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
        "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "NODE_EXTRA_CA_CERTS"])  # host variables passed through
    env: dict[str, str] = Field(default_factory=dict)  # fixed extra variables (never secrets: config is logged)
    ro_binds: list[str] = Field(default_factory=list)  # host paths bound read-only in place (the agent's install)
    etc_files: list[str] = Field(default_factory=lambda: [
        "/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates",
        "/etc/pki", "/etc/passwd", "/etc/group", "/etc/localtime", "/etc/alternatives"])
    max_file_bytes: int = Field(256 * 1024, gt=0)  # a candidate file larger than this is rejected


class HarnessPhaseConfig(_Strict):
    candidates_per_iteration: int = Field(3, gt=0)  # M
    proposer: Literal["offline", "llm", "agent-cli"] = "offline"  # = proposers.registry.PROPOSER_KINDS (tested)
    rollouts_per_example: int = Field(1, gt=0)
    noise_margin: float = Field(0.0, ge=0)
    # offline: "archive" never re-proposes code any candidate had; "weight_version" may re-propose code that
    # was only scored under older weights (a harness that lost under old weights may win under new ones)
    offline_dedupe: Literal["archive", "weight_version"] = "archive"
    # The proposer's endpoint: llm talks to it; agent-cli gets `model` as {model} and the key named by api_key_env.
    endpoint: "EndpointConfig" = Field(default_factory=lambda: EndpointConfig())
    llm: LLMProposerConfig = Field(default_factory=LLMProposerConfig)
    agent_cli: AgentCLIConfig = Field(default_factory=AgentCLIConfig)
    prices: dict[str, ModelPrice] = Field(default_factory=dict)  # model name -> USD per 1M tokens
    # Hard caps on the proposer ledger, per run: reaching one ends the harness phase (state saved).
    max_proposer_tokens: Optional[int] = Field(None, gt=0)  # prompt + completion tokens
    max_proposer_cost_usd: Optional[float] = Field(None, gt=0)
    max_proposer_wall_s: Optional[float] = Field(None, gt=0)

    @model_validator(mode="after")
    def _proposer_ready(self) -> "HarnessPhaseConfig":
        if self.proposer == "llm":
            if not self.endpoint.model:
                raise ValueError("harness_phase.proposer 'llm' needs harness_phase.endpoint.model (--proposer-model)")
            if self.max_proposer_cost_usd is not None and self.endpoint.model not in self.prices:
                raise ValueError(f"harness_phase.max_proposer_cost_usd needs a price for model "
                                 f"{self.endpoint.model!r} in harness_phase.prices")
        if self.proposer == "agent-cli" and not self.agent_cli.command:
            raise ValueError("harness_phase.proposer 'agent-cli' needs harness_phase.agent_cli.command")
        return self


class AdaptiveConfig(_Strict):
    weight_min_epochs: float = Field(0.2, gt=0)
    weight_window: int = Field(3, gt=0)  # steps in the sliding window of training reward
    weight_max_epochs: float = Field(2.0, gt=0)
    harness_min_iterations: int = Field(5, gt=0)
    harness_patience: int = Field(2, gt=0)
    harness_max_iterations: int = Field(15, gt=0)


_LIMITS = SandboxLimits()  # the per-episode limits' defaults live in the sandbox


class EvaluatorRange(_Strict):
    """An elastic pool's bounds: it grows into free resources (new nodes included) up to `max`."""

    min: int = Field(1, gt=0)
    max: int = Field(64, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "EvaluatorRange":
        if self.min > self.max:
            raise ValueError(f"sandbox.evaluators: min {self.min} > max {self.max}")
        return self


# One evaluator process per this many of the cluster's CPUs (sandbox.evaluators "cores"). An episode waits on the
# model most of its time, so episodes in flight are what fill the engine's batches, and a few processes share the
# host side's work (episode threads under one GIL, the sandboxes' pipes) better than one (docs/performance.md,
# "Sandbox pool on the H200's host"); 2- and 4-core machines keep the single evaluator of 16 slots.
CORES_PER_EVALUATOR = 4


class SandboxConfig(_Strict):
    slots: int = Field(16, gt=0)  # concurrent episodes per evaluator
    # A count, or "cores" (a count from the cluster's CPUs when the pool starts: one per CORES_PER_EVALUATOR, at
    # least one; a sweep's trials, which share the cores, take one each): kept, a lost evaluator is replaced.
    # "auto" (= {min: 1, max: 64}) or {min, max}: elastic, sized to the cluster's free resources while a phase
    # runs, following nodes as they join and leave.
    evaluators: int | Literal["auto", "cores"] | EvaluatorRange = "cores"
    chunk: Optional[int] = Field(None, gt=0)  # episodes per pull; None: a quarter of `slots`
    # Losses of an episode with its evaluator, on a node that stayed up, before it counts as a sandbox error (an
    # episode that kills its evaluator must not kill them all); a loss with its node is not counted.
    episode_retries: int = Field(1, ge=0)

    def pool_bounds(self, cpus: float | None = None) -> tuple[int, int, bool]:
        """(min, max, elastic) of the evaluator pool; `cpus`: the cluster's, which "cores" is counted from."""
        e = self.evaluators
        if e == "cores":
            if cpus is None:
                raise ValueError("sandbox.evaluators 'cores' is counted from the cluster's CPUs, which were not given")
            e = max(1, int(cpus // CORES_PER_EVALUATOR))
        if isinstance(e, int):
            return e, e, False
        r = EvaluatorRange() if e == "auto" else e
        return r.min, r.max, True

    @field_validator("evaluators")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v <= 0:
            raise ValueError(f"needs at least one evaluator, got {v}")
        return v
    wall_s: float = Field(_LIMITS.wall_s, gt=0)
    memory_mb: int = Field(_LIMITS.memory_mb, gt=0)
    max_processes: int = Field(_LIMITS.max_processes, gt=0)
    max_output_bytes: int = Field(_LIMITS.max_output_bytes, gt=0)
    max_rpc_calls: int = Field(_LIMITS.max_rpc_calls, gt=0)
    max_message_bytes: int = Field(_LIMITS.max_message_bytes, gt=0)
    # "auto" uses bubblewrap and refuses to run without it; "unsafe_none" runs harnesses with rlimits only.
    isolation: Literal["auto", "bwrap", "unsafe_none"] = _LIMITS.isolation


class FaultsConfig(_Strict):
    """How a run rides out dead actors (actors/coordinator.py). The PolicyServer, the Trainer and the Retriever
    are restarted by Ray up to `actor_restarts` times each, their calls in flight retried; any other fault
    rolls the run back to its last commit and goes on in the same launch, at most `max_recoveries` times."""

    actor_restarts: int = Field(5, ge=-1)  # -1: without limit
    max_recoveries: int = Field(5, ge=0)
    poll_s: float = Field(1.0, gt=0)  # how often the pool and the monitor look at the cluster


class EndpointConfig(_Strict):
    """An OpenAI-compatible endpoint (the LLM proposer, a judge). The key is read from the environment
    variable named by `api_key_env` in the trusted process only; it never enters a config file or a sandbox."""

    model: Optional[str] = None
    base_url: Optional[str] = None
    api_key_env: str = "OPENAI_API_KEY"
    timeout_s: float = Field(60.0, gt=0)
    max_retries: int = Field(4, ge=0)


# Keys that configs written for an earlier whale-ray hold and ServeConfig does not: each with what to write instead,
# which the error naming the key says
SERVE_KEYS_GONE = {
    "engine_layout": "serve.preset chooses where the engine runs (cpu: in each replica's process; gpu: one engine "
                     "actor behind every replica)",
    "ingress": "serve.preset chooses how requests reach the replicas (cpu: Serve's proxy; gpu: Serve's HAProxy)",
    "user_code_thread": "the handlers always run on Serve's main event loop; remove the key",
    "access_log": "Serve's per-request access log is off in both presets; remove the key",
    "replica_cpus": "serve.engine_cpus holds it",
    "replica_gpus": "serve.engine_gpus holds it",
}


class ServeConfig(_Strict):
    """The live OpenAI-compatible endpoint (whale_ray/serve/): `whale serve`, or `whale run --serve` for the
    whole run. It follows the run directory's checkpoints; it is no part of the run's identity (a relaunch
    may turn it on or off)."""

    enabled: bool = False  # whale run --serve
    # How the endpoint is put together, for the engine it serves (whale_ray/serve/app.py, engines.py). cpu: each
    # replica runs its engine in its own process behind Serve's proxy; the engine shares the cores with the HTTP
    # path, and a second process and a hop between them would cost those cores more than the GIL they free. gpu:
    # one engine actor holds the GPU and the weights once, fed by every replica over a socket each, behind Serve's
    # HAProxy; the replicas are front ends (each with its own event loop and HTTP server), so the Python around
    # the requests runs beside the engine's, not under its GIL (the layout of vLLM's --api-server-count).
    preset: Literal["cpu", "gpu"] = "cpu"
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)  # preset gpu: HAProxy's; the replicas' own servers take the ports above
    replicas: int = Field(1, gt=0)  # fixed replica count, unless min_replicas and max_replicas are both set
    min_replicas: Optional[int] = Field(None, ge=0)  # Serve autoscaling bounds
    max_replicas: Optional[int] = Field(None, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)  # autoscaling: how long the load must last before a replica is added
    # Ray CPUs and GPUs of an engine (and its torch threads): each replica's (preset cpu), or the one engine actor's
    # (preset gpu; the replicas then hold none). engine_gpus None: none for cpu, one whole GPU for gpu.
    engine_cpus: float = Field(1.0, ge=0)
    engine_gpus: Optional[float] = Field(None, ge=0)
    max_concurrent: int = Field(64, gt=0)  # requests in flight per replica; more get 429 with Retry-After
    api_key_env: Optional[str] = None  # NAME of the variable holding the key clients must send; None = no key
    poll_s: float = Field(0.5, gt=0)  # how often each replica looks at the run directory for new weights

    @model_validator(mode="before")
    @classmethod
    def _no_keys_gone(cls, data: Any) -> Any:
        for key in SERVE_KEYS_GONE:
            if isinstance(data, dict) and key in data:
                raise ValueError(f"{key} is no longer a setting: {SERVE_KEYS_GONE[key]}")
        return data

    @property
    def gpus_per_engine(self) -> float:
        """engine_gpus, or the preset's when unset."""
        if self.engine_gpus is not None:
            return self.engine_gpus
        return 1.0 if self.preset == "gpu" else 0.0


class MlflowTrackingConfig(_Strict):
    # any MLflow tracking URI; None: $MLFLOW_TRACKING_URI, else a SQLite store beside the run directory
    # (<run_dir>/../mlflow.db, so a sweep's or a study's trials share <root>/mlflow.db)
    uri: Optional[str] = None
    experiment: Optional[str] = None  # None: "whale" for a run, whale-sweep-<root> / whale-study-<root> for trials


class TensorBoardTrackingConfig(_Strict):
    log_dir: Optional[Path] = None  # None: <run_dir>/tensorboard


class WandbTrackingConfig(_Strict):
    project: str = "whale-ray"  # offline: written under <run_dir>/wandb, for `wandb sync` later


TRACKER_SECTIONS = {"mlflow": MlflowTrackingConfig, "tensorboard": TensorBoardTrackingConfig, "wandb": WandbTrackingConfig}


class TrackingConfig(_Strict):
    """Where a run is mirrored as it goes (whale_ray/tracking/): a tracker is on when its section is given (`mlflow:
    {}` for the defaults; `whale run --track mlflow,tensorboard`). The run directory stays the truth; a tracker
    that fails or does not answer within `timeout_s` is named in one warning and dropped for the launch."""

    mlflow: Optional[MlflowTrackingConfig] = None
    tensorboard: Optional[TensorBoardTrackingConfig] = None
    wandb: Optional[WandbTrackingConfig] = None
    poll_s: float = Field(2.0, gt=0)  # how often the run directory is read for new steps, iterations and cycles
    timeout_s: float = Field(30.0, gt=0)

    def enabled(self) -> list[str]:
        return [name for name in TRACKER_SECTIONS if getattr(self, name) is not None]

    def turned_on(self, names: list[str], mlflow_uri: Optional[str] = None) -> "TrackingConfig":
        """This section with the named trackers on (`--track`), their sections kept where given, and `--mlflow-uri`."""
        out = self.model_copy(deep=True)
        for name in [*names, *(["mlflow"] if mlflow_uri else [])]:
            if getattr(out, name) is None:
                setattr(out, name, TRACKER_SECTIONS[name]())
        if mlflow_uri:
            out.mlflow.uri = mlflow_uri
        return out


def with_trackers(tree: dict[str, Any], names: list[str], mlflow_uri: Optional[str]) -> dict[str, Any]:
    """A config tree (a sweep's or a study's base) with `--track` and `--mlflow-uri` applied to its tracking section."""
    if not names and not mlflow_uri:
        return tree
    section = TrackingConfig.model_validate(tree.get("tracking") or {}).turned_on(names, mlflow_uri)
    return {**tree, "tracking": section.model_dump(mode="json", exclude_none=True)}


class EvalConfig(_Strict):
    test_samples: int = Field(8, gt=0)  # mean@8
    val_samples: int = Field(4, gt=0)
    # A cycle's D_val and D_test evaluations run beside the next pool call made under the weights the cycle ended
    # with (its episodes join that call's), or while a proposer session runs; the rows are the same as with false,
    # where they run alone at the cycle's end (whale_ray/loop/report.py).
    overlap: bool = True


# 1: before the domain plug-ins (retrieval/judge written for every domain); 2: a domain's sections only for it;
# 3: weight.warmup_steps, max_grad_norm and precision, and the optimiser's settings chosen by the run when unset;
# 4: serve.preset in place of the endpoint's layout, ingress and flags; serve.engine_cpus and engine_gpus
CONFIG_VERSION = 5


class WhaleConfig(_Strict):
    config_version: int = CONFIG_VERSION  # of the keys' layout; a run directory's older config.yaml is upgraded
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
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)  # each role's Ray resources (resources.py)
    serve: ServeConfig = Field(default_factory=ServeConfig)  # the live endpoint (whale run --serve)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)  # MLflow, TensorBoard, W&B (off by default)
    # Where the run directory (when run_dir is relative) and the embedded-policy cache live: a path that every
    # node mounts, or a file:// URI; None: run_dir as given and $WHALE_CACHE (or ~/.cache/whale-ray).
    storage: Optional[str] = None
    # The domain's own sections, validated by its `config_model` (see the module's docstring).
    domain_config: SerializeAsAny[DomainConfig] = Field(default_factory=DomainConfig)

    @model_validator(mode="before")
    @classmethod
    def _domain_sections(cls, data: Any) -> Any:
        """Moves the domain's top-level sections into `domain_config`, validated by the domain's model."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        try:
            domain = get_domain(data.get("domain", cls.model_fields["domain"].default))
        except ValueError:
            return data  # the `domain` field's own check names the problem
        given = data.pop("domain_config", None)
        sections = given.model_dump() if isinstance(given, BaseModel) else dict(given or {})
        for key in list(data):
            if key in domain.config_model.model_fields:
                sections[key] = data.pop(key)
            elif key not in cls.model_fields and (owner := section_owner(key)) is not None:
                raise ValueError(f"config key {key!r} belongs to domain {owner!r}, not to this run's domain "
                                 f"{domain.name!r} (set domain: {owner}, or remove the {key} section)")
        try:
            data["domain_config"] = domain.config_model.model_validate(sections)
        except ValidationError as e:
            raise ValueError(_first_error(e)) from None
        return data

    @model_serializer(mode="wrap")
    def _flat(self, handler: Any) -> dict[str, Any]:
        """The domain's sections back at the top level, as the YAML has them."""
        out = handler(self)
        out.update(out.pop("domain_config", None) or {})
        return out

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

    @field_validator("storage")
    @classmethod
    def _usable_storage(cls, v: Optional[str]) -> Optional[str]:
        storage_root(v)  # a ValueError naming the URI and what is wrong
        return v

    @field_validator("domain")
    @classmethod
    def _known_domain(cls, v: str) -> str:
        get_domain(v)  # a ValueError naming the choices
        return v


def dotted_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config tree as {"section.key": value}, the shape of CLI overrides (an empty section is a value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
        if not isinstance(tree, dict):
            raise ConfigError(f"config key {dotted!r}: {p!r} is not a section")
    tree[leaf] = value


def _first_error(err: ValidationError) -> str:
    """The first error as "dotted.key: problem" (the key as the YAML spells it)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    return (f"{loc}: " if loc else "") + msg + (f" (got {first['input']!r})" if first["type"] == "extra_forbidden" else "")


def _describe(err: ValidationError, origin: str) -> str:
    return f"{origin}: {_first_error(err)}"


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """The mapping a YAML file holds (empty for an empty file); a missing file, bad YAML or another top level is a
    ConfigError naming `what` ("config file", "sweep file") and the path."""
    if not Path(path).is_file():
        raise ConfigError(f"{what} {path}: not found")
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path}: not valid YAML ({e.__class__.__name__})") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path}: the top level must be a mapping, got {type(loaded).__name__}")
    return loaded or {}


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> WhaleConfig:
    """Values from the YAML file at `path`, then `overrides` (dotted keys, as from the CLI) on top."""
    tree: dict[str, Any] = {}
    origin = "config"
    if path is not None:
        origin = str(path)
        tree = read_yaml_mapping(path, "config file")
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(tree, key, value)
    try:
        return WhaleConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_describe(e, origin)) from None


def upgrade_config_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """A config.yaml written by an older whale-ray, in today's layout. Keys added since take their defaults
    when validated; keys that moved or went away are mapped here, one step per version."""
    tree = dict(tree)
    version = tree.get("config_version", 1)
    if version < 2:  # search_qa's sections were written into every run's config.yaml
        try:
            owned = get_domain(tree.get("domain", WhaleConfig.model_fields["domain"].default)).config_model.model_fields
        except ValueError:
            owned = {}
        for key in ("retrieval", "judge"):
            if key not in owned:
                tree.pop(key, None)
    if version < 3:  # the settings every run trained with before they were keys
        weight = tree["weight"] = dict(tree.get("weight") or {})
        for key, value in {"learning_rate": 3e-4, "warmup_steps": 0, "max_grad_norm": 1.0, "precision": "float32"}.items():
            weight.setdefault(key, value)
    if version < 4 and isinstance(tree.get("serve"), dict):  # the endpoint a run recorded, as the preset it matches
        serve = tree["serve"] = dict(tree["serve"])
        layout = serve.pop("engine_layout", None)
        for key in ("ingress", "user_code_thread", "access_log"):
            serve.pop(key, None)
        if layout is not None:
            serve["preset"] = "gpu" if layout == "shared" else "cpu"
        for key in ("cpus", "gpus"):
            if f"replica_{key}" in serve:
                serve[f"engine_{key}"] = serve.pop(f"replica_{key}")
    if version < 5 and isinstance(tree.get("weight"), dict) and tree["weight"].get("release_workers", False) is None:
        weight = tree["weight"] = dict(tree["weight"])  # unset meant: released when training on GPUs
        weight["release_workers"] = bool(weight.get("use_gpu", False))
    tree["config_version"] = CONFIG_VERSION
    return tree


def load_recorded_config(path: Path) -> WhaleConfig:
    """A run directory's config.yaml, whichever whale-ray wrote it."""
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
        return WhaleConfig.model_validate(upgrade_config_tree(tree))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e.__class__.__name__})") from None
    except (OSError, AttributeError) as e:  # unreadable, or not a mapping
        raise ConfigError(f"{path}: cannot be read ({e.__class__.__name__}: {e})") from None
    except ValidationError as e:
        raise ConfigError(_describe(e, str(path))) from None


def dump_config(cfg: WhaleConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)

"""What every domain provides, and how a domain is found by name.

A domain is a Python package that registers one `Domain` on import (`DOMAIN = register_domain(MyDomain())`),
with the same parts everywhere:
  data.py      loaders for the public formats, the offline generator, the splits
  verifier.py  the binary verifier R(x, tau), `verify(task, response)`; runs only in the trusted process
  tools.py     tools the harness may call; stdlib-only, they run inside the sandbox
  h0.py        the deliberately weak base harness
  skill.md     what the proposer may change, what it must not, the harness contract
  __init__.py  the Domain subclass, its config sections (`config_model`), and the registration

Built-in domains are the packages of `domains/` (the config's `domain: math_reasoning` imports
`domains.math_reasoning`); a domain anywhere else is named by its import path (`domain: mylab.chemistry`),
and its `name` is that path, so every process of a run (Ray workers too) finds it the same way.
This module imports nothing of whale_ray.config: the config imports it, to validate the domain's sections.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict

from whale_ray.records import Task

if TYPE_CHECKING:
    from whale_ray.records import EpisodeResult

BUILTIN_PACKAGE = "domains"

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset file or row is missing or malformed. The message names the file (and row) and the problem."""


class DataSpec(Protocol):
    """The config's `data` section as a domain reads it (whale_ray.config.DataConfig)."""

    source: str
    train_path: Path | None
    test_paths: list[Path]
    n_weight: int
    n_harness: int
    n_val: int
    n_test: int


class RunConfig(Protocol):
    """What a domain reads of the run's config (whale_ray.config.WhaleConfig)."""

    seed: int
    data: DataSpec
    domain_config: BaseModel  # this domain's own sections: an instance of its `config_model`


class DomainConfig(BaseModel):
    """Base of a domain's config model: each field is one top-level section of the run's YAML
    (search_qa: `retrieval`, `judge`); unknown keys and bad values are errors naming the key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class AnswerFormat:
    """How a response marks its final answer (what the verifier reads first). The proposer's trace diagnosis
    counts answers without the marker, and its offline edits add the marker to extraction."""

    open: str  # "\\boxed{", "<answer>"
    close: str  # "}", "</answer>"

    def wrap(self, answer: str) -> str:
        return f"{self.open}{answer}{self.close}"

    @property
    def shown(self) -> str:
        """The empty marker as prose shows it: "\\boxed{}"."""
        return self.open + self.close


@dataclass(frozen=True)
class Splits:
    weight: list[Task]
    harness: list[Task]
    val: list[Task]
    test: list[Task]

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for role in ("weight", "harness", "val", "test"):
            tasks = getattr(self, role)
            if not tasks:
                raise DataError(f"split D_{role} is empty")
            for t in tasks:
                key = t.question.strip()
                if seen.get(key, role) != role:
                    raise DataError(f"task {t.id!r} appears in both D_{seen[key]} and D_{role}")
                seen[key] = role

    def sizes(self) -> dict[str, int]:
        return {role: len(getattr(self, role)) for role in ("weight", "harness", "val", "test")}


def split_sizes(data: DataSpec) -> dict[str, int]:
    """The configured size of each split, keyed like the fields of Splits."""
    return {"weight": data.n_weight, "harness": data.n_harness, "val": data.n_val, "test": data.n_test}


def distinct_questions(tasks: Iterable[Task]) -> list[Task]:
    """The first task of each question text, in order."""
    seen: set[str] = set()
    out = []
    for t in tasks:
        if t.question.strip() not in seen:
            seen.add(t.question.strip())
            out.append(t)
    return out


def without_test_questions(train: list[Task], test: list[Task], train_path: Path | None, noun: str) -> list[Task]:
    """`train` without the questions of D_test; how many were dropped is logged."""
    test_questions = {t.question.strip() for t in test}
    clean = [t for t in train if t.question.strip() not in test_questions]
    if len(clean) < len(train):
        log.warning("data file %s: %d %s also in the test files left out of training", train_path,
                    len(train) - len(clean), noun)
    return clean


def stratified_sample(tasks: list[Task], n: int, salt: str, seed: int, group: Callable[[Task], str]) -> list[Task]:
    """`n` tasks spread evenly over their groups (round robin over shuffles seeded by salt, seed and group);
    all of them, in that order, when n >= len(tasks)."""
    by_group: dict[str, list[Task]] = {}
    for t in tasks:
        by_group.setdefault(group(t), []).append(t)
    for name, members in by_group.items():
        random.Random(f"{salt}:{seed}:{name}").shuffle(members)
    picked: list[Task] = []
    queues = [by_group[g] for g in sorted(by_group)]
    depth = 0
    while len(picked) < n and any(depth < len(q) for q in queues):
        picked += [q[depth] for q in queues if depth < len(q)][: n - len(picked)]
        depth += 1
    return picked


def train_splits(train: list[Task], test: list[Task], data: DataSpec, noun: str) -> Splits:
    """D_val, D_harness and D_weight, in that order, from the front of `train` (shuffled, free of D_test)."""
    val = train[: data.n_val]
    harness = train[len(val) : len(val) + data.n_harness]
    weight = train[len(val) + len(harness) : len(val) + len(harness) + data.n_weight]
    if not weight:
        raise DataError(
            f"data file {data.train_path}: {len(train)} usable {noun} are too few; D_val ({data.n_val}) and "
            f"D_harness ({data.n_harness}) are taken first and D_weight needs at least one more"
        )
    return Splits(weight=weight, harness=harness, val=val, test=test)


class Domain(ABC):
    """One domain. Subclasses set the class attributes below and implement `load_splits` and `verify`."""

    name: ClassVar[str]  # a built-in's package name under domains/, else the package's import path
    folder: ClassVar[Path]  # the folder of h0.py, tools.py and skill.md
    # Part of the embedded policy's cache key: bump it when the warm-start conversations change.
    warmstart_version: ClassVar[str]
    # How a final answer is marked; None when the verifier reads the whole response (chess: UCI moves).
    answer_format: ClassVar[AnswerFormat | None] = None
    # The public task field that grades difficulty (math: "steps"), for breakdowns such as `whale calibrate`'s.
    difficulty_field: ClassVar[str | None] = None
    # The domain's own config sections; the default has none.
    config_model: ClassVar[type[DomainConfig]] = DomainConfig
    # The resources roles (`resources.<role>`) of the actors `start_services` starts, one actor each, so that
    # the feasibility check before a run counts them.
    service_roles: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def load_splits(self, data: DataSpec, seed: int) -> Splits:
        """Disjoint D_weight / D_harness / D_val / D_test, from files or the offline generator."""

    @abstractmethod
    def verify(self, task: Task, response: str | None) -> float:
        """1.0 when the final response is accepted for this task, else 0.0."""

    def settings(self, cfg: RunConfig) -> DomainConfig:
        """This domain's sections of the run's config (an instance of `config_model`)."""
        if not isinstance(cfg.domain_config, self.config_model):
            raise TypeError(f"domain {self.name!r}: the config holds {type(cfg.domain_config).__name__}, "
                            f"not {self.config_model.__name__}")
        return cfg.domain_config

    def make_verifier(self, cfg: RunConfig) -> Callable[[Task, str | None], float]:
        """The run's reward function: `verify`, unless the config adds to it (an LLM judge, say)."""
        return self.verify

    def warmstart_conversations(self, n: int, seed: int) -> list[list[dict[str, str]]]:
        """Chat conversations whose assistant turns teach the embedded tiny policy its first skills."""
        raise NotImplementedError(f"domain {self.name!r} has no embedded warm-start data")

    def check_inputs(self, cfg: RunConfig) -> None:
        """Checks the domain's own inputs beyond the splits (a corpus file, say) before a run starts;
        raises DataError naming the input."""

    def start_services(self, cfg: RunConfig, splits: Splits, placement: Any = None) -> dict[str, Any]:
        """Shared trusted services of a run (Ray actor handles: a retriever, say), started once by the
        coordinator and handed to every evaluator. `placement` (whale_ray.resources.Placement) gives each
        service actor its `.options()`; a service should let Ray restart it (`cfg.faults.actor_restarts`)."""
        return {}

    def host_tools(self, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        """Tools that run in the trusted evaluator process, reached from the sandbox over RPC."""
        return {}

    def episode_tools(self, task: Task, services: dict[str, Any]) -> dict[str, Callable[..., str]]:
        """Tools bound to one episode, built per episode in the trusted evaluator. They may read the gold
        answer and private meta and keep state across calls (a chess opponent, say)."""
        return {}

    def episode_metrics(self, task: Task, episode: "EpisodeResult") -> dict[str, float]:
        """Per-episode metrics beside the reward, computed in the trusted process from trusted records
        (`episode.tool_calls` holds every host and episode tool call); reports average them."""
        return {}

    @property
    def h0_path(self) -> Path:
        return self.folder / "h0.py"

    @property
    def sandbox_tools_path(self) -> Path:
        return self.folder / "tools.py"

    @property
    def skill_text(self) -> str:
        return (self.folder / "skill.md").read_text()


# --- the registry ----------------------------------------------------------------------------------------

_REGISTRY: dict[str, Domain] = {}
_MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
D = TypeVar("D", bound=Domain)


def register_domain(domain: D) -> D:
    """Puts `domain` in the registry under its name; a domain package calls it on import."""
    missing = [a for a in ("name", "folder", "warmstart_version") if not hasattr(domain, a)]
    if missing:
        raise TypeError(f"{type(domain).__name__} does not declare {', '.join(missing)}")
    if not isinstance(domain.config_model, type) or not issubclass(domain.config_model, DomainConfig):
        raise TypeError(f"{type(domain).__name__}.config_model must be a subclass of DomainConfig")
    taken = _REGISTRY.get(domain.name)
    if taken is not None and type(taken).__qualname__ != type(domain).__qualname__:
        raise ValueError(f"domain name {domain.name!r} is taken by {type(taken).__qualname__}")
    _REGISTRY[domain.name] = domain
    return domain


def builtin_domain_names() -> list[str]:
    """The packages of domains/, sorted."""
    package = importlib.import_module(BUILTIN_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)


def domain_names() -> list[str]:
    """The built-in domains, then any other domain registered in this process."""
    builtin = builtin_domain_names()
    return builtin + sorted(n for n in _REGISTRY if n not in builtin)


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown domain {name!r}; choose one of {', '.join(builtin_domain_names())}, or give "
                      "the import path of a package that registers a domain")


def get_domain(name: str) -> Domain:
    """The registered domain `name`, importing its package first: domains/<name>, or `name` as a module path."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if not isinstance(name, str) or not _MODULE_PATH.match(name):
        raise _unknown(name)
    module = name if "." in name else f"{BUILTIN_PACKAGE}.{name}"
    try:
        spec = importlib.util.find_spec(module)  # imports the parent packages, not the module
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        raise _unknown(name)
    importlib.import_module(module)
    if name not in _REGISTRY:
        raise ValueError(f"domain {name!r}: importing {module} registers no domain of that name "
                         f"(its __init__ must call whale_ray.domain.register_domain with name = {name!r})")
    return _REGISTRY[name]


def section_owner(key: str) -> str | None:
    """The built-in domain whose config model has the section `key`, if any (for error messages)."""
    for name in builtin_domain_names():
        if key in get_domain(name).config_model.model_fields:
            return name
    return None

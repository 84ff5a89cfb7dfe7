"""What the tests share besides fixtures (those are conftest.py's): the small run config, runs checked end to end,
stand-ins (an OpenAI-compatible server, a run directory that lands checkpoints) and probes. Test modules import
from here, never from conftest.py or from one another (tests/structure/test_import_graph.py holds them to it)."""

from __future__ import annotations

import ast
import functools
import json
import operator
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pyarrow.parquet as pq
import pytest

from tests.run_truth import (
    check_ledger,
    check_selection,
    check_test_isolation,
    guessing_math_harness,
    mean_reward,
    rollout_names,
)
from whale_ray.archive import Archive
from whale_ray.config import WhaleConfig, load_config
from whale_ray.domain import get_domain
from whale_ray.run_state import RunState
from whale_ray.sweep.trial import launches

REPO = Path(__file__).resolve().parents[1]


# --- the tests' small runs and policies -------------------------------------------------------------------------------

# Small enough to run each condition in seconds, large enough that every phase does real work.
SMALL = {
    "cycles": 2, "E": 0.5, "I": 2,
    "data.n_weight": 8, "data.n_harness": 4, "data.n_val": 4, "data.n_test": 4,
    "weight.samples_per_prompt": 2, "weight.prompts_per_step": 2,
    "harness_phase.candidates_per_iteration": 2,
    "eval.test_samples": 2, "eval.val_samples": 1,
    "sandbox.slots": 8, "sandbox.wall_s": 20,
    "adaptive.weight_min_epochs": 0.25, "adaptive.weight_window": 1, "adaptive.weight_max_epochs": 0.75,
    "adaptive.harness_min_iterations": 2, "adaptive.harness_patience": 1, "adaptive.harness_max_iterations": 3,
}


def nested(dotted: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}}: SMALL's dotted keys as a config file's tree."""
    tree: dict = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def load_harness(folder: Path, source: str | None = None) -> dict:
    """A harness loaded the way the sandbox does (from its source text, in a fresh namespace): `source`, else
    the h0.py of the domain `folder`; in process, for unit tests of its functions."""
    namespace: dict = {"__name__": "harness"}
    exec(compile(source or (Path(folder) / "h0.py").read_text(), "h0.py", "exec"), namespace)
    return namespace


def small_config(run_dir: Path, **overrides) -> WhaleConfig:
    values = {**SMALL, "run_dir": str(run_dir), **{k.replace("__", "."): v for k, v in overrides.items()}}
    cfg = load_config(None, values)
    cfg.run_dir = Path(cfg.run_dir).resolve()
    return cfg


@functools.cache
def policy_cache(config: pytest.Config) -> Path:
    """Where the test policies are built: pytest's cache directory (kept between sessions; a build is keyed on
    everything it depends on, like the real cache), or a fresh folder when the cache plugin is off."""
    cache = getattr(config, "cache", None)
    path = cache.mkdir("whale-cache") if cache is not None else Path(tempfile.mkdtemp(prefix="whale-cache-"))
    os.environ["WHALE_CACHE"] = str(path)  # subprocesses (whale run) find the same builds
    return path


def build_test_policy(config: pytest.Config, domain: str) -> str:
    """A small embedded policy of `domain` (60 warm-start steps), built once and cached."""
    from whale_ray.policy.tiny import build_embedded_policy

    return str(build_embedded_policy(get_domain(domain), cache_dir=policy_cache(config), warmstart_steps=60,
                                     seed=0, progress=False))


# --- a run on the Coordinator, checked against its files (run_truth.py) -----------------------------------------------

EXPECTED_PHASES = {
    "rsft_only": ["1:weight", "2:weight"],
    "mh_only": ["1:harness", "2:harness"],
    "whale": ["1:weight", "1:harness", "2:weight", "2:harness"],
    "adaptive_whale": ["1:weight", "1:harness", "2:weight", "2:harness"],
    "stagewise": ["1:weight", "2:weight", "3:harness", "4:harness"],
}


def rollout_rows(run_dir, prefix):
    return [pq.read_table(p) for p in sorted((run_dir / "rollouts").glob(f"{prefix}*.parquet"))]


def study_config(tmp_path, condition: str, domain: str, **more):
    tmp_path.mkdir(parents=True, exist_ok=True)
    overrides = {}
    if domain == "math_reasoning":  # rewards that vary, so that selection and training have choices to get wrong
        seed_harness = tmp_path / "guess.py"
        seed_harness.write_text(guessing_math_harness(get_domain(domain).h0_path.read_text()))
        overrides = {"harness": str(seed_harness), "data__n_val": 8, "data__n_test": 8, "eval__val_samples": 2}
    return small_config(tmp_path / condition, condition=condition, domain=domain, **overrides, **more)


def check_condition_run(cfg, history) -> None:
    condition, domain = cfg.condition, cfg.domain
    state = RunState.load(cfg.run_dir)
    assert state.finished
    assert [p.rsplit(":", 1)[0] for p in state.phases_done] == EXPECTED_PHASES[condition]
    cycles = 4 if condition == "stagewise" else 2
    assert [row.cycle for row in history] == list(range(cycles + 1))  # row 0 is (theta0, h0)

    weight_tables = rollout_rows(cfg.run_dir, "weight-")
    n_weight = sum(t.num_rows for t in weight_tables)
    assert n_weight == state.ledger.weight_rollouts
    archive = Archive(cfg.run_dir / "archive")
    evaluated = archive.candidates(status="evaluated")
    if "weight" in " ".join(EXPECTED_PHASES[condition]):
        assert n_weight > 0
        # every rollout row keeps the exact token ids of every model call
        calls = weight_tables[0].column("calls").to_pylist()
        assert calls[0] and calls[0][0]["prompt_ids"] and calls[0][0]["completion_ids"]
    else:
        assert n_weight == 0 and state.weight_version == 0
    if "harness" in " ".join(EXPECTED_PHASES[condition]):
        assert len(evaluated) >= 2  # the seed and at least one proposal
        assert state.ledger.harness_rollouts > 0
    else:
        assert [c.id for c in archive.candidates()] == ["h0"]
        assert state.ledger.harness_rollouts == 0
    # the test split is reported every cycle, for the pair chosen on val
    for row in history:
        assert 0.0 <= row.test_mean8 <= 1.0
        assert 0.0 <= row.test_metrics["truncation_rate"] <= 1.0
    if domain == "search_qa":  # retrieval accuracy comes from the trusted record of the retriever's outputs
        assert all(0.0 <= row.test_metrics["retrieval_hit"] <= 1.0 for row in history)
    report = json.loads((cfg.run_dir / "state.json").read_text())
    check_selection(cfg.run_dir, report)
    check_ledger(cfg, cfg.run_dir, report)
    check_test_isolation(cfg, cfg.run_dir)
    if domain == "math_reasoning" and condition == "whale":  # the checks above had choices to get wrong
        assert report["weight_version"] > 0
        vals = {mean_reward(cfg.run_dir / "rollouts" / f"{n}.parquet") for n in rollout_names(cfg.run_dir, "val")}
        assert len(vals) > 1, vals


# --- a sweep's or a study's trial launches ----------------------------------------------------------------------------

def starts(run: Path) -> int:
    return sum(e["event"] == "start" for e in launches(run))


def spans(run: Path, killed_at: float | None = None) -> list[tuple[float, float]]:
    """[start, end] of each launch of a trial that ended; a launch killed with the sweep has no end, and counts
    as running until `killed_at` (the time of the kill) when that is given and it started before."""
    out, start = [], None

    def killed() -> None:  # the launch begun at `start` never ended
        if start is not None and killed_at is not None and start < killed_at:
            out.append((start, killed_at))

    for e in launches(run):
        if e["event"] == "start":
            killed()
            start = e["time"]
        elif e["event"] == "end" and start is not None:
            out.append((start, e["time"]))
            start = None
    killed()
    return out


def live_placement_groups() -> set[str] | None:
    """Ids of the placement groups on the cluster this process is connected to that are not removed (None: it is
    connected to none). A group outlives the actor that made it (it belongs to the job): a Ray Train controller
    killed while its workers start leaves its group, and the cleaner Ray Train starts for that case asks the state
    API, which the tests' clusters run without."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return {gid for gid, g in ray.util.placement_group_table().items() if g["state"] != "REMOVED"}


def check_placed(run: Path) -> set[str]:
    """Every actor of every launch ran in that launch's trial placement group; returns the groups."""
    groups = set()
    for e in launches(run):
        if e["event"] == "placed":
            assert "error" not in e and e["group"], e
            assert {"policy_server", "proposer", "evaluator0"} <= set(e["actors"]), e
            assert set(e["actors"].values()) == {e["group"]}, e
            groups.add(e["group"])
    return groups


# --- the math world's expressions -------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(expression: str) -> int:
    """Evaluate an integer + - * expression without eval()."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unexpected node {ast.dump(node)}")

    return ev(ast.parse(expression, mode="eval"))


# --- the sandbox's slot uids on a shared machine ----------------------------------------------------------------------

def slots_held_elsewhere() -> set[int]:
    """Slot uids that another process of this shared machine holds right now (its flock on the slot file):
    their processes are that process's episodes, not leftovers of ours."""
    import fcntl

    from whale_ray.sandbox.uid_pool import UID_POOL

    held = set()
    d = UID_POOL._lock_dir()
    for name in os.listdir(d) if d else []:
        fd = os.open(os.path.join(d, name), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            held.add(int(name))
        finally:
            os.close(fd)
    return held


# --- a followed run directory and the engine in process (serve) -------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """A run directory written the way whale_ray/loop does: checkpoint first, then state.json atomically."""

    def __init__(self, root: Path, base: str):
        from transformers import AutoModelForCausalLM

        self.root, self.base, self.state = root, base, RunState()
        self.model = AutoModelForCausalLM.from_pretrained(base)
        self.state.save(root)

    def land(self, version: int) -> Path:
        """New weights v<version> (the base model, perturbed) on record; older checkpoints pruned."""
        import torch

        from whale_ray.rsft import TOKENIZER_FILES

        torch.manual_seed(version)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * p.std() * torch.randn_like(p))
        path = self.root / "checkpoints" / f"v{version:05d}"
        self.model.save_pretrained(path)
        for name in TOKENIZER_FILES:  # as RSFTLearner.save does
            if (Path(self.base) / name).is_file():
                shutil.copy2(Path(self.base) / name, path / name)
        old = self.state.checkpoint
        self.state.weight_version = self.state.checkpoint_version = version
        self.state.checkpoint = str(path.relative_to(self.root))
        self.state.save(self.root)
        if old:
            shutil.rmtree(self.root / old)
        return path


def in_process(checkpoint: str, version: int, messages=None, prompt=None, **sampling) -> str:
    return generate_in_process(checkpoint, version, messages, prompt, **sampling).text


def generate_in_process(checkpoint: str, version: int, messages=None, prompt=None, **sampling):
    from whale_ray.policy.engine import GenerationRequest
    from whale_ray.policy.transformers_engine import TransformersEngine
    from whale_ray.records import SamplingParams

    engine = TransformersEngine(checkpoint, device="cpu", version=version)
    return engine.generate([GenerationRequest(messages or [], SamplingParams(**sampling), prompt=prompt)])[0]


# --- an OpenAI-compatible server on loopback (the llm proposer's model) -----------------------------------------------

def reply(*calls: tuple[str, Any], content: str | None = None, usage: tuple[int, int, int] | None = (1000, 100, 0),
          raw_arguments: bool = False) -> dict[str, Any]:
    """A chat.completion body: the assistant calls `calls` ((name, arguments) pairs) and/or says `content`."""
    tool_calls = [{"id": f"call_{i}_{name}", "type": "function",
                   "function": {"name": name, "arguments": args if raw_arguments else json.dumps(args)}}
                  for i, (name, args) in enumerate(calls)]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    body: dict[str, Any] = {"id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "scripted",
                            "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if tool_calls else "stop"}]}
    if usage is not None:
        p, c, cached = usage
        body["usage"] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                         "prompt_tokens_details": {"cached_tokens": cached}}
    return body


class FakeOpenAI:
    """POST /v1/chat/completions answered from `script`: a list of steps consumed one per request, or a
    callable (request body, request index) -> step. A step is a reply() body, http_error(...), stall(...)
    or ("raw", text)."""

    def __init__(self, script: list[Any] | Callable[[dict[str, Any], int], Any]):
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with fake._lock:
                    index = len(fake.requests)
                    fake.requests.append(body)
                    fake.headers.append(dict(self.headers))
                    step = fake._step(body, index)
                try:
                    if isinstance(step, tuple) and step[0] == "stall":
                        time.sleep(step[1])
                        step = reply(content="too late")
                    if isinstance(step, tuple) and step[0] == "error":
                        _, status, headers, text = step
                        self._send(status, text.encode(), headers)
                    elif isinstance(step, tuple) and step[0] == "raw":
                        self._send(200, step[1].encode())
                    else:
                        self._send(200, json.dumps(step).encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _step(self, body: dict[str, Any], index: int) -> Any:
        if callable(self.script):
            return self.script(body, index)
        if index >= len(self.script):
            return reply(content="I am done.")
        return self.script[index]

    def sessions(self) -> int:
        """Requests that opened a session (system + overview, nothing else yet)."""
        return sum(1 for r in self.requests if len(r["messages"]) == 2)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# The math domain's seed harness, which variant() edits.
H0 = (REPO / "domains" / "math_reasoning" / "h0.py").read_text()


def variant(max_turns: int = 4, prompt: str = "Solve the problem. You can run python. Put the final answer in "
                                                 "\\\\boxed{}.") -> str:
    code = H0.replace("MAX_TURNS = 2  # model calls per episode", f"MAX_TURNS = {max_turns}  # model calls per episode")
    changed = re.sub(r"^SYSTEM_PROMPT = .*?(?=^MAX_TURNS)", lambda _: f'SYSTEM_PROMPT = "{prompt}"\n', code, count=1,
                     flags=re.MULTILINE | re.DOTALL)
    assert changed.count("SYSTEM_PROMPT = ") == 1 and prompt in changed
    return changed


@contextmanager
def trainer_actor(model: str, cfg: Any, checkpoint_dir: Path) -> Iterator[Any]:
    """A Trainer actor on `model` (a module's fixture shares one); its Ray Train run and the actor end after."""
    import ray

    from actors.trainer import Trainer

    trainer = Trainer.remote(str(model), cfg, str(checkpoint_dir))
    try:
        yield trainer
    finally:
        ray.get(trainer.shutdown.remote())
        ray.kill(trainer)


def check_skill_variants(domain: Any, warmstart_prompts: Iterable[str], archive_dir: Path) -> None:
    """A world's skill.md against its h0: the variants parse and name h0's functions, the phrases make up every
    system prompt the warm-start taught, each variant applies to h0 as the offline proposer applies it and loads as a
    harness, and the offline proposer's first proposals use at least two of them."""
    import libcst as cst

    from whale_ray.harness import check_harness_source
    from whale_ray.proposers.edits import Edit, apply_edit
    from whale_ray.proposers.knobs import function_fingerprint
    from whale_ray.proposers.offline import OfflineProposer
    from whale_ray.proposers.skill import parse_skill

    skill = parse_skill(domain.skill_text)
    assert not skill.warnings
    h0_code = domain.h0_path.read_text()
    functions = {name for name, v in load_harness(domain.folder, h0_code).items() if callable(v)}
    assert {v.name for v in skill.variants} <= functions and len(skill.variants) >= 4
    for prompt in warmstart_prompts:  # the phrase edits reach the prompts the warm-start taught
        assert not re.sub("|".join(re.escape(p) for p in skill.phrases), "", prompt).strip(), prompt
    for v in skill.variants:
        code = apply_edit(cst.parse_module(h0_code), Edit("function", v.name, None, v)).code
        check_harness_source(code, f"h0 with the {v.name} variant")
        assert function_fingerprint(code, v.name) == v.fingerprint
    archive = Archive(archive_dir)
    archive.add_candidate(h0_code, parent=None, hypothesis="seed", iteration=0, cycle=0, candidate_id="h0")
    proposals = OfflineProposer().propose(archive, 6, 1, skill_text=domain.skill_text, seed=0).proposals
    for p in proposals:
        check_harness_source(p.code, "proposal")
    proposed = {v.name for v in skill.variants for p in proposals if function_fingerprint(p.code, v.name) == v.fingerprint}
    assert len(proposed) >= 2, [p.hypothesis for p in proposals]

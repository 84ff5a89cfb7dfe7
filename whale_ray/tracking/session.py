"""Sends a run's records (records.py) to its trackers from a thread of its own, each tracker's calls bounded in time.

<run_dir>/tracking.json keeps, per tracker, where it writes, what continues its run (an MLflow run id, a W&B id)
and how many params/points it has had; a relaunch reads it and sends only the rest. A tracker that writes
elsewhere than last time starts a run there and gets everything.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from whale_ray.config import TrackingConfig, WhaleConfig
from whale_ray.events import EventLog
from whale_ray.run_state import RunState
from whale_ray.storage import atomic_write_text
from whale_ray.tracking.records import AXES, files, params, points, run_tags
from whale_ray.tracking.registry import Tracker, make_tracker

log = logging.getLogger(__name__)
RECORD_FILE = "tracking.json"


def sweep_experiment(root: Path, naming: str) -> str:
    """The one experiment of a sweep's (or a study's) trials."""
    return f"whale-{'study' if naming == 'study' else 'sweep'}-{Path(root).resolve().name}"


def trial_tracking(root: Path, naming: str, trial_id: str, values: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """(experiment, tags) of a sweep trial: what it varies as tags (a study's condition and seed among them)."""
    return sweep_experiment(root, naming), {"whale.trial_id": trial_id, **{f"sweep.{k}": str(v) for k, v in values.items()}}


class Guarded:
    """One tracker's calls, made in a daemon thread of its own and waited for at most `timeout_s`: a tracker that
    raises or stalls is named once (a warning, through the run's event log) and every later call is skipped."""

    def __init__(self, name: str, target: str, timeout_s: float, events: EventLog):
        self.name, self.target, self.timeout_s, self.events = name, target, timeout_s, events
        self.down = False
        self._calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name=f"tracker-{name}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, done = self._calls.get()
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - whatever the client raises is the tracker's failure
                done.set_exception(e)

    def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args)'s result; None, and `down` set, when the tracker fails now or did before."""
        if self.down:
            return None
        done: Future = Future()
        self._calls.put((fn, args, done))
        try:
            return done.result(timeout=self.timeout_s)
        except TimeoutError:
            self.fail(what, f"no answer within {self.timeout_s:g} s (tracking.timeout_s)")
        except Exception as e:  # noqa: BLE001
            self.fail(what, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        return None

    def fail(self, what: str, why: str) -> None:
        self.down = True
        where = f" at {self.target}" if self.target else ""
        self.events.emit("tracker_failed", f"tracking: {self.name}{where} failed to {what} ({why}); the run goes on "
                         "without it", tracker=self.name, target=self.target)


class TrackingSession:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, experiment: str, tags: dict[str, str]):
        self.cfg, self.run_dir, self.experiment, self.tags = cfg, Path(run_dir).resolve(), experiment, tags
        self.events = EventLog(self.run_dir)
        self.live: dict[str, tuple[Tracker, Guarded]] = {}
        self.record: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._poll, name="tracking", daemon=True)

    def start(self) -> None:
        path = self.run_dir / RECORD_FILE
        self.record = json.loads(path.read_text()) if path.is_file() else {}
        for name in self.cfg.enabled():
            events = self.events
            try:
                tracker = make_tracker(name, getattr(self.cfg, name), self.run_dir, self.experiment)
            except Exception as e:  # noqa: BLE001 - a missing package, a URI its client refuses
                Guarded(name, "", self.cfg.timeout_s, events).fail("start", f"{type(e).__name__}: {e}")
                continue
            self.live[name] = (tracker, Guarded(name, tracker.target, self.cfg.timeout_s, events))
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            try:
                self.sync()
            except Exception as e:  # noqa: BLE001 - a record read mid-write; the next poll reads it again
                log.debug("tracking: %s", e)

    def sync(self) -> None:
        """Sends every tracker what is on record and it has not had yet."""
        with self._lock:
            state = RunState.load(self.run_dir)
            if state is None or not (self.run_dir / "config.yaml").is_file():
                return  # the run directory is made when the run's loop starts
            for name, (tracker, guard) in self.live.items():
                if guard.down:
                    continue
                mine = self.record.get(name)
                if mine is None or mine.get("target") != tracker.target:
                    mine = self.record[name] = {"target": tracker.target, "resume": None, "params": False,
                                                **{axis: 0 for axis in AXES}}
                if not mine.get("opened"):
                    resume = guard.call("start its run", tracker.open, self.run_dir.name,
                                        {**run_tags(self.run_dir), **self.tags}, mine["resume"])
                    if guard.down:
                        continue
                    mine.update(resume=resume, opened=True)
                    mine.update(getattr(tracker, "held", None) or {})  # what its own store holds, where it can tell
                if not mine["params"]:
                    guard.call("log params", tracker.log_params, params(self.run_dir))
                    if guard.down:
                        continue
                    mine["params"] = True
                for axis in AXES:
                    for point in points(self.run_dir, state, axis, mine[axis]):
                        guard.call(f"log {axis} step {point.step}", tracker.log_point, point)
                        if guard.down:
                            break
                        mine[axis] += 1
            self._save()

    def _save(self) -> None:
        keep = {name: {k: v for k, v in r.items() if k != "opened"} for name, r in self.record.items()}
        atomic_write_text(self.run_dir / RECORD_FILE, json.dumps(keep, indent=1))

    def finish(self, status: str) -> None:
        """The last records, the artifacts (report, harnesses), and each tracker's run closed as `status`."""
        self._stop.set()
        self._thread.join()
        try:
            self.sync()
            state = RunState.load(self.run_dir)
        except Exception as e:  # noqa: BLE001 - the run is done; its trackers lose their last records, nothing else
            log.warning("tracking: the run directory %s could not be read for its last records (%s)", self.run_dir, e)
            return
        for name, (tracker, guard) in self.live.items():
            if guard.down or not self.record.get(name, {}).get("opened"):
                continue  # the run ended before its directory was made
            if state is not None:
                guard.call("log artifacts", tracker.log_files, files(self.run_dir, state))
            guard.call("close its run", tracker.close, status)


@contextmanager
def track_run(cfg: WhaleConfig, experiment: str = "whale", tags: dict[str, str] | None = None) -> Iterator[None]:
    """Mirrors the run in cfg.run_dir to the trackers its `tracking` section turns on, while the block runs and
    once more at its end (write the report inside the block: it is an artifact)."""
    if not cfg.tracking.enabled():
        yield
        return
    session = TrackingSession(cfg.tracking, Path(cfg.run_dir), experiment, tags or {})
    session.start()
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):  # SystemExit: Tune stopping a trial
        status = "KILLED"
        raise
    finally:
        session.finish(status)


def prepare_sweep(cfg: TrackingConfig, root: Path, experiment: str) -> None:
    """The sweep's MLflow store and experiment made once, by the driver, before trials side by side would each make
    them (and wait on one another within their tracker's timeout)."""
    if cfg.mlflow is None:
        return
    from whale_ray.tracking.mlflow_tracker import MlflowTracker

    events = EventLog(Path(root).resolve())
    try:
        tracker = MlflowTracker(cfg.mlflow, Path(root).resolve() / "trial", experiment)  # a trial's: the store beside it
    except Exception as e:  # noqa: BLE001
        Guarded("mlflow", "", cfg.timeout_s, events).fail("start", f"{type(e).__name__}: {e}")
        return
    Guarded("mlflow", tracker.target, cfg.timeout_s, events).call("make its experiment", tracker.prepare)


def log_comparison(cfg: TrackingConfig, root: Path, out: Path, experiment: str) -> None:
    """A study's comparison (compare.png, compare.md, compare.csv) as the files of one run, "compare", in the study's
    experiment: MLflow's in the trials' default store (<root>/mlflow.db) unless the config names another, W&B's an
    offline run of the study's group under <out>/wandb. TensorBoard keeps no files."""
    out = Path(out).resolve()
    events = EventLog(Path(root).resolve())
    path = out / RECORD_FILE
    record = json.loads(path.read_text()) if path.is_file() else {}
    if "target" in record:  # written when only MLflow had the comparison
        record = {"mlflow": record}
    shown = {f"compare/{n}": out / n for n in ("compare.png", "chain.png", "compare.md", "compare.csv", "runs.csv")}
    for name in ("mlflow", "wandb"):
        if getattr(cfg, name) is None:
            continue
        try:
            tracker = make_tracker(name, getattr(cfg, name), out, experiment)
        except Exception as e:  # noqa: BLE001
            Guarded(name, "", cfg.timeout_s, events).fail("start", f"{type(e).__name__}: {e}")
            continue
        guard = Guarded(name, tracker.target, cfg.timeout_s, events)
        before = record.get(name) or {}
        resume = before.get("resume") if before.get("target") == tracker.target else None
        resume = guard.call("start its run", tracker.open, "compare", {"whale.kind": "compare"}, resume)
        if guard.down:
            continue
        record[name] = {"target": tracker.target, "resume": resume}
        atomic_write_text(path, json.dumps(record))
        guard.call("log artifacts", tracker.log_files, {k: p for k, p in shown.items() if p.is_file()})
        guard.call("close its run", tracker.close, "FINISHED")

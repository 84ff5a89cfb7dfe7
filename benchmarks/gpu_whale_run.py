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

Where the time goes (issue 33): each run also prints `whale status --time`'s breakdown (whale_ray/report/timings.py:
the seconds of every timed act per phase, the episodes' own split into sandbox start, model calls, tools and
teardown, each cycle's fixed cost), and the GPU's and the cores' busy shares, sampled every --sample-s beside the
run and matched to the acts' spans by their start times. --settings runs each engine under several settings in
turn: `kept` (the Trainer's workers stay up across cycles, the default), `released` (ended after every weight
phase, the default before), `phase-checkpoint` (kept, the full state saved at each weight phase's end only), `cores`
(kept, the pool sized to the host's cores), `cores-wide`, `processes`, `processes-wide` (wider pools), `replicas`
(two PolicyServers on the GPU) and `stale`, `phase-checkpoint-stale` (with weight.max_staleness 1). --limits adds,
in the same invocation, the two ceilings a phase's rollouts/s is held to: the sandbox pool alone (a harness that
returns at once, one slot per core, benchmarks/sandbox_overhead.py; one slot alone beside it, for the share of linear
scaling) and the engine alone (the first run's weight-phase model calls replayed straight into a PolicyService, as
many in flight as the run had, each capped at the tokens it generated there; and again at the engine's full batch);
each phase's episodes/s is printed as a share of the lower one.

    python benchmarks/gpu_whale_run.py --device cuda --model .gpu/policy --root /tmp/gpu-runs
    python benchmarks/gpu_whale_run.py --device cuda --model .gpu/policy --engines vllm --settings kept,released \
        --weight-sync cuda_ipc --sleep-level 2 --limits
    python benchmarks/gpu_whale_run.py --device cuda --model <smollm2> --random-1p7b --engines vllm \
        --settings phase-checkpoint --weight-sync cuda_ipc --sleep-level 2    # the 1.7B shape, random weights
    python benchmarks/gpu_whale_run.py --device cpu --engines transformers --size tiny     # a CPU check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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
# kept: the workers kept up (the default) with the study's pool of 2 evaluators; released: the default before it;
# phase-checkpoint: kept, and the Trainer's full state saved only at each weight phase's end
# (weight.checkpoint_every), to show what a cycle's fixed cost is without the per-step checkpoints a relaunch
# resumes from; cores: kept, with the default pool (sandbox.evaluators: cores, sized to the host's CPUs), and
# cores-wide the same with 64 slots an evaluator (256 episodes in flight on 16 cores); processes and processes-wide:
# 16 evaluator processes of 8 and 16 slots (128 and 256 in flight: the host side spread over processes); stale and
# phase-checkpoint-stale: kept and phase-checkpoint with weight.max_staleness 1 (the next step's rollouts beside the
# Trainer's step); replicas: processes with two PolicyServers on the one GPU, each with half of the memory (two
# processes' host side in front of the GPU)
SETTINGS = {"kept": {"weight": {"release_workers": False}}, "released": {"weight": {"release_workers": True}},
            "phase-checkpoint": {"weight": {"release_workers": False, "checkpoint_every": 1_000_000}},
            "cores": {"weight": {"release_workers": False}, "sandbox": {"evaluators": "cores"}},
            "cores-wide": {"weight": {"release_workers": False}, "sandbox": {"evaluators": "cores", "slots": 64}},
            "processes": {"weight": {"release_workers": False}, "sandbox": {"evaluators": 16, "slots": 8}},
            "processes-wide": {"weight": {"release_workers": False}, "sandbox": {"evaluators": 16, "slots": 16}},
            "replicas": {"weight": {"release_workers": False}, "sandbox": {"evaluators": 16, "slots": 8},
                         "policy": {"replicas": 2, "gpu_memory_utilization": 0.15},
                         "resources": {"policy_server": {"num_gpus": 0.25}}},
            "stale": {"weight": {"release_workers": False, "max_staleness": 1}},
            "phase-checkpoint-stale": {"weight": {"release_workers": False, "checkpoint_every": 1_000_000,
                                                  "max_staleness": 1}}}


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
    if args.random_1p7b:
        if not args.model:
            raise SystemExit("--random-1p7b takes its tokenizer from --model; give one")
        cfg["policy"]["model"] = str(random_checkpoint(args.model.resolve(), args.root.resolve() / "qwen3-1p7b-random"))
    elif args.model:
        cfg["policy"]["model"] = str(args.model.resolve())
    return cfg


# Qwen3-1.7B's layers and widths (benchmarks/gpu_engines.py) with the vocabulary of the tokenizer it is given
QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, tie_word_embeddings=True, max_position_embeddings=4096)


def random_checkpoint(like: Path, out: Path) -> Path:
    """A Qwen3-1.7B-shaped checkpoint with random bf16 weights (seed 0) and `like`'s tokenizer, chat template and
    eos/pad ids, so that a whole run can be timed at that size; its completions are noise that runs to the token
    budget, which the coin-flip harness does not read. The vocabulary is the tokenizer's, not Qwen3's 151,936."""
    if (out / "model.safetensors").is_file() or (out / "model.safetensors.index.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, Qwen3Config, Qwen3ForCausalLM

    src = AutoConfig.from_pretrained(like)
    torch.manual_seed(0)
    cfg = Qwen3Config(**QWEN3_1P7B, vocab_size=src.vocab_size, eos_token_id=src.eos_token_id,
                      pad_token_id=src.pad_token_id, bos_token_id=src.bos_token_id, dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in like.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    print(f"random checkpoint {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"vocabulary {src.vocab_size} (the tokenizer's of {like})", flush=True)
    return out


def seed_harness(kind: str, root: Path) -> Path | None:
    if kind == "h0":
        return None
    from tests.run_truth import guessing_math_harness
    from whale_ray.domain import get_domain

    path = root / "h0_guessing.py"
    path.write_text(guessing_math_harness(get_domain("math_reasoning").h0_path.read_text()))
    return path


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


class Sampler:
    """The GPU's utilisation (nvidia-smi, None without one) and the cores' busy share (/proc/stat), every `period`
    seconds in a thread, each sample with its Unix time."""

    def __init__(self, period: float):
        self.period, self.samples = period, []
        self._stop = threading.Event()
        self._smi = shutil.which("nvidia-smi")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _gpu(self) -> float | None:
        if self._smi is None:
            return None
        out = subprocess.run([self._smi, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split()
        return float(out[0]) if out else None

    def _run(self) -> None:
        last = cpu_times()
        while not self._stop.wait(self.period):
            now = cpu_times()
            cpu = 100.0 * (now[0] - last[0]) / max(1, now[1] - last[1])
            last = now
            self.samples.append((time.time(), self._gpu(), cpu))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def busy(samples: list[tuple], spans: list[dict], phases: tuple[str, ...] | None, act: str | None) -> dict:
    """Mean GPU and CPU busy % over the samples taken inside the matching spans (None: any phase / act)."""
    chosen = [(s["start"], s["start"] + s["s"]) for s in spans
              if (phases is None or s["phase"] in phases) and (act is None or s["act"] == act)]
    inside = [x for x in samples if any(a <= x[0] <= b for a, b in chosen)]
    gpu = [g for _, g, _ in inside if g is not None]
    return {"samples": len(inside), "gpu": sum(gpu) / len(gpu) if gpu else None,
            "cpu": sum(c for *_, c in inside) / len(inside) if inside else None}


def run_one(name: str, engine: str, cfg: dict, root: Path, harness: Path | None, timeout_s: float | None,
            sample_s: float) -> dict:
    """One `whale run` with this engine; its outcome read back from the run directory."""
    run_dir = root / name
    config = root / f"{name}.yaml"
    config.write_text(yaml.safe_dump(merge(cfg, {"policy": {"engine": engine}}), sort_keys=False))
    log = root / f"{name}.log"
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--run-dir", str(run_dir)]
    with log.open("w") as f, Sampler(sample_s) as sampler:  # its own process group: a run past --run-timeout
        proc = subprocess.Popen(argv + (["--harness", str(harness)] if harness else []), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # is ended with its Ray cluster
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
            print(f"{name}: stopped after --run-timeout {timeout_s:g} s", file=f)
    wall = time.perf_counter() - t0
    status = subprocess.run([sys.executable, "-m", "whale_ray.cli", "status", str(run_dir), "--time"], cwd=ROOT,
                            capture_output=True, text=True)
    (root / f"{name}.status.txt").write_text(status.stdout + status.stderr)
    state_file = run_dir / "state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return {"name": name, "engine": engine, "rc": rc, "wall_s": wall, "state": state, "run_dir": str(run_dir),
            "versions": weight_versions(run_dir), "log": str(log), "samples": sampler.samples,
            "status": status.stdout}


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


def sandbox_alone(episodes_per_core: int) -> tuple[float, float]:
    """Episodes/s of the sandbox pool alone (one process of one slot per core, a harness that returns at once) and,
    beside it, of one slot alone: linear scaling is the cores times the latter."""
    from benchmarks.sandbox_overhead import across_processes

    return across_processes(os.cpu_count() or 1, 1, episodes_per_core), across_processes(1, 1, episodes_per_core)


def weight_calls(run_dir: Path) -> tuple[list[tuple[list[dict], int]], int]:
    """The weight phase's model calls of a run, as (messages, completion tokens), and how many episodes made them."""
    import pyarrow.parquet as pq

    calls, episodes = [], 0
    for f in sorted((run_dir / "rollouts").glob("weight-*.parquet")):
        table = pq.read_table(f, columns=["trace", "calls"])
        for trace, recorded in zip(table.column("trace").to_pylist(), table.column("calls").to_pylist()):
            episodes += 1
            for call, rec in zip(json.loads(trace)["calls"], recorded or []):
                calls.append((call["messages"], max(1, len(rec["completion_ids"]))))
    return calls, episodes


def engine_alone(run_dir: Path, engine: str, in_flight: int) -> dict:
    """The run's weight-phase calls replayed into a PolicyService (no Ray, no sandbox) in this process, `in_flight`
    at a time after a warm-up; episodes/s = calls/s over the run's calls per episode."""
    from whale_ray.config import load_recorded_config
    from whale_ray.launch import base_model
    from whale_ray.policy.serving import PolicyService
    from whale_ray.records import SamplingParams

    calls, episodes = weight_calls(run_dir)
    p = load_recorded_config(run_dir / "config.yaml").policy
    service = PolicyService(base_model(load_recorded_config(run_dir / "config.yaml")), engine=engine,
                            max_batch=p.max_batch, device=p.device, dtype=p.dtype, **p.engine_options())

    async def replay(batch: list[tuple[list[dict], int]], in_flight: int) -> float:
        gate = asyncio.Semaphore(in_flight)

        async def one(i: int, messages: list[dict], tokens: int) -> None:
            async with gate:
                await service.generate(messages, SamplingParams(max_tokens=tokens, temperature=1.0, top_k=20, seed=i))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, m, n) for i, (m, n) in enumerate(batch)))
        return time.perf_counter() - t0

    asyncio.run(replay(calls[:in_flight], in_flight))  # warm-up: compiled kernels, CUDA graphs
    wall = asyncio.run(replay(calls, in_flight))
    full = asyncio.run(replay(calls, p.max_batch))  # the engine's own ceiling: as many in flight as it batches
    return {"calls": len(calls), "episodes": episodes, "s": wall, "episodes_per_s": episodes / wall,
            "tokens": sum(n for _, n in calls), "full_batch": p.max_batch, "full_batch_episodes_per_s": episodes / full}


def episodes_in_flight(result: dict, cfg: dict) -> int:
    """The episodes a run's setting keeps in flight at most (slots x its pool's evaluators on this host): the engine's
    limit is taken at the same."""
    from whale_ray.config import SandboxConfig

    sandbox = SandboxConfig(**merge(cfg, SETTINGS[result["name"].split("-", 1)[1]])["sandbox"])
    _, most, _ = sandbox.pool_bounds(os.cpu_count())
    return sandbox.slots * most


def limits(first: dict, in_flight: int, args: argparse.Namespace) -> dict:
    """Both ceilings, the engine's in a fresh process (its own CUDA context, the runs' GPU memory given back) on the
    calls of run `first`, `in_flight` at a time."""
    out = subprocess.run([sys.executable, __file__, "--engine-alone", first["run_dir"], "--engine-of", first["engine"],
                          "--in-flight", str(in_flight)], capture_output=True, text=True, cwd=ROOT)
    engine = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    pool, one_slot = sandbox_alone(args.limit_episodes)
    return {"sandbox": pool, "sandbox_one_slot": one_slot, "engine": engine, "in_flight": in_flight}


def report(results: list[dict], ceilings: dict | None) -> None:
    base = phase_rates(results[-1])
    print(f"\n{'run':<18} {'phase':<8} {'rollouts':>8} {'wall s':>8} {'rollouts/s':>10}  vs {results[-1]['name']}")
    for r in results:
        rates = phase_rates(r)
        for phase, (n, wall, rate) in rates.items():
            ratio = f"{rate / base[phase][2]:.2f}x" if phase in base else "-"
            print(f"{r['name']:<18} {phase:<8} {n:>8} {wall:>8.1f} {rate:>10.2f}  {ratio}")
        state = r["state"]
        print(f"{r['name']:<18} {'run':<8} {'':>8} {r['wall_s']:>8.1f} {'':>10}  rc={r['rc']} "
              f"finished={state.get('finished')} weight_version={state.get('weight_version')} "
              f"steps={state.get('ledger', {}).get('weight_steps')}")
        print(f"{'':<18} calls by weight version, per phase: {json.dumps(r['versions'])}")
    for r in results:
        print(f"\n== {r['name']}: where the time went (whale status --time)")
        print(r["status"].split("\n\n", 1)[-1].rstrip())
        from whale_ray.report.timings import read_spans

        spans = read_spans(Path(r["run_dir"]))
        print("busy share, mean of samples inside the spans:   GPU %    cores %   samples")
        for label, phases, act in (("weight rollouts", ("weight",), "rollouts"), ("weight train", ("weight",), "train"),
                                   ("harness rollouts", ("harness", "validate"), "rollouts"),
                                   ("eval rollouts", ("val", "test"), "rollouts"), ("whole run", None, None)):
            b = busy(r["samples"], spans, phases, act) if act else {
                "samples": len(r["samples"]),
                "gpu": _mean([g for _, g, _ in r["samples"] if g is not None]),
                "cpu": _mean([c for *_, c in r["samples"]])}
            gpu = "-" if b["gpu"] is None else f"{b['gpu']:.1f}"
            cpu = "-" if b["cpu"] is None else f"{b['cpu']:.1f}"
            print(f"  {label:<44} {gpu:>6} {cpu:>10} {b['samples']:>9}")
    if ceilings is None:
        return
    engine = ceilings["engine"]
    cores, one = os.cpu_count() or 1, ceilings["sandbox_one_slot"]
    print(f"\nlimits: the sandbox pool alone {ceilings['sandbox']:.1f} episodes/s ({cores} processes x 1 slot; one "
          f"slot alone {one:.1f}, so {ceilings['sandbox'] / (cores * one):.2f} of linear scaling); "
          + (f"the engine alone {engine['episodes_per_s']:.1f} episodes/s ({engine['calls']} calls, {engine['tokens']} "
             f"completion tokens in {engine['s']:.1f} s, {ceilings['in_flight']} in flight; "
             f"{engine['full_batch_episodes_per_s']:.1f} at {engine['full_batch']} in flight)" if "s" in engine
             else f"the engine alone failed: {engine['error']}"))
    lower = min(ceilings["sandbox"], engine.get("episodes_per_s", float("inf")))
    for r in results:
        for phase, (n, wall, rate) in phase_rates(r).items():
            if phase != "eval":
                print(f"  {r['name']:<18} {phase:<8} {rate:>8.2f} episodes/s = {rate / lower:.2f} of the lower limit")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="vllm,transformers", help="comma-separated; ratios are to the last")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", type=Path, help="policy checkpoint (default: the embedded tiny policy)")
    ap.add_argument("--random-1p7b", action="store_true", help="run a Qwen3-1.7B-shaped checkpoint of random weights "
                                                                "with --model's tokenizer (built once under --root)")
    ap.add_argument("--root", type=Path, default=Path("/tmp/whale-gpu-runs"), help="run directories and logs")
    ap.add_argument("--size", default="full", choices=tuple(SIZES))
    ap.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "unsafe_none"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--harness", default="guessing", choices=("guessing", "h0"), help="the seed harness (see above)")
    ap.add_argument("--run-timeout", type=float, help="seconds one `whale run` may take before it is stopped")
    ap.add_argument("--sleep-level", type=int, default=0, choices=(0, 1, 2), help="policy.sleep_level (--device cuda)")
    ap.add_argument("--weight-sync", default="object_store", choices=("object_store", "cuda_ipc"),
                    help="weight.weight_sync (--device cuda)")
    ap.add_argument("--settings", default="kept", help=f"comma-separated, each engine runs under each: {', '.join(SETTINGS)}")
    ap.add_argument("--sample-s", type=float, default=0.5, help="seconds between GPU / CPU busy samples")
    ap.add_argument("--limits", action="store_true", help="also measure the sandbox pool alone and the engine alone")
    ap.add_argument("--limit-episodes", type=int, default=32, help="episodes per core for the sandbox pool's limit")
    ap.add_argument("--reuse", action="store_true", help="read back the runs (and limits) an earlier invocation on "
                                                         "this --root finished, so one table can span device calls")
    ap.add_argument("--engine-alone", type=Path, help=argparse.SUPPRESS)  # the engine's limit, in its own process
    ap.add_argument("--engine-of", help=argparse.SUPPRESS)
    ap.add_argument("--in-flight", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_alone:
        print(json.dumps(engine_alone(args.engine_alone, args.engine_of, args.in_flight)))
        return 0
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    cfg = study(args)
    print("study:", json.dumps(cfg), flush=True)
    harness = seed_harness(args.harness, root)
    results = []
    for engine in args.engines.split(","):
        for setting in args.settings.split(","):
            if setting not in SETTINGS:
                raise SystemExit(f"--settings: unknown {setting!r}; choose from {', '.join(SETTINGS)}")
            name = f"{engine}-{setting}"
            kept = root / f"{name}.result.json"
            if args.reuse and kept.is_file():
                results.append(json.loads(kept.read_text()))
                print(f"{name}: read back from {kept}", flush=True)
                continue
            if (root / name).exists():
                raise SystemExit(f"--root {root}: {name}/ exists already (a relaunch would resume it); use a new root")
            r = run_one(name, engine, merge(cfg, SETTINGS[setting]), root, harness, args.run_timeout, args.sample_s)
            print(f"{name}: rc {r['rc']}, {r['wall_s']:.1f} s; log {r['log']}", flush=True)
            if r["rc"] != 0:
                print(Path(r["log"]).read_text()[-3000:], flush=True)
            kept.write_text(json.dumps(r, default=str))
            results.append(r)
    ceilings = None
    if args.limits and any(r["rc"] == 0 for r in results):
        kept = root / "limits.json"
        ceilings = json.loads(kept.read_text()) if args.reuse and kept.is_file() else None
        first = next(r for r in results if r["rc"] == 0)
        in_flight = episodes_in_flight(first, cfg)  # the engine's limit at the episodes the first finished run had
        # none kept yet, one without every figure, or one taken at other episodes in flight
        if ceilings is None or "sandbox_one_slot" not in ceilings or ceilings["in_flight"] != in_flight:
            ceilings = limits(first, in_flight, args)
        kept.write_text(json.dumps(ceilings))
    report(results, ceilings)
    return max(r["rc"] for r in results)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

"""Round after round, the endpoint alone and then the same engine in process: does either drift?

serve_throughput.py interleaves the two and keeps each one's best round; this one shows every round of each, with
where a request's time went (the HTTP path, the hop, the engine, rows per engine step, the time a step took), to
tell a drift of the endpoint's own from the machine's. One replica of serve.preset `--preset` (gpu by default: the
engine in an actor of its own, reached over the hop), 32 clients in 16 processes (`--client-cores K`: on the last K
cores, everything else on the others; serve_throughput.py says why).

    python benchmarks/serve_rounds.py [--device cuda --model DIR] [--preset cpu|gpu] [--rounds 8] [--client-cores K]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_throughput as st  # noqa: E402

CLIENTS, PER_CLIENT, MAX_TOKENS, WAIT_MS = 32, 24, 32, 5.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", help="Hugging Face checkpoint (default: the embedded tiny math policy)")
    ap.add_argument("--preset", default="gpu", choices=["cpu", "gpu"], help="serve.preset")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--client-cores", type=int, default=0, help="cores of the client processes alone (0: none)")
    args = ap.parse_args()
    import ray
    import torch

    from whale_ray.config import ServeConfig
    from whale_ray.run_state import RunState
    from whale_ray.serve.app import deploy, free_port, undeploy
    from whale_ray.serve.spec import for_run_dir

    model, gpus = st.model_path(args.model), 1 if args.device.startswith("cuda") else 0
    torch.set_num_threads(2)  # as the endpoint's engine (serve.engine_cpus)
    os.environ.setdefault("RAY_worker_niceness", "0")  # serve_throughput.py says why
    ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    root = Path(tempfile.mkdtemp(prefix="serve-rounds-"))
    RunState().save(root)
    st.write_run_config(root, args.device, WAIT_MS, "continuous")
    serve = ServeConfig(port=free_port(), max_concurrent=64, preset=args.preset, engine_cpus=2, engine_gpus=gpus)
    url = deploy(for_run_dir(root, model, serve))
    procs = st.ClientProcesses(16, url, MAX_TOKENS)
    _, counts = st.endpoint_call(url, MAX_TOKENS)
    if args.client_cores:
        print(st.pin_clients([p.pid for p in procs.procs], args.client_cores), flush=True)

    def steps(r: dict) -> str:
        return (f"{r['batch']:.1f} rows per step, {r['steps_s']:.0f} steps/s, {r['step_ms']:.2f} ms per step, "
                f"{r['steps_per']:.2f} steps ({r['prefills_per']:.2f} prefills) per request, engine idle {r['idle']:.0%}")

    async def rounds() -> None:
        for i in range(args.rounds):
            r = await procs.round(CLIENTS, PER_CLIENT, counts)
            print(f"endpoint round {i}: {r['req_s']:.1f} req/s; ms per request: client {r['client_ms']:.1f} = HTTP "
                  f"{r['client_ms'] - r['handler_ms']:.1f} + hop {r['completion_ms'] - r['engine_ms']:.1f} + engine "
                  f"{r['engine_ms']:.1f}; {steps(r)}; replica CPU {r['cpu_ms']:.2f} ms", flush=True)
        call, local_counts = st.in_process_call(model, MAX_TOKENS, WAIT_MS, "continuous", args.device)
        await call(0)  # warm-up
        for i in range(args.rounds):
            r = await st.closed_loop(call, CLIENTS, PER_CLIENT, local_counts)
            print(f"in-process round {i}: {r['req_s']:.1f} req/s; engine {r['engine_ms']:.1f} ms per request; "
                  f"{steps(r)}", flush=True)
    try:
        asyncio.run(rounds())
    finally:
        procs.close()
        undeploy()


if __name__ == "__main__":
    main()

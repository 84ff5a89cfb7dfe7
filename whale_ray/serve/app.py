"""The Serve application: FastAPI routes over one `Replica` per Serve replica, and deploy / undeploy.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions (both streamed as SSE with
`stream: true`), POST /v1/agent/run, GET /health. Every reply of a model names its weights
(`system_fingerprint: "whale-v<N>"` and the `x-whale-weight-version` header); every error is an OpenAI error
object with its status (400 bad input, 401 no or wrong key, 404 unknown model, 413 prompt over the context,
429 replica full, with Retry-After; 500 only for a fault of ours, without a traceback).

Requests reach the replicas through Serve's proxy (serve.preset cpu) or through Serve's HAProxy to the replicas'
own HTTP servers (gpu; `_haproxy_env`); either way any number of replicas. The handlers run on Serve's main event
loop (none of them blocks it: an agent's episode and a checkpoint's read run in executor threads), which spares
every request's messages the crossing to a second thread's loop; Serve's per-request access log is off, since it
is Python on every request in the proxy and again in the replica.
"""


import asyncio
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from typing import Any, Optional

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.schema import LoggingConfig
from starlette.exceptions import HTTPException as StarletteHTTPException

from whale_ray.config import ServeConfig
from whale_ray.serve import openai_api as api
from whale_ray.serve.agent import AgentRequest, start_agent_services
from whale_ray.serve.engines import start_shared, stop_shared
from whale_ray.serve.follow import follower_of, start_weights
from whale_ray.serve.lag import LoopLag
from whale_ray.serve.openai_api import ApiError, ChatRequest, CompletionRequest
from whale_ray.serve.replica import Replica
from whale_ray.serve.spec import EndpointSpec

log = logging.getLogger(__name__)
APP_NAME = "whale"
VERSION_HEADER = "x-whale-weight-version"

app = FastAPI(title="whale-ray endpoint")


@app.exception_handler(ApiError)
async def _api_error(_: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:  # unknown path, wrong method
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return JSONResponse(ApiError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)


@app.exception_handler(Exception)
async def _fault(_: Request, e: Exception) -> JSONResponse:
    log.exception("endpoint fault")  # the traceback stays in the replica's log
    return JSONResponse(ApiError(500, f"internal error ({type(e).__name__})", type="server_error").body(),
                        status_code=500)


def _json(body: dict[str, Any], version: int, timing: str = "") -> JSONResponse:
    return JSONResponse(body, headers={VERSION_HEADER: str(version), **({"Server-Timing": timing} if timing else {})})


@serve.deployment(name="WhaleEndpoint")
@serve.ingress(app)
class WhaleEndpoint:
    def __init__(self, spec: EndpointSpec, services: dict[str, Any]):
        self.replica = Replica(spec, services)
        self._key = spec.api_key_sha256
        self._follow: Optional[asyncio.Task] = None
        self._lag = LoopLag()  # how late the handlers' loop runs what is ready (GET /health: "loop")

    def _start(self) -> None:
        """The follower (without traffic too: Serve's health checks call this) and the loop's lag, once."""
        self._lag.start()
        if self._follow is None and self.replica.follower is not None:
            self._follow = asyncio.get_running_loop().create_task(self.replica.follow_forever())

    async def _enter(self, request: Request) -> None:
        """Key check, then the run directory's latest state (and the follower started, once)."""
        if self._key is not None:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(hashlib.sha256(given.encode()).hexdigest(), self._key):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)",
                               type="authentication_error", code="invalid_api_key")
        self._start()
        await self.replica.sync()

    async def check_health(self) -> None:  # Serve calls it every few seconds; an error has it replace the replica
        self._start()
        for m in self.replica.models.values():
            m.engine.check()

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        # pid: this replica's process; each model's engine names its own (serve.preset)
        # thread: the one that runs the handlers
        batches: dict[str, Any] = {}
        for name, m in self.replica.models.items():
            try:
                batches[name] = await m.engine.stats()
            except ray.exceptions.RayActorError as e:  # its engine actor is restarting (or gone: check_health)
                batches[name] = {"error": str(e).splitlines()[0]}
        return {"status": "degraded" if any("error" in b for b in batches.values()) else "ok", "pid": os.getpid(),
                "thread": threading.current_thread().name, "versions": self.replica.versions(),
                "in_flight": self.replica.in_flight, "loop": self._lag.stats(), "batches": batches}

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        await self._enter(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "whale-ray",
                 "weight_version": m.version, "max_model_len": m.max_context}
                for name, m in self.replica.models.items()]
        return JSONResponse({"object": "list", "data": data})

    async def _complete(self, request: Request, chat: bool) -> Any:
        t0 = time.perf_counter()
        await self._enter(request)
        req = api.parse(ChatRequest if chat else CompletionRequest, await request.body())
        n = req.n * (1 if chat else len(req.prompts()))
        release = self.replica.admit(n)
        if not req.stream:
            try:
                t1 = time.perf_counter()
                body, version = await (self.replica.chat(req) if chat else self.replica.completion(req))
            finally:
                release()
            # where a reply's time went on this side (the client's latency less these is the HTTP path): the
            # handler, and of it the completion (the prompt's rendering, the engine's queue and passes, the reply)
            t2 = time.perf_counter()
            return _json(body, version, f"handler;dur={1000 * (t2 - t0):.2f}, completion;dur={1000 * (t2 - t1):.2f}")
        try:
            version, chunks = await self.replica.stream(chat, req)
        except BaseException:
            release()
            raise

        async def sse() -> Any:
            try:
                async for c in chunks:
                    yield c
            finally:
                release()
        return StreamingResponse(sse(), media_type="text/event-stream", headers={VERSION_HEADER: str(version)})

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        return await self._complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        return await self._complete(request, chat=False)

    @app.post("/v1/agent/run")
    async def agent_run(self, request: Request) -> JSONResponse:
        await self._enter(request)
        req = api.parse(AgentRequest, await request.body())
        release = self.replica.admit()
        try:
            body, version = await self.replica.agent_run(req)
        finally:
            release()
        return _json(body, version)


_started_serve: Optional[str] = None  # the preset of the Serve this process started (and so may shut down)
HTTP_UP_S = 120.0  # preset gpu: how long deploy waits for HAProxy and the replicas' own HTTP servers to answer


def _haproxy_env(c: ServeConfig) -> dict[str, str]:
    """Serve's HAProxy mode (serve.preset gpu), set in its controller and the replicas: HAProxy on `port` in front
    of the replicas' own HTTP servers, on ports above it (room for twice the replicas: a dead replica's port is
    quarantined while HAProxy forgets it); Serve's fallback proxy and HAProxy's stats and metrics on free ports
    (their fixed defaults would clash with a second endpoint on the machine); and a replica being stopped drains
    for 2 s instead of Serve's 30 (HAProxy hears of its leaving within ~0.1 s and a reload, and stops sending it
    requests; 30 s would make every undeploy take half a minute)."""
    n = c.max_replicas or c.replicas
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(c.port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(c.port + 1 + 2 * n),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port(c.host)),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port(c.host)),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port(c.host)),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, on `host`."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_http(url: str) -> None:
    import httpx2

    deadline = time.monotonic() + HTTP_UP_S
    while True:
        try:
            httpx2.get(url + "/health", timeout=5).raise_for_status()
            return
        except httpx2.HTTPError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve.preset gpu: nothing answered at {url} within {HTTP_UP_S:.0f} s ({e}); the "
                                   "logs are under the Ray session's logs/serve") from None
            time.sleep(0.2)


def _serve_is_running() -> bool:
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return True
    except ValueError:
        return False


def deploy(spec: EndpointSpec) -> str:
    """Starts (or updates) the endpoint on the connected Ray cluster; returns its base URL once every replica
    is up."""
    global _started_serve
    c = spec.serve
    gpu = c.preset == "gpu"
    if _started_serve is None and not _serve_is_running():
        _started_serve = c.preset
    if c.preset != (_started_serve or "cpu"):  # Serve's ingress (its proxy or HAProxy) is fixed when it starts
        raise RuntimeError(f"serve.preset {c.preset}: Serve is already running on this cluster for preset "
                           f"{_started_serve or 'cpu (started by another driver)'}; stop it first (`serve shutdown`) "
                           "or use that preset")
    env = _haproxy_env(c) if gpu else {}
    replica_env = {**env, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}  # the module docstring says why
    logs = LoggingConfig(enable_access_log=False)
    serve.start(http_options={"host": c.host, "port": c.port}, logging_config=logs,
                controller_options={"runtime_env": {"env_vars": env}} if env else None)
    # Serve's own cap sits above ours, so excess requests reach the replica and get a 429, not a queue;
    # preset gpu: the CPUs and GPUs are the engine actor's, the replicas hold none (whale_ray/serve/engines.py)
    opts: dict[str, Any] = {"max_ongoing_requests": 2 * c.max_concurrent + 8, "logging_config": logs,
                            "ray_actor_options": {"num_cpus": 0 if gpu else c.engine_cpus,
                                                  "num_gpus": 0 if gpu else c.gpus_per_engine,
                                                  "runtime_env": {"env_vars": replica_env}}}
    if c.min_replicas is not None and c.max_replicas is not None:
        opts["autoscaling_config"] = {"min_replicas": c.min_replicas, "max_replicas": c.max_replicas,
                                      "target_ongoing_requests": max(1, c.max_concurrent // 2),
                                      "upscale_delay_s": c.upscale_delay_s}
    else:
        opts["num_replicas"] = c.replicas
    services = start_agent_services(spec.config, spec.run_dir) if spec.config is not None else {}
    if gpu:  # before the replicas, which look it up by name
        start_shared(start_weights(spec, follower_of(spec)), spec)
    serve.run(WhaleEndpoint.options(**opts).bind(spec, services), name=APP_NAME, route_prefix="/")
    host = "127.0.0.1" if c.host in ("0.0.0.0", "::") else c.host
    if gpu:  # serve.run waits for the replicas, not for their own HTTP servers or HAProxy
        _wait_http(f"http://{host}:{c.port}")
    return f"http://{host}:{c.port}/v1"


def undeploy() -> None:
    """Ends the endpoint, and Serve itself if this process started it: on a shared cluster (`--ray-address`)
    other applications keep their Serve."""
    global _started_serve
    serve.delete(APP_NAME)
    stop_shared()  # preset gpu's engine actor, if any
    if _started_serve is not None:
        serve.shutdown()
        _started_serve = None

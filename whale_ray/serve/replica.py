"""One replica of the endpoint, without Serve: its models, how it follows a run, admission, and the completions.

Each served model is a `PolicyService` (whale_ray/policy/serving.py) in the replica's process or in the endpoint's
engine actor (whale_ray/serve/engines.py, `serve.preset`), so the requests in flight share the engine's running
batch as the run's PolicyServer's do.

Weight swaps: a new version is loaded with `PolicyService.load_weights`, which waits for the requests in
flight to finish. So **a request in flight finishes on the weights it started with** (all its tokens come from
one version, the one its reply names); requests that arrive during the swap wait for it and run on the new
weights. Before each request the replica looks at state.json (one `stat`), so it never answers on weights
older than a version the run directory already had when the request came.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from whale_ray.policy.engine import GenerationOutput, GenerationRequest, decode_completion, encode_prompts
from whale_ray.policy.restart import Weights
from whale_ray.records import ModelCall, SamplingParams
from whale_ray.serve import openai_api as api
from whale_ray.serve import tools
from whale_ray.serve.agent import AgentRequest, AgentRunner
from whale_ray.serve.channel import EngineLost
from whale_ray.serve.engines import LocalEngine, SharedEngine, start_engines
from whale_ray.serve.follow import follower_of, start_weights, wanted
from whale_ray.serve.openai_api import ApiError, ChatRequest, CompletionRequest
from whale_ray.serve.spec import EndpointSpec, ModelSource

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1


class ServedModel:
    def __init__(self, source: ModelSource, engine: LocalEngine | SharedEngine):
        self.name, self.follow = source.name, source.follow
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_context: int = engine.max_context

    @property
    def version(self) -> int:
        return self.engine.version

    async def ensure(self, weights: Weights) -> None:
        if weights.version > self.version:  # versions only go up (preset gpu: another replica may be ahead)
            await self.engine.load(weights)
            log.info("%s: weights v%d loaded from %s", self.name, weights.version, weights.path)


class Replica:
    def __init__(self, spec: EndpointSpec, services: dict[str, Any] | None = None):
        """`services`: the domain's shared services for the agent (`agent.start_agent_services`)."""
        self.spec = spec
        self.follower = follower_of(spec)
        engines = start_engines(start_weights(spec, self.follower), spec)
        self.models = {s.name: ServedModel(s, engines[s.name]) for s in spec.models}
        self.agent = AgentRunner(spec.domain, spec.sandbox, services)
        self.in_flight = 0
        self._sync_lock = asyncio.Lock()

    # ------------------------------------------------------------------------------------ following
    async def sync(self) -> None:
        """Loads the weights state.json names now, if they changed; a load that fails (a checkpoint pruned
        under us, say) is logged and retried at the next look, and the replica goes on serving."""
        if self.follower is None:
            return
        async with self._sync_lock:
            view = self.follower.poll()
            if view is None:
                return
            try:
                for m in self.models.values():
                    await m.ensure(wanted(m.follow, view))
            except Exception as e:  # noqa: BLE001
                log.warning("could not load the run's weights yet (%s); retrying", e)
                self.follower.forget()

    async def follow_forever(self) -> None:
        while True:
            await self.sync()
            await asyncio.sleep(self.spec.serve.poll_s)

    def versions(self) -> dict[str, int]:
        return {name: m.version for name, m in self.models.items()}

    # ------------------------------------------------------------------------------------ admission
    def admit(self, n: int = 1) -> Callable[[], None]:
        """Counts `n` requests in flight, or a 429 when the replica is full; returns the release."""
        if self.in_flight + n > self.spec.serve.max_concurrent:
            raise ApiError(429, f"too many concurrent requests (at most {self.spec.serve.max_concurrent} per "
                                f"replica); retry after {RETRY_AFTER_S} s", type="rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += n
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done, self.in_flight = True, self.in_flight - n
        return release

    def model(self, name: str) -> ServedModel:
        if name not in self.models:
            raise ApiError(404, f"model {name!r} does not exist; served: {', '.join(self.models)}", param="model",
                           code="model_not_found")
        return self.models[name]

    # ----------------------------------------------------------------------------------- completions
    def _requests(self, m: ServedModel, base: list[GenerationRequest], req: Any, budget: int | None,
                  top: int) -> tuple[list[GenerationRequest], int]:
        """n requests per prompt (choice i seeded seed + i), and the prompt tokens counted once per prompt."""
        prompt_tokens, out = 0, []
        for b in base:
            ids = encode_prompts(m.tokenizer, [b])[0]  # counted here, and handed on: the engine need not tokenise
            length = len(ids)
            if length >= m.max_context:
                raise ApiError(413, f"the prompt is {length} tokens; model {m.name!r} has a context of "
                                    f"{m.max_context}", param="messages" if b.prompt is None else "prompt",
                               code="context_length_exceeded")
            prompt_tokens += length
            tokens = budget or m.max_context - length  # none given: until eos or the context is full
            out += [GenerationRequest(b.messages, req.sampling(tokens, top, i), prompt=b.prompt, prompt_ids=ids)
                    for i in range(req.n)]
        return out, prompt_tokens

    def chat_requests(self, req: ChatRequest) -> tuple[ServedModel, list[GenerationRequest], int]:
        m = self.model(req.model)
        messages = tools.render([x.model_dump() for x in req.messages], req.tools if req.uses_tools() else None)
        reqs, prompt_tokens = self._requests(m, [GenerationRequest(messages)], req, req.budget(), req.alternatives())
        return m, reqs, prompt_tokens

    def completion_requests(self, req: CompletionRequest) -> tuple[ServedModel, list[GenerationRequest], int]:
        m = self.model(req.model)
        base = [GenerationRequest([], prompt=p) for p in req.prompts()]
        reqs, prompt_tokens = self._requests(m, base, req, req.max_tokens or 16, req.logprobs or 0)
        return m, reqs, prompt_tokens

    @staticmethod
    async def _run(m: ServedModel, reqs: list[GenerationRequest]) -> list[GenerationOutput]:
        try:
            return list(await asyncio.gather(*(m.engine.complete(r) for r in reqs)))
        except (ValueError, EngineLost) as e:
            raise _api_error(e) from None

    async def chat(self, req: ChatRequest) -> tuple[dict[str, Any], int]:
        m, reqs, prompt_tokens = self.chat_requests(req)
        outs = await self._run(m, reqs)
        choices = []
        for i, o in enumerate(outs):
            content, calls = tools.parse(o.text) if req.uses_tools() else (o.text, [])
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            choices.append({"index": i, "message": message, "finish_reason": "tool_calls" if calls else o.finish_reason,
                            "logprobs": api.chat_logprobs(m.tokenizer, o) if req.logprobs else None,
                            "weight_version": o.weight_version})
        version = max(o.weight_version for o in outs)
        usage = api.usage(prompt_tokens, sum(len(o.completion_ids) for o in outs))
        return api.body("chat.completion", api.new_id("chatcmpl"), m.name, version, choices, usage), version

    async def completion(self, req: CompletionRequest) -> tuple[dict[str, Any], int]:
        m, reqs, prompt_tokens = self.completion_requests(req)
        outs = await self._run(m, reqs)
        choices = [{"index": i, "text": o.text, "finish_reason": o.finish_reason, "weight_version": o.weight_version,
                    "logprobs": api.completion_logprobs(m.tokenizer, o) if req.logprobs is not None else None}
                   for i, o in enumerate(outs)]
        version = max(o.weight_version for o in outs)
        usage = api.usage(prompt_tokens, sum(len(o.completion_ids) for o in outs))
        return api.body("text_completion", api.new_id("cmpl"), m.name, version, choices, usage), version

    async def stream(self, chat: bool, req: Any) -> tuple[int, AsyncIterator[str]]:
        """The weight version (known once the first token is out, for the response header) and the SSE
        chunks: each token's text as it is sampled, held back while it may be the start of a stop string."""
        m, reqs, prompt_tokens = self.chat_requests(req) if chat else self.completion_requests(req)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        for i, r in enumerate(reqs):
            r.on_token = lambda t, v, i=i: loop.call_soon_threadsafe(events.put_nowait, ("token", i, t, v))
        tasks = [asyncio.ensure_future(m.engine.complete(r)) for r in reqs]
        for i, task in enumerate(tasks):
            task.add_done_callback(lambda t, i=i: events.put_nowait(("done", i, t, None)))
        first = await events.get()
        if first[0] == "done" and first[2].exception() is not None:
            for t in tasks:
                t.cancel()
            err = first[2].exception()
            raise _api_error(err) if isinstance(err, (ValueError, EngineLost)) else err
        version = first[3] if first[0] == "token" else first[2].result().weight_version
        return version, self._chunks(chat, req, m, reqs, prompt_tokens, version, events, first)

    async def _chunks(self, chat: bool, req: Any, m: ServedModel, reqs: list[GenerationRequest], prompt_tokens: int,
                      version: int, events: asyncio.Queue, first: tuple) -> AsyncIterator[str]:
        kind, rid = ("chat.completion.chunk", api.new_id("chatcmpl")) if chat else ("text_completion", api.new_id("cmpl"))
        ids: list[list[int]] = [[] for _ in reqs]
        sent, held = [""] * len(reqs), [False] * len(reqs)
        stops = reqs[0].sampling.stop
        completion_tokens, left = 0, len(reqs)

        def chunk(i: int, text: str, finish: str | None, out: GenerationOutput | None) -> str:
            if chat:
                choice = {"index": i, "delta": {"content": text} if text or finish else {"role": "assistant", "content": ""},
                          "logprobs": api.chat_logprobs(m.tokenizer, out) if out and req.logprobs else None,
                          "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "finish_reason": finish,
                          "logprobs": api.completion_logprobs(m.tokenizer, out) if out and req.logprobs is not None
                          else None}
            return api.sse(api.body(kind, rid, m.name, version, [choice], None))

        if chat:
            for i in range(len(reqs)):
                yield chunk(i, "", None, None)
        event = first
        while True:
            if event[0] == "token":
                _, i, token, _ = event
                ids[i].append(token)
                if not held[i]:
                    text = _safe_prefix(m.tokenizer, ids[i], stops)
                    if text is None:
                        held[i] = True  # a stop string showed: the final text is cut before it
                    elif len(text) > len(sent[i]) and text.startswith(sent[i]):
                        yield chunk(i, text[len(sent[i]):], None, None)
                        sent[i] = text
            else:
                _, i, task, _ = event
                out = task.result()  # an engine failure mid-stream ends the stream (the client sees it cut)
                tail = out.text[len(sent[i]):] if out.text.startswith(sent[i]) else ""
                completion_tokens += len(out.completion_ids)
                yield chunk(i, tail, out.finish_reason, out)
                left -= 1
                if not left:
                    break
            event = await events.get()
        if req.include_usage():
            yield api.sse(api.body(kind, rid, m.name, version, [], api.usage(prompt_tokens, completion_tokens)))
        yield api.sse("[DONE]")

    # ------------------------------------------------------------------------------------ the agent
    async def agent_run(self, req: AgentRequest) -> tuple[dict[str, Any], int]:
        m = self.model(req.model or self.spec.agent_model)
        fallback = Path(self.spec.harness_path)
        if self.follower is not None:  # h* as the run has it on record now
            harness_id = self.follower.view.harness_id
            source = self.follower.harness_source(harness_id, fallback)
        else:
            harness_id, source = fallback.stem, fallback.read_text()
        loop = asyncio.get_running_loop()

        def generate(messages: list[dict[str, str]], sampling: SamplingParams) -> ModelCall:
            return asyncio.run_coroutine_threadsafe(m.engine.generate(messages, sampling), loop).result()

        reply = await self.agent.run(source, harness_id, req, generate)
        return reply, max(reply["weight_versions"], default=m.version)


def _api_error(e: ValueError | EngineLost) -> ApiError:
    """A request the engine refused (check_request's one line: 400), or one in flight when its engine actor died
    (503: Ray restarts the actor, and a retry waits for it)."""
    if isinstance(e, ValueError):
        return ApiError(400, str(e))
    return ApiError(503, f"{e}; the request was in flight and is lost, the engine restarts: retry after "
                         f"{RETRY_AFTER_S} s", type="server_error", code="engine_restarting",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _safe_prefix(tokenizer: Any, ids: list[int], stops: tuple[str, ...]) -> str | None:
    """The completion's text that can be sent now: None once a stop string shows; otherwise without the
    last len(stop) - 1 characters (a stop string may be starting there) and without a trailing partial
    UTF-8 character."""
    text = decode_completion(tokenizer, ids)
    stops = tuple(s for s in stops if s)
    if any(s in text for s in stops):
        return None
    hold = max((len(s) for s in stops), default=1) - 1
    return (text[: len(text) - hold] if hold else text).rstrip("\ufffd")

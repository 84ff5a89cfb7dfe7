"""The live endpoint (whale_ray/serve/): one real Serve app with 2 replicas on a local Ray cluster, following a
run directory that the tests write checkpoints into as a run does; the real `openai` client over loopback.

Swap semantics under test: a request in flight finishes on the weights it started with (its text equals the
in-process engine's on those weights); a request that starts after a checkpoint is on record runs on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import textwrap
import time
from pathlib import Path

import openai
import pytest

from tests.helpers import Run, free_port, generate_in_process, in_process

pytestmark = pytest.mark.timeout(300)

KEY_ENV, KEY = "WHALE_SERVE_TEST_KEY", "sk-whale-test-not-a-secret"
QUESTION = [{"role": "system", "content": "Solve the problem. You can run python."},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_policy, ray_cluster):
    from tests.helpers import small_config
    from whale_ray.config import ServeConfig, dump_config
    from whale_ray.serve.app import deploy, undeploy
    from whale_ray.serve.spec import for_run_dir

    root = tmp_path_factory.mktemp("served_run")
    (root / "config.yaml").write_text(dump_config(small_config(root)))
    run = Run(root, tiny_policy)
    os.environ[KEY_ENV] = KEY
    port = free_port()
    spec = for_run_dir(root, tiny_policy, ServeConfig(port=port, replicas=2, max_concurrent=40,
                                                      api_key_env=KEY_ENV, poll_s=0.2))
    url = deploy(spec)
    yield url, run
    undeploy()


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, **kw)


def test_chat_sync_async_and_streaming(served, tiny_policy):
    url, _ = served
    c = client(url)
    assert [m.id for m in c.models.list()] == ["whale-latest", "whale-best"]
    raw = c.chat.completions.with_raw_response.create(model="whale-latest", messages=QUESTION, max_tokens=12,
                                                      temperature=0)
    r = raw.parse()
    assert raw.headers["x-whale-weight-version"] == "0" and r.system_fingerprint == "whale-v0"
    assert r.choices[0].message.content == in_process(tiny_policy, 0, QUESTION, max_tokens=12, temperature=0)
    assert r.usage.completion_tokens <= 12 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    r = c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=6, n=3, seed=5, top_p=0.9,
                                  logprobs=True, top_logprobs=3, extra_body={"top_k": 20})
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    again = c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=6, n=3, seed=5, top_p=0.9,
                                      extra_body={"top_k": 20})
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]  # seeded
    first = r.choices[0].logprobs.content[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].logprob >= first.top_logprobs[1].logprob
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)

    async def many() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
        rs = await asyncio.gather(*(ac.chat.completions.create(model="whale-best", messages=QUESTION, max_tokens=8,
                                                               temperature=0) for _ in range(8)))
        return [x.choices[0].message.content for x in rs]
    assert set(asyncio.run(many())) == {in_process(tiny_policy, 0, QUESTION, max_tokens=8, temperature=0)}
    import httpx2

    health = httpx2.get(url.removesuffix("/v1") + "/health", timeout=60).json()  # the answering replica's
    assert health["status"] == "ok" and set(health["batches"]) == {"whale-latest", "whale-best"}
    for s in health["batches"].values():  # engine steps and the tokens they sampled (at least one row each)
        assert s["tokens"] >= s["batches"] >= 0 and (s["batches"] == 0 or s["mean_batch"] >= 1)

    # streamed: the deltas join to the non-streamed text, a stop string cuts both the same way
    for stop in (None, ["1"], ["\n\n"]):
        whole = c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=16, temperature=0,
                                          stop=stop).choices[0]
        chunks = list(c.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=16,
                                                temperature=0, stop=stop, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.message.content
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.finish_reason
        assert chunks[-1].usage.completion_tokens > 0 and {ch.system_fingerprint for ch in chunks} == {"whale-v0"}


def test_text_completions(served, tiny_policy):
    url, _ = served
    c = client(url)
    prompt = "Tom has 3 apples and buys 4 more."
    r = c.completions.create(model="whale-latest", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
    assert r.choices[0].text == in_process(tiny_policy, 0, prompt=prompt, max_tokens=10, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text or r.choices[0].finish_reason == "stop"
    r = c.completions.create(model="whale-latest", prompt=[prompt, "What is 2 + 2?"], n=2, max_tokens=4, seed=1)
    assert len(r.choices) == 4

    async def streamed() -> str:
        ac = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
        stream = await ac.completions.create(model="whale-latest", prompt=prompt, max_tokens=10, temperature=0,
                                             stream=True)
        return "".join([ch.choices[0].text async for ch in stream])
    assert asyncio.run(streamed()) == in_process(tiny_policy, 0, prompt=prompt, max_tokens=10, temperature=0)


def _post(url: str, body: bytes | dict, key: str | None = KEY, path: str = "/chat/completions"):
    import httpx2

    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx2.post(url + path, content=content, headers=headers, timeout=120)


OK = {"model": "whale-latest", "messages": QUESTION, "max_tokens": 4}


@pytest.mark.parametrize("body,key,status,param", [
    (b'{"model": "whale-latest", "messages": [', KEY, 400, None),  # malformed JSON
    ({**OK, "max_tokens": "many"}, KEY, 400, "max_tokens"),  # a field of the wrong type
    ({**OK, "messages": [{"role": "user", "content": 7}]}, KEY, 400, "messages.0.content"),
    ({**OK, "response_format": {"type": "json_object"}}, KEY, 400, "response_format"),  # refused, not ignored
    ({**OK, "max_tokens": 0}, KEY, 400, "max_tokens"),
    ({**OK, "top_p": 0}, KEY, 400, "top_p"),
    ({**OK, "model": "gpt-9"}, KEY, 404, "model"),
    ({**OK, "messages": [{"role": "user", "content": "7" * 4000}]}, KEY, 413, "messages"),
    (OK, None, 401, None),
    (OK, "sk-wrong", 401, None),
])
def test_bad_input_is_an_error_object_and_the_server_keeps_serving(served, body, key, status, param):
    url, _ = served
    r = _post(url, body, key)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and "Traceback" not in r.text
    assert _post(url, OK).status_code == 200


def test_overload_is_429_with_retry_after(served):
    import httpx2

    url, _ = served

    async def burst() -> list:
        async with httpx2.AsyncClient(timeout=120) as h:
            body = {**OK, "max_tokens": 48, "temperature": 1.0}
            return await asyncio.gather(*(h.post(url + "/chat/completions", json=body,
                                                 headers={"authorization": f"Bearer {KEY}"}) for _ in range(120)))
    replies = asyncio.run(burst())
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 429} and codes.count(200) >= 40  # 2 replicas x 40 admitted at most at once
    refused = next(r for r in replies if r.status_code == 429)
    assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert _post(url, OK).status_code == 200


def test_hot_swap_under_load(served):
    """32 clients while 5 new checkpoints land: no failure, each client's versions never go down, nothing that
    started after a checkpoint was on record runs on older weights (on either replica), a stream in flight
    finishes on the weights it started with, and greedy outputs after each swap equal the in-process engine's."""
    url, run = served
    stream_prompt = "Tom has 3 apples and buys 4 more. How many"

    async def main() -> None:
        ac = openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0)
        go, stop = asyncio.Event(), False
        busy = [0]
        seen: list[list[int]] = [[] for _ in range(32)]
        log: list[tuple[int, int]] = []  # (swaps on record when the request started, version it ran on)
        landed = [0]

        async def worker(i: int) -> None:
            while not stop:
                await go.wait()
                busy[0] += 1
                on_record = landed[0]
                try:
                    r = await ac.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=8,
                                                         seed=i)
                finally:
                    busy[0] -= 1
                v = int(r.system_fingerprint.removeprefix("whale-v"))
                seen[i].append(v)
                log.append((on_record, v))

        workers = [asyncio.create_task(worker(i)) for i in range(32)]
        previous = None
        for version in range(1, 6):
            go.set()
            while min(len(s) for s in seen) < 2 * version:  # every client works between two swaps
                await asyncio.sleep(0.05)
            if version == 3:  # a stream in flight across the swap
                on_v2 = generate_in_process(str(run.root / run.state.checkpoint), 2, prompt=stream_prompt,
                                            max_tokens=60, temperature=0)
                expected = on_v2.text
                stream = await ac.completions.create(model="whale-latest", prompt=stream_prompt, max_tokens=60,
                                                     temperature=0, stream=True)
                chunks = [await stream.__anext__()]
            path = run.land(version)
            landed[0] = version
            if version == 3:
                chunks += [ch async for ch in stream]
                assert {ch.system_fingerprint for ch in chunks} == {"whale-v2"}
                text = "".join(ch.choices[0].text for ch in chunks)
                assert text == expected and len(chunks) > 10  # many engine steps: the swap came mid-stream
                # v3 is another model on this prompt (a tiny policy's greedy text may not show it; its log-probs do)
                on_v3 = generate_in_process(str(path), 3, prompt=stream_prompt, max_tokens=60, temperature=0)
                assert on_v3.logprobs != pytest.approx(on_v2.logprobs, abs=1e-3)
            go.clear()
            while busy[0]:
                await asyncio.sleep(0.01)
            greedy = await ac.chat.completions.create(model="whale-latest", messages=QUESTION, max_tokens=12,
                                                      temperature=0, logprobs=True)
            assert greedy.system_fingerprint == f"whale-v{version}"
            mine = generate_in_process(str(path), version, QUESTION, max_tokens=12, temperature=0)
            assert greedy.choices[0].message.content == mine.text
            served_lps = [t.logprob for t in greedy.choices[0].logprobs.content]
            assert served_lps == pytest.approx(mine.logprobs, abs=1e-4)
            if previous is not None:  # the check has teeth: the last weights' log-probs are not these
                assert served_lps != pytest.approx(previous.logprobs[:len(served_lps)], abs=1e-3)
            previous = mine
        stop = True
        go.set()
        await asyncio.gather(*workers)
        assert all(s == sorted(s) for s in seen)  # each client's versions never go down
        assert all(v >= on_record for on_record, v in log)
        assert {v for s in seen for v in s} == set(range(0, 6))
    asyncio.run(main())


REDTEAM = textwrap.dedent('''
    import os, socket

    def run(task, agent):
        found = ["env:" + ("LEAK" if os.environ.get(KEY_ENV) else "clean")]
        for name, attempt in [("rundir", lambda: open(RUN_DIR + "/state.json").read()),
                              ("gold", lambda: agent.tool("verify", answer="7")),
                              ("net", lambda: socket.create_connection(("127.0.0.1", PORT), timeout=2))]:
            try:
                attempt()
                found.append(name + ":LEAK")
            except BaseException as e:
                found.append(name + ":blocked")
        agent.generate([{"role": "user", "content": task["question"]}], max_tokens=4)
        return " ".join(found)
''')


@pytest.mark.usefixtures("bwrap")
def test_agent_run_h0_then_a_red_team_h_star(served):
    """h0 of math (the run has no h* yet), then a red-team harness that the run accepts as h*: it runs in the
    sandbox with the public task only; the key, the run directory, the tools it has not got and the network
    are out of its reach, and the endpoint goes on serving."""
    from whale_ray.archive import Archive
    from whale_ray.run_state import Selection

    url, run = served
    task = {"id": "t1", "question": "Tom has 3 apples and buys 4 more. How many apples does he have?"}
    r = _post(url, {"task": task, "seed": 1}, path="/agent/run")
    assert r.status_code == 200, r.text
    reply = r.json()
    print("agent/run reply:", json.dumps(reply))  # pytest -s shows one whole reply
    assert reply["harness_id"] == "h0" and reply["status"] == "ok" and reply["turns"] == len(reply["model_calls"]) >= 1
    assert r.headers["x-whale-weight-version"] == str(run.state.weight_version)
    assert {c["weight_version"] for c in reply["model_calls"]} == {run.state.weight_version}
    assert "reward" not in reply and "answer" not in reply["model_calls"][0]["messages"][-1]
    assert reply["answer"] == reply["model_calls"][-1]["completion"] or reply["tool_calls"]  # h0: the text as is
    assert _post(url, {"task": {**task, "answer": "7"}}, path="/agent/run").status_code == 400  # no gold goes in

    archive = Archive(run.root / "archive")
    source = f"KEY_ENV, RUN_DIR, PORT = {KEY_ENV!r}, {str(run.root)!r}, {int(url.split(':')[2].split('/')[0])}\n"
    cid = archive.add_candidate(source + REDTEAM, parent=None, hypothesis="red team", iteration=1, cycle=0)
    run.state.best = Selection(weight_version=run.state.weight_version, checkpoint=run.state.checkpoint,
                               harness_id=cid, val=0.0)
    run.state.save(run.root)
    reply = _post(url, {"task": task}, path="/agent/run").json()
    assert reply["harness_id"] == cid and reply["status"] == "ok", reply
    assert reply["answer"] == "env:clean rundir:blocked gold:blocked net:blocked"
    assert _post(url, OK).status_code == 200


SEARCH_THEN_ANSWER = """def run(task, agent):
    found = agent.tool("search", query=task["question"], topk=1)
    agent.generate([{"role": "user", "content": task["question"]}], max_tokens=2)
    return found
"""


@pytest.mark.usefixtures("bwrap")
def test_agent_of_search_qa_searches_its_own_retriever_and_chess_is_refused(ray_cluster, tiny_policy, tmp_path):
    """The agent route's runner (Replica.agent_run, the code behind POST /v1/agent/run, without HTTP) for the
    domains with trusted parts: search_qa's search reaches a Retriever actor the endpoint started from the run's
    config, and returns what a retriever built here over the same corpus returns; chess, whose opponent plays
    the reference line (a trusted field), is one 400 line, not a game against no one."""
    from domains.search_qa import generator, retrieval
    from tests.helpers import small_config
    from whale_ray.config import ServeConfig
    from whale_ray.domain import get_domain
    from whale_ray.serve.agent import AgentRequest, start_agent_services
    from whale_ray.serve.openai_api import ApiError
    from whale_ray.serve.replica import Replica
    from whale_ray.serve.spec import for_model

    harness = tmp_path / "search_then_answer.py"
    harness.write_text(SEARCH_THEN_ANSWER)
    cfg = small_config(tmp_path / "run", domain="search_qa")
    config = cfg.model_dump(mode="json")
    spec = for_model(tiny_policy, domain="search_qa", harness=harness, policy=cfg.policy, sandbox=cfg.sandbox,
                     serve=ServeConfig(), config=config)
    services = start_agent_services(config, None)
    replica = Replica(spec, services)
    task = get_domain("search_qa").load_splits(cfg.data, cfg.seed).test[0]
    try:
        reply, version = asyncio.run(replica.agent_run(AgentRequest(task=task.public())))
    finally:
        ray_cluster.kill(services["retriever"])
    assert reply["status"] == "ok" and version == 0, reply
    here = retrieval.build_retriever(get_domain("search_qa").settings(cfg).retrieval, generator.corpus(cfg.seed))
    assert reply["answer"] == retrieval.format_passages(here.search([task.question], 1)[0])
    assert reply["tool_calls"][0]["name"] == "search" and len(reply["model_calls"]) == 1

    chess = Replica(for_model(tiny_policy, domain="chess_puzzles", harness=None, policy=cfg.policy,
                              sandbox=cfg.sandbox, serve=ServeConfig()))
    fen = "6k1/5ppp/8/8/8/8/5PPP/R5K1 w - - 0 1"
    with pytest.raises(ApiError) as refused:
        asyncio.run(chess.agent_run(AgentRequest(task={"question": "Mate in one.", "fen": fen})))
    assert refused.value.status == 400 and "reference line" in refused.value.message


def test_tool_calls_in_the_hermes_format():
    from whale_ray.serve import tools

    chat = tools.render([{"role": "user", "content": [{"type": "text", "text": "list it"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "a", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
                         {"role": "tool", "content": "h0/"}], [{"type": "function", "function": {"name": "ls"}}])
    assert chat[0]["role"] == "system" and '"name": "ls"' in chat[0]["content"]
    assert chat[2]["content"] == '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
    content, calls = tools.parse('I look.\n<tool_call>\n{"name": "ls", "arguments": {"path": "h0"}}\n</tool_call>')
    assert content == "I look." and calls[0]["function"] == {"name": "ls", "arguments": '{"path": "h0"}'}
    assert tools.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


def long_context_copy(policy: str, dest: Path, context: int) -> str:
    """The policy with a longer context (its RoPE positions go on): what a user does with a checkpoint whose
    config says more. The tiny policy's 512 tokens cannot hold the proposer's prompt (~15k tokens of its
    byte-level vocabulary); with 512 every session ended on the endpoint's 413."""
    shutil.copytree(policy, dest)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        data = json.loads((dest / name).read_text())
        data[key] = context
        (dest / name).write_text(json.dumps(data))
    return str(dest)


def test_whale_run_serve_with_the_llm_proposer_through_it(tmp_path, tiny_policy, whale_cache):
    """`whale run --serve`: the endpoint is up while the run works (it answers, naming the run's weights) and
    gone after; the LLM proposer of the same run talks to it through --proposer-base-url, and its session gets
    the endpoint's replies turn after turn (the tiny policy writes no code a proposer can use: the session ends
    without a candidate, and the run goes on)."""
    import subprocess
    import sys
    import threading

    import httpx2
    import yaml

    policy = long_context_copy(tiny_policy, tmp_path / "policy", 32768)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    config = tmp_path / "study.yaml"
    config.write_text(yaml.safe_dump({
        "condition": "mh_only", "cycles": 1, "I": 2, "data": {"n_weight": 4, "n_harness": 2, "n_val": 2, "n_test": 2},
        "harness_phase": {"candidates_per_iteration": 1, "proposer": "llm",
                          "endpoint": {"model": "whale-latest", "max_retries": 0},
                          "llm": {"max_turns": 2, "max_output_tokens": 16, "nudges": 0}},
        "eval": {"test_samples": 1, "val_samples": 1}, "sandbox": {"slots": 4, "wall_s": 20},
        "serve": {"enabled": True, "port": port}}))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "whale_ray.cli", "run", "--config", str(config), "--model",
                             policy, "--run-dir", str(run_dir), "--proposer-base-url", url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "WHALE_CACHE": str(whale_cache)})
    seen: list[str] = []

    def poll() -> None:
        while proc.poll() is None:
            try:
                r = httpx2.post(url + "/chat/completions", json={**OK, "max_tokens": 2}, timeout=30)
                seen.append(r.json()["system_fingerprint"])
            except (httpx2.HTTPError, ValueError, KeyError):
                pass  # not up yet, or going down
            time.sleep(0.5)
    watcher = threading.Thread(target=poll)
    watcher.start()
    out, _ = proc.communicate(timeout=280)
    watcher.join()
    assert proc.returncode == 0, out[-3000:]
    assert f"live endpoint: {url}" in out and seen and set(seen) == {"whale-v0"}  # mh_only: θ stays v0
    session = json.loads(next((run_dir / "proposer").glob("iter-*/session.json")).read_text())
    assert session["base_url"] == url and session["model"] == "whale-latest"
    print("proposer session:", json.dumps({k: session.get(k) for k in ("stop_reason", "turns", "usage")}))
    assert "HTTP" not in session["stop_reason"], session["stop_reason"]  # every request was answered
    assert session["usage"]["calls"] >= 1 and session["usage"]["completion_tokens"] > 0
    assert session["usage"]["prompt_tokens"] > 512  # past the context the tiny policy was built with
    with pytest.raises(httpx2.HTTPError):  # down after the run
        httpx2.get(url + "/models", timeout=5)

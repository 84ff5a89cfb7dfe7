"""Property-based fuzzing of the host side of the sandbox's RPC channel (hypothesis).

The frames go to the shipped host-side parser and dispatcher (`_Episode.receive`, what the serve loop
calls on every read) in process, so thousands of them cost seconds; a handful more go through a real
sandboxed child that writes them to its socket. The property: every frame, of any shape, depth, size,
type at any field and number range, is answered (a reply frame, or the episode's end as protocol_error
or the matching limit status), and nothing raises out of the host. `pytest -s` prints the case count.
"""

from __future__ import annotations

import json
import math
import struct
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from whale_ray.records import ModelCall, SamplingParams
from whale_ray.sandbox import SandboxLimits, run_episode
from whale_ray.sandbox.episode import Episode as _Episode
from whale_ray.sandbox.episode import _Done

CAP = 1 << 16
LIMITS = SandboxLimits(max_message_bytes=CAP, max_rpc_calls=64)
# How an episode may end on a child's frames alone. Never sandbox_error (a host bug) nor crashed.
ENDINGS = {"ok", "protocol_error", "output_limit", "harness_exception", "memory_limit", "sandbox_setup_error"}
CASES = {"frames": 0, "examples": 0}
T0: list[float] = []  # when the first case ran (the report counts this file's own time only)


def generate(messages: list[dict], sampling: SamplingParams) -> ModelCall:
    # The policy relies on these; the host must never pass anything else through.
    assert all(type(m["role"]) is str and type(m["content"]) is str for m in messages)
    assert type(sampling.max_tokens) is int and type(sampling.top_k) is int
    assert type(sampling.temperature) is float and math.isfinite(sampling.temperature)
    assert type(sampling.top_p) is float and 0 < sampling.top_p <= 1
    assert all(type(s) is str for s in sampling.stop)
    return ModelCall(messages=messages, text="hi", prompt_ids=[1], completion_ids=[2], logprobs=[-0.5],
                     weight_version=0, finish_reason="stop")


def lookup(query: str, k: int = 1) -> str:
    """A host tool with typed parameters (a harness may send anything as its arguments)."""
    return f"{query[:20]}:{k + 1}"


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def episode() -> _Episode:
    return _Episode(None, LIMITS, generate, {"lookup": lookup}, 7, time.monotonic())


def feed(data: bytes, *, hello: bool = True, chunks: list[int] | None = None) -> _Episode:
    """Feed `data` (after a valid hello) in pieces; check that the host answered and did not raise."""
    if not T0:
        T0.append(time.monotonic())
    ep = episode()
    buf, out = bytearray(), bytearray()
    if hello:
        data = frame(b'{"type":"hello","pid":2}') + data
    pieces, i = [], 0
    for n in chunks or []:
        pieces.append(data[i:i + n])
        i += n
    pieces.append(data[i:])
    try:
        for piece in pieces:
            buf += piece
            ep.receive(buf, out)
    except _Done:
        pass
    i = 0
    while i + 4 <= len(data):  # count the frames (whole or truncated) in what was fed
        CASES["frames"] += 1
        i += 4 + int.from_bytes(data[i:i + 4], "big")
    CASES["examples"] += 1
    assert ep.host_error is None
    if ep.outcome is not None:
        assert ep.outcome[0] in ENDINGS, ep.outcome
        assert ep.outcome[0] != "sandbox_error", ep.outcome[1]
    while len(out) >= 4:  # every reply is a well-formed frame of the channel's grammar
        n = int.from_bytes(out[:4], "big")
        reply = json.loads(bytes(out[4:4 + n]))
        assert reply["type"] in ("generate_result", "tool_result", "rpc_error") and type(reply["id"]) is int
        del out[:4 + n]
    return ep


def status(ep: _Episode) -> str | None:
    return None if ep.outcome is None else ep.outcome[0]


# ------------------------------------------------------------------------------------ strategies
HUGE = st.integers(min_value=-(10 ** 400), max_value=10 ** 400)
scalars = (st.none() | st.booleans() | st.integers() | HUGE
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6),
                                                                                             kids, max_size=4),
                           max_leaves=12)
# Tokens the encoder cannot produce from Python values: spliced into the text where a value goes.
RAW = st.sampled_from([
    "NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 5000, "-" + "9" * 30, "18446744073709551616",
    '"\\ud800"', '"\\udfff x"', '"\\u0000"', "[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000,
    "[" * 40 + "]" * 40, "0.1e-400", "1E400", "-0", "true", "null", '""', "[]", "{}",
]) | st.integers(min_value=1, max_value=200).map(lambda d: "[" * d + "1" + "]" * d)

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
SAMPLING = {"max_tokens": 8, "temperature": 0.5, "top_k": 20, "top_p": 0.9, "stop": ["\n"]}
VALID = {
    "generate": {"type": "generate", "id": 1, "messages": MESSAGES, "sampling": SAMPLING},
    "tool": {"type": "tool", "id": 2, "name": "lookup", "args": {"query": "q", "k": 3}},
    "result": {"type": "result", "answer": "4", "events": [{"type": "note", "x": 1}]},
    "error": {"type": "error", "kind": "exception", "error": "ValueError: x", "traceback": "tb", "events": []},
    "hello": {"type": "hello", "pid": 3},
}
# field path -> values that are of the wrong type or out of range there (each must be a protocol_error)
not_str = json_values.filter(lambda v: not isinstance(v, str))
not_int = json_values.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 63))
WRONG = {
    ("generate", "id"): not_int,
    ("generate", "messages"): json_values.filter(lambda v: not (isinstance(v, list) and v and all(
        isinstance(m, dict) and set(m) == {"role", "content"} and all(isinstance(x, str) for x in m.values())
        for m in v))),
    ("generate", "sampling"): json_values.filter(lambda v: not isinstance(v, dict) or bool(set(v) - set(SAMPLING))),
    ("generate", "sampling", "max_tokens"): json_values.filter(
        lambda v: not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 1 << 31)),
    ("generate", "sampling", "temperature"): st.one_of(st.text(), st.booleans(), st.none(), st.just(-1.0),
                                                       st.lists(st.integers()), st.just(1e300)),
    ("generate", "sampling", "top_k"): json_values.filter(
        lambda v: not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31)),
    ("generate", "sampling", "top_p"): json_values.filter(
        lambda v: not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1)),
    ("generate", "sampling", "stop"): json_values.filter(
        lambda v: v is not None and not (isinstance(v, list) and all(isinstance(s, str) for s in v))),
    ("tool", "id"): not_int,
    ("tool", "name"): not_str,
    ("tool", "args"): json_values.filter(lambda v: not isinstance(v, dict)),
    ("result", "answer"): json_values.filter(lambda v: v is not None and not isinstance(v, str)),
    ("result", "events"): json_values.filter(lambda v: not (isinstance(v, list) and all(
        isinstance(e, dict) and isinstance(e.get("type"), str) for e in v))),
    ("error", "kind"): json_values.filter(lambda v: v not in ("exception", "memory", "protocol")),
    ("error", "error"): not_str,
    ("error", "traceback"): not_str,
    ("error", "events"): json_values.filter(lambda v: not isinstance(v, list) or any(
        not isinstance(e, dict) or not isinstance(e.get("type"), str) for e in v)),
}


def encode(obj) -> bytes:
    try:
        return json.dumps(obj).encode()  # NaN/Infinity as their tokens, lone surrogates as \ud800 escapes
    except ValueError:  # an int over Python's 4300-digit str limit: the same field as a raw token
        return b'"' + b"9" * 10 + b'"'


def with_field(kind: str, path: tuple[str, ...], value) -> dict:
    msg = json.loads(json.dumps(VALID[kind]))
    target = msg
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return msg


def splice(kind: str, path: tuple[str, ...], raw: str) -> bytes:
    """VALID[kind] with the value at `path` replaced by the raw JSON text `raw`."""
    text = json.dumps(with_field(kind, path, "@@RAW@@"))
    return text.replace('"@@RAW@@"', raw, 1).encode()


any_message = st.builds(lambda kind, fields: {"type": kind, **fields},
                        st.sampled_from([*VALID, "init", "unknown", ""]) | st.text(max_size=8),
                        st.dictionaries(st.sampled_from(["id", "messages", "sampling", "name", "args", "answer",
                                                         "events", "kind", "error", "traceback", "pid"])
                                        | st.text(max_size=5), json_values, max_size=6))
any_payload = st.one_of(
    any_message.map(encode),
    json_values.map(encode),  # not an object, or an object without a type
    st.binary(max_size=64),  # not UTF-8, not JSON
    st.tuples(st.sampled_from(list(VALID)), st.data()).flatmap(
        lambda kd: st.sampled_from([p for p in WRONG if p[0] == kd[0]] or [(kd[0], "pid")]).flatmap(
            lambda path: RAW.map(lambda raw: splice(kd[0], path[1:], raw)))),
)
FUZZ = settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.filter_too_much])


# ----------------------------------------------------------------------------------------- tests
@FUZZ
@given(st.lists(any_payload, min_size=1, max_size=5), st.booleans(), st.lists(st.integers(0, 40), max_size=4))
def test_any_frames_are_answered_and_never_raise(payloads, hello, chunks):
    data = b"".join(frame(p) for p in payloads)  # concatenated, then fed in arbitrary pieces
    feed(data, hello=hello, chunks=chunks)


@FUZZ
@given(st.sampled_from(sorted(WRONG)).flatmap(lambda path: st.tuples(st.just(path), WRONG[path])))
def test_a_wrong_type_or_range_at_any_field_is_a_protocol_error(case):
    (kind, *path), value = case
    ep = feed(frame(encode(with_field(kind, tuple(path), value))))
    assert status(ep) == "protocol_error", (kind, path, value, ep.outcome)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(sorted(WRONG)), RAW)
def test_raw_tokens_at_any_field_deep_nesting_huge_ints_nan(path, raw):
    kind, *rest = path
    ep = feed(frame(splice(kind, tuple(rest), raw)))
    assert status(ep) in ("protocol_error", "ok", "harness_exception", None), ep.outcome
    if raw in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1E400", "9" * 5000, "18446744073709551616",
               '"\\ud800"', '"\\udfff x"') or raw.startswith("[" * 33) or raw.startswith('{"a":{"a":'):
        assert status(ep) == "protocol_error", (path, raw[:40], ep.outcome)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(list(VALID)), st.integers(0, 200), st.lists(st.integers(0, 30), max_size=6))
def test_truncated_frames_wait_and_split_frames_answer_as_whole_ones(kind, cut, chunks):
    whole = frame(encode(VALID[kind])) * 2
    truncated = feed(whole[:min(cut, len(whole) - 1)])
    assert status(truncated) in (None, "protocol_error", "ok", "harness_exception")  # a prefix never raises
    a, b = feed(whole), feed(whole, chunks=chunks)
    assert (status(a), a.rpc_calls) == (status(b), b.rpc_calls)


def test_frame_limits():
    assert status(feed(struct.pack(">I", CAP + 1))) == "output_limit"  # the header alone decides
    assert status(feed(frame(b""))) == "protocol_error"
    assert status(feed(frame(encode(VALID["tool"])) * 65)) == "output_limit"  # max_rpc_calls
    assert status(feed(frame(encode(VALID["hello"])), hello=False)) is None
    assert status(feed(frame(encode(VALID["result"])), hello=False)) == "protocol_error"  # not hello first
    ok = feed(frame(encode(VALID["generate"])) + frame(encode(VALID["tool"])) + frame(encode(VALID["result"])))
    assert status(ok) == "ok" and len(ok.calls) == 1 and ok.tool_calls[0]["output"] == "q:4"


# ------------------------------------------------------------------------------ a real child
RAW_HARNESS = """
import os, time
def run(task, agent):
    os.write(agent._channel.fd, bytes.fromhex(task["payload"]))  # past the agent API, straight to the socket
    if task["exit"]:
        os._exit(0)
    time.sleep(5)
"""
GEN = b'{"type":"generate","id":1,"messages":[{"role":"u","content":"x"}],"sampling":{"top_p":NaN}}'


@pytest.mark.usefixtures("bwrap")
@pytest.mark.parametrize("case,data,expected", [
    ("NaN sampling", frame(GEN), "protocol_error"),
    ("deep nesting", frame(b'{"type":"result","answer":"4","events":' + b"[" * 9990 + b"]" * 9990 + b"}"),
     "protocol_error"),
    ("huge int id", frame(b'{"type":"tool","id":' + b"9" * 5000 + b',"name":"lookup","args":{}}'), "protocol_error"),
    ("unhashable error kind", frame(b'{"type":"error","kind":[1],"error":"e","traceback":""}'), "protocol_error"),
    ("concatenated, then garbage", frame(b'{"type":"tool","id":1,"name":"lookup","args":{"query":"a"}}') * 3
     + frame(b"\xff\xfe{}"), "protocol_error"),
    ("truncated, then exit", struct.pack(">I", 100) + b'{"type":"res', "protocol_error"),
    ("over the frame cap", struct.pack(">I", 1 << 30), "output_limit"),
])
def test_bad_frames_from_a_real_sandboxed_child(case, data, expected):
    task = {"id": "f", "question": "q", "payload": data.hex(), "exit": case.endswith("exit")}
    r = run_episode(RAW_HARNESS, task, generate=generate, tools_path=None, host_tools={"lookup": lookup},
                    limits=SandboxLimits(wall_s=10), seed=1)
    assert r.status == expected, (case, r.status, r.reason)
    assert r.reason and "wall-clock" not in r.reason  # decided on the frame, not at the deadline


def test_zz_report_case_count():
    print(f"\nRPC fuzz: {CASES['examples']} generated cases ({CASES['frames']} frames) in "
          f"{time.monotonic() - T0[0]:.1f} s (with the 7 real-child episodes)" if T0 else "")
    assert CASES["examples"] >= 3000 or CASES["examples"] == 0  # 0: run alone with -k

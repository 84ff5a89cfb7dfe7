"""The channel's frames on the host side: encoding what the host sends, and the strict decoder of what the
child sends, which is the untrusted input tests/sandbox/test_rpc_fuzz.py attacks.

A frame is a 4-byte big-endian length and a UTF-8 JSON object (docs/contracts.md). `decode_frame` accepts
only a JSON object with a str type, 64-bit integers, finite numbers, nesting <= MAX_DEPTH and no lone
surrogates, and raises BadFrame (never anything else) for the rest; `check_messages` and `parse_sampling`
check a generate request's fields and return the reason when one is off. The episode (episode.py) ends
as protocol_error on either.
"""

from __future__ import annotations

import json
import math
from typing import Any

from whale_ray.records import SamplingParams


def encode_frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")
    return len(data).to_bytes(4, "big") + data


def utf8_ok(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    # ints are within int64 (see decode_frame), so float() and isfinite() cannot overflow
    return is_int(x) or (isinstance(x, float) and math.isfinite(x))


class BadFrame(ValueError):
    """A frame the host refuses to interpret (the reason is the protocol_error reason)."""


MAX_DEPTH = 32  # nesting of arrays/objects in one frame: traces and tool args are shallow
_INT64 = 1 << 63


def _no_constant(name: str) -> Any:
    raise BadFrame(f"the child sent {name}, which is not JSON")


def _bounded_int(text: str) -> int:
    if len(text) > 20:
        raise BadFrame(f"the child sent an integer of {len(text)} digits (the limit is 64-bit)")
    value = int(text)
    if not -_INT64 <= value < _INT64:
        raise BadFrame("the child sent an integer outside the 64-bit range")
    return value


def decode_frame(payload: bytes) -> dict[str, Any]:
    """One frame's payload as a JSON object the rest of the host can trust the shape of: strict UTF-8,
    no NaN/Infinity, 64-bit integers, nesting <= MAX_DEPTH, no lone surrogates in any string or key.
    Raises BadFrame (never anything else) with the reason."""
    try:
        text = payload.decode("utf-8")
        msg = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int)
    except BadFrame:
        raise
    except RecursionError:
        raise BadFrame("the child sent an RPC message nested too deeply") from None
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, anything else the decoder does
        raise BadFrame(f"the child sent a malformed RPC message (not UTF-8 JSON: {type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise BadFrame("the child sent an RPC message without a type")
    stack: list[tuple[Any, int]] = [(msg, 1)]
    while stack:  # iterative: no recursion for the harness to exhaust
        value, depth = stack.pop()
        if isinstance(value, str):
            if not utf8_ok(value):
                raise BadFrame("the child sent a string that is not valid Unicode text (lone surrogate)")
        elif isinstance(value, float):
            if not math.isfinite(value):  # 1e999 parses to inf without parse_constant
                raise BadFrame("the child sent a non-finite number")
        elif isinstance(value, (list, dict)):
            if depth > MAX_DEPTH:
                raise BadFrame(f"the child sent an RPC message nested deeper than {MAX_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str):
                    stack.append((k, depth))
                stack.append((v, depth + 1))
    return msg


def check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "generate: messages must be a non-empty list"
    for m in messages:
        if (not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["role"], str)
                or not isinstance(m["content"], str) or not utf8_ok(m["content"]) or not utf8_ok(m["role"])):
            return "generate: each message must be {'role': str, 'content': str}"
    return None


def parse_sampling(raw: Any) -> SamplingParams | str:
    if not isinstance(raw, dict) or set(raw) - {"max_tokens", "temperature", "top_k", "top_p", "stop"}:
        return "generate: malformed sampling parameters"
    sp = SamplingParams()
    mt, temp = raw.get("max_tokens", sp.max_tokens), raw.get("temperature", sp.temperature)
    tk, tp, stop = raw.get("top_k", sp.top_k), raw.get("top_p", sp.top_p), raw.get("stop", [])
    stop = [] if stop is None else stop
    if not (is_int(mt) and 1 <= mt < 1 << 31 and _is_num(temp) and 0 <= temp <= 1e6 and is_int(tk)
            and 0 <= tk < 1 << 31 and _is_num(tp) and 0 < tp <= 1 and isinstance(stop, list)
            and all(isinstance(s, str) and utf8_ok(s) for s in stop)):
        return "generate: invalid sampling parameters"
    return SamplingParams(max_tokens=mt, temperature=float(temp), top_k=tk, top_p=float(tp), stop=tuple(stop))

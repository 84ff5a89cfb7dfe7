"""Tool calling on the chat endpoint, in the Hermes format that Qwen models are trained on (vLLM's `hermes`
parser reads the same): the request's tool schemas go into the system prompt inside <tools></tools>, an
earlier assistant tool call is written back into its text as <tool_call>{"name", "arguments"}</tool_call>,
a tool result is a `tool` message, and the <tool_call> blocks of a completion come back as OpenAI
`tool_calls` (finish_reason "tool_calls"). Whether the model calls tools well is the model's business.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
             "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
             "For each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
             "<args-json-object>}}\n</tool_call>")


def text_of(content: Any) -> str:
    """A message's content as text: a string, None (an assistant turn that only called tools) or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content)


def render(messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> list[dict[str, str]]:
    """The chat as the engine takes it ({'role', 'content'} strings), with the tools and earlier calls written in."""
    out = []
    for m in messages:
        content = text_of(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                pass  # the model's own malformed arguments, written back as they were
            content += ("\n" if content else "") + "<tool_call>\n" + json.dumps(
                {"name": fn.get("name", ""), "arguments": args}) + "\n</tool_call>"
        out.append({"role": m["role"], "content": content})
    if tools:
        preamble = _PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def parse(text: str) -> tuple[Optional[str], list[dict[str, Any]]]:
    """(the text outside tool calls, or None when nothing is left; the OpenAI tool_calls). A block that is not
    a JSON object with a string "name" stays in the text: it is not a call."""
    calls, kept = [], []
    last = 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls

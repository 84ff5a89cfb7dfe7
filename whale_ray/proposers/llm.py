"""The `llm` proposer: a built-in agent loop over the `openai` client against any OpenAI-compatible endpoint.

One session per harness iteration:

    system:  the Meta-Harness task, the archive layout, the domain's skill text
    user:    the iteration history and the frontier
    loop:    the model calls tools (list_files, read_file, grep, diff, show_frontier, list_candidates,
             write_candidate); each result goes back as a tool message

The session ends when `n` candidates were accepted by write_candidate, when the model stops calling
tools (after `llm.nudges` reminders while it still owes candidates), after `llm.max_turns` model calls,
when a budget limit is reached, or on an error the loop cannot retry. Whatever was accepted until then
is returned; nothing here raises into the harness phase except a configuration error at start.

Resilience: 429, 5xx, timeouts, connection errors and unparseable responses are retried with
exponential backoff (`Retry-After` honoured), up to `endpoint.max_retries` times per call; each retry is
in the session log. Tool calls with bad arguments get the error text back as their result.

The API key is read from `os.environ[endpoint.api_key_env]` in this (trusted) process only. A loopback
endpoint may run without one. The key never enters the session log (`redact`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from whale_ray.archive import Archive
from whale_ray.config import HarnessPhaseConfig
from whale_ray.harness import HarnessError, check_harness_source, normalize_code
from whale_ray.proposers.archive_tools import (
    ArchiveTools,
    ToolInputError,
    default_parent,
    parse_arguments,
    tool_schemas,
)
from whale_ray.proposers.base import Proposal, Proposer, ProposerError
from whale_ray.proposers.prompts import LLM_TOOLS_NOTE, overview, system_prompt
from whale_ray.proposers.session import Limits, SessionLog, cost_usd, estimate_tokens, price_for

LOOPBACK_PLACEHOLDER_KEY = "whale-loopback-no-key"
MAX_CODE_CHARS = 256 * 1024
MAX_HYPOTHESIS_CHARS = 4000


def is_loopback(base_url: str | None) -> bool:
    """True for http(s)://localhost, 127.0.0.0/8 and [::1] endpoints."""
    if not base_url:
        return False
    host = (urlparse(base_url).hostname or "").strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_api_key(endpoint: Any) -> str | None:
    """The key from the environment variable named by `endpoint.api_key_env`; None for a loopback endpoint
    without one. A missing key for any other endpoint is a ProposerError naming the variable."""
    key = os.environ.get(endpoint.api_key_env or "") if endpoint.api_key_env else None
    if key:
        return key
    if is_loopback(endpoint.base_url):
        return None
    where = endpoint.base_url or "the default OpenAI endpoint"
    raise ProposerError(f"the llm proposer needs an API key for {where}: set the environment variable "
                        f"{endpoint.api_key_env!r} (harness_phase.endpoint.api_key_env names it)")


class _Stop(Exception):
    """Ends the session; the message is its stop reason."""


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for k in kinds:
        if k == "string" and isinstance(value, str):
            return True
        if k == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k == "boolean" and isinstance(value, bool):
            return True
        if k == "null" and value is None:
            return True
    return False


def _strip_fence(code: str) -> str:
    """A whole-file ``` fenced block, unwrapped (models often fence code they pass as an argument)."""
    s = code.strip()
    if s.startswith("```") and s.endswith("```") and s.count("\n") >= 1:
        body = s.split("\n", 1)[1]
        return body[: body.rfind("```")].rstrip() + "\n"
    return code


class LLMProposer(Proposer):
    """See the module docstring. `client` replaces the openai client (tests); `sleep` the backoff's sleep."""

    kind = "llm"

    def __init__(self, *, config: HarnessPhaseConfig | dict[str, Any] | None = None, client: Any = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if config is None:
            raise ProposerError(f"the {self.kind} proposer needs config=<the run's harness_phase config>")
        hp = config if isinstance(config, HarnessPhaseConfig) else HarnessPhaseConfig.model_validate(config)
        self.hp = hp
        self.endpoint = hp.endpoint
        self.opts = hp.llm
        if not self.endpoint.model:
            raise ProposerError("the llm proposer needs harness_phase.endpoint.model")
        self.price = price_for(hp.prices, self.endpoint.model)
        key = resolve_api_key(self.endpoint)
        self._secrets = [key] if key else []
        if client is None:
            import openai

            client = openai.OpenAI(api_key=key or LOOPBACK_PLACEHOLDER_KEY, base_url=self.endpoint.base_url,
                                   timeout=self.endpoint.timeout_s, max_retries=0)  # retries are ours, logged
        self._client = client
        self._sleep = sleep
        self._schemas = tool_schemas()
        self._props = {t["function"]["name"]: t["function"]["parameters"] for t in self._schemas}

    def secrets(self) -> list[str]:
        return self._secrets

    # ------------------------------------------------------------------------------ the session
    def _session(self, archive: Archive, n: int, iteration: int, *, skill_text: str, seed: int, limits: Limits,
                 log_path: Path | None, log: SessionLog) -> list[Proposal]:
        """Up to `n` candidates written through write_candidate."""
        log.model, log.base_url = self.endpoint.model, self.endpoint.base_url
        log.notes.append(f"seed {seed}; price per 1M tokens: {self.price or 'none configured (cost counted as 0)'}")
        proposals: list[Proposal] = []
        seen = {normalize_code(c.code): c.id for c in archive.candidates()}
        tools = ArchiveTools(archive, read_max_chars=self.opts.read_max_chars)
        sent: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt(skill_text, tools_note=LLM_TOOLS_NOTE.format(n=n),
                                                        noise_margin=self.hp.noise_margin)},
            {"role": "user", "content": overview(archive, n, iteration)},
        ]
        log.messages = [dict(m) for m in sent]
        nudges = 0
        try:
            if n <= 0:
                raise _Stop("nothing to propose (n = 0)")
            for turn in range(1, self.opts.max_turns + 1):
                reached = limits.exceeded(log.usage, log.elapsed())
                if reached:
                    raise _Stop(f"budget: {reached}")
                self._elide(sent)
                reply = self._complete(sent, log, turn, limits)
                tool_calls = reply.get("tool_calls") or []
                sent.append(reply)
                log.messages.append(dict(reply))
                log.write_partial(log_path, self._secrets)  # what was spent so far survives a kill
                if not tool_calls:
                    if len(proposals) >= n:
                        raise _Stop("done")
                    if nudges >= self.opts.nudges:
                        raise _Stop(f"the model stopped calling tools with {len(proposals)} of {n} candidates written")
                    nudges += 1
                    text = (reply.get("content") or "").strip()
                    why = "an empty reply" if not text else "a reply without a tool call"
                    log.notes.append(f"turn {turn}: {why}; reminder {nudges} of {self.opts.nudges}")
                    reminder = {"role": "user", "content": (
                        f"You have written {len(proposals)} of {n} candidates. Candidates count only when submitted "
                        "with the write_candidate tool (the complete harness file plus its hypothesis); code in a "
                        "plain reply is ignored. Use the tools to continue.")}
                    sent.append(reminder)
                    log.messages.append(dict(reminder))
                    continue
                for tc in tool_calls:
                    result = self._dispatch(tc, turn, tools, archive, proposals, seen, n, log)
                    msg = {"role": "tool", "tool_call_id": tc["id"], "content": result}
                    sent.append(msg)
                    log.messages.append(dict(msg))
                if len(proposals) >= n:
                    raise _Stop("done")
            raise _Stop(f"max_turns ({self.opts.max_turns}) reached with {len(proposals)} of {n} candidates written")
        except _Stop as stop:
            log.stop_reason = str(stop)
        except Exception as e:  # the phase goes on with whatever was written
            log.stop_reason = f"error: {type(e).__name__}: {e}"
        return proposals

    # ------------------------------------------------------------------------------ model calls
    def _complete(self, messages: list[dict[str, Any]], log: SessionLog, turn: int, limits: Limits) -> dict[str, Any]:
        """One model call with retries; the assistant message as a plain dict (tool calls normalised)."""
        import openai

        attempt = 0
        while True:
            wall_left = None if limits.max_wall_s is None else limits.max_wall_s - log.elapsed()
            timeout = self.endpoint.timeout_s
            if wall_left is not None:
                timeout = max(1.0, min(timeout, wall_left))
            request: dict[str, Any] = {
                "model": self.endpoint.model, "messages": messages, "tools": self._schemas, "tool_choice": "auto",
                self.opts.max_tokens_param: self.opts.max_output_tokens, "timeout": timeout,
            }
            if self.opts.temperature is not None:
                request["temperature"] = self.opts.temperature
            try:
                resp = self._client.chat.completions.create(**request)
                reply = self._parse(resp, messages, log)
                return reply
            except Exception as e:
                retryable, what, retry_after = self._classify(e, openai)
                if not retryable:
                    raise _Stop(f"error: {what}") from None
                if attempt >= self.endpoint.max_retries:
                    raise _Stop(f"error: {what} (gave up after {attempt} retries)") from None
                wait = self.opts.retry_backoff_s * (2 ** attempt) * (1.0 + 0.25 * random.random())
                wait = min(self.opts.retry_max_backoff_s, wait)
                if retry_after is not None:
                    wait = max(wait, min(retry_after, self.opts.retry_max_backoff_s))
                attempt += 1
                log.usage.retries += 1
                log.retries.append({"turn": turn, "attempt": attempt, "error": what, "wait_s": round(wait, 3)})
                if limits.max_wall_s is not None and log.elapsed() + wait >= limits.max_wall_s:
                    raise _Stop("budget: wall") from None
                self._sleep(wait)

    @staticmethod
    def _classify(e: Exception, openai: Any) -> tuple[bool, str, float | None]:
        """(retry?, a short description, the server's Retry-After in seconds)."""
        if isinstance(e, _Stop):
            raise e
        if isinstance(e, openai.APITimeoutError):
            return True, "timeout", None
        if isinstance(e, openai.APIConnectionError):
            return True, f"connection error: {e}", None
        if isinstance(e, openai.APIStatusError):
            status = e.status_code
            retry_after = None
            try:
                h = e.response.headers.get("retry-after")
                retry_after = float(h) if h is not None else None
            except (AttributeError, TypeError, ValueError):
                pass
            msg = f"HTTP {status}"
            try:
                body = e.response.text[:200]
                msg += f": {body}"
            except Exception:
                pass
            return (status == 429 or status >= 500 or status in (408, 409)), msg, retry_after
        if isinstance(e, (openai.APIResponseValidationError, ValueError, KeyError, TypeError, AttributeError)):
            return True, f"unusable response ({type(e).__name__}: {str(e)[:200]})", None
        return False, f"{type(e).__name__}: {str(e)[:300]}", None

    def _parse(self, resp: Any, messages: list[dict[str, Any]], log: SessionLog) -> dict[str, Any]:
        """Count the call's usage and turn its first choice into a message dict (ValueError if it has none)."""
        choices = getattr(resp, "choices", None)
        if not choices:
            raise ValueError("the response has no choices")
        msg = choices[0].message
        content = getattr(msg, "content", None)
        if content is not None and not isinstance(content, str):
            content = str(content)
        calls = []
        for i, tc in enumerate(getattr(msg, "tool_calls", None) or []):
            fn = getattr(tc, "function", None)
            if fn is None:
                continue
            calls.append({"id": getattr(tc, "id", None) or f"call_{len(log.messages)}_{i}", "type": "function",
                          "function": {"name": getattr(fn, "name", "") or "",
                                       "arguments": getattr(fn, "arguments", "") or ""}})
        usage = getattr(resp, "usage", None)
        u = log.usage
        u.calls += 1
        prompt = getattr(usage, "prompt_tokens", None) if usage is not None else None
        completion = getattr(usage, "completion_tokens", None) if usage is not None else None
        if prompt is None or completion is None:
            u.estimated_calls += 1
            prompt = estimate_tokens(json.dumps(messages, ensure_ascii=False))
            completion = estimate_tokens((content or "") + json.dumps(calls))
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        cached = int(getattr(details, "cached_tokens", 0) or 0)
        u.prompt_tokens += int(prompt)
        u.completion_tokens += int(completion)
        u.cached_tokens += cached
        u.cost_usd += cost_usd(self.price, int(prompt), int(completion), cached)
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        elif content is None:
            reply["content"] = ""  # an assistant message needs content or tool calls
        return reply

    def _elide(self, sent: list[dict[str, Any]]) -> None:
        """Keep the request under `llm.context_max_chars`: the oldest tool results are replaced by a note."""
        total = sum(len(json.dumps(m, ensure_ascii=False)) for m in sent)
        if total <= self.opts.context_max_chars:
            return
        note = "[elided to keep the context small; call the tool again if you need this]"
        last_assistant = max((i for i, m in enumerate(sent) if m["role"] == "assistant"), default=0)
        for m in sent[:last_assistant]:
            if total <= self.opts.context_max_chars:
                break
            if m["role"] == "tool" and m["content"] != note:
                total -= len(m["content"]) - len(note)
                m["content"] = note

    # ------------------------------------------------------------------------------ tools
    def _dispatch(self, tc: dict[str, Any], turn: int, tools: ArchiveTools, archive: Archive,
                  proposals: list[Proposal], seen: dict[str, str], n: int, log: SessionLog) -> str:
        name = tc["function"]["name"]
        raw = tc["function"]["arguments"]
        entry: dict[str, Any] = {"turn": turn, "name": name, "arguments": raw if len(str(raw)) <= 2000 else
                                 str(raw)[:2000] + "…", "ok": True}
        log.tool_calls.append(entry)
        try:
            if name not in self._props:
                raise ToolInputError(f"unknown tool {name!r}; the tools are {', '.join(self._props)}")
            args = parse_arguments(raw)
            schema = self._props[name]
            unknown = sorted(set(args) - set(schema["properties"]))
            if unknown:
                raise ToolInputError(f"unknown argument(s) {', '.join(unknown)}; {name} takes "
                                     f"{', '.join(schema['properties']) or 'no arguments'}")
            missing = [k for k in schema["required"] if k not in args]
            if missing:
                raise ToolInputError(f"missing argument(s) {', '.join(missing)}")
            for k, v in args.items():
                if not _type_ok(v, schema["properties"][k]):
                    raise ToolInputError(f"argument {k!r} must be {schema['properties'][k]['type']}, got {v!r:.80}")
            if name == "write_candidate":
                result = self._write(args, archive, proposals, seen, n, log)
            else:
                fn = {"list_files": tools.list_files, "read_file": tools.read_file, "grep": tools.grep,
                      "diff": tools.diff, "show_frontier": tools.frontier,
                      "list_candidates": tools.history}[name]
                result, read = fn(**args)
                for p in read:
                    log.read(p)
        except ToolInputError as e:
            entry.update(ok=False, error=str(e))
            result = f"error: {e}"
        except Exception as e:  # a tool must never end the session
            entry.update(ok=False, error=f"{type(e).__name__}: {e}")
            result = f"error: {type(e).__name__}: {e}"
        entry["chars"] = len(result)
        return result

    def _write(self, args: dict[str, Any], archive: Archive, proposals: list[Proposal], seen: dict[str, str],
               n: int, log: SessionLog) -> str:
        record: dict[str, Any] = {"name": f"write-{len(log.files_written) + 1}", "accepted": False}
        log.files_written.append(record)

        def reject(msg: str) -> str:
            record["error"] = msg
            raise ToolInputError(msg)

        if len(proposals) >= n:
            reject(f"you have already written {n} candidate(s), all this session takes; stop calling tools")
        code = _strip_fence(args["code"])
        hypothesis = " ".join(args["hypothesis"].split())
        record["chars"] = len(code)
        if not hypothesis:
            reject("the hypothesis is empty: say what you changed and why it should help")
        if len(hypothesis) > MAX_HYPOTHESIS_CHARS:
            reject(f"the hypothesis has {len(hypothesis)} characters; keep it under {MAX_HYPOTHESIS_CHARS}")
        if len(code) > MAX_CODE_CHARS:
            reject(f"the code has {len(code)} characters; the limit is {MAX_CODE_CHARS}")
        parent = args.get("parent")
        if parent is None:
            parent = default_parent(archive)
        elif parent not in archive:
            reject(f"parent {parent!r} is not a candidate of the archive")
        record["parent"] = parent
        record["hypothesis"] = hypothesis
        try:
            check_harness_source(code, "candidate.py")
        except HarnessError as e:
            reject(f"rejected, fix it and submit again: {e}")
        norm = normalize_code(code)
        if norm in seen:
            reject(f"this code is the same as {seen[norm]} (ignoring comments and layout); change something")
        seen[norm] = f"your candidate {len(proposals) + 1} of this session"
        proposals.append(Proposal(code=code, parent=parent, hypothesis=hypothesis))
        record["accepted"] = True
        record["index"] = len(proposals)
        left = n - len(proposals)
        return (f"accepted as candidate {len(proposals)} of {n} (parent {parent}); it will be smoke-tested and "
                f"evaluated after this session. " + (f"{left} more to write." if left else "That was the last one."))


__all__ = ["LLMProposer", "resolve_api_key", "is_loopback", "LOOPBACK_PLACEHOLDER_KEY"]

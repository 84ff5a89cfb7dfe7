"""The OpenAI wire format of the endpoint: request models, response and stream-chunk bodies, error objects.

Requests are validated here, field by field, so that a bad one is a 400 naming the field
(`{"error": {"message", "type", "param", "code"}}`), never a 500. Fields that would change what is generated
but are not implemented (`tools`, `response_format`, a non-zero penalty, `logit_bias`, `echo`) are refused
by name instead of being silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from whale_ray.policy.engine import MAX_TOP_LOGPROBS, GenerationOutput, decode_completion
from whale_ray.records import SamplingParams

MAX_N = 16
MISSING_LOGPROB = -9999.0  # a token outside top-k/top-p has log-prob -inf, which JSON cannot carry (vLLM's value)


class ApiError(Exception):
    """An OpenAI-style error reply: HTTP status, error object, extra headers (Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # not OpenAI's; vLLM's extension (extra_body={"top_k": 20}); 0 = off
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[dict[str, bool]] = None  # {"include_usage": true}
    user: Optional[str] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Union[str, list[str], None]) -> Union[str, list[str], None]:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling(self, max_tokens: int, top_logprobs: int, index: int) -> SamplingParams:
        """Choice `index`'s sampling: with a seed, choice i draws from seed + i (reproducible and distinct)."""
        seed = None if self.seed is None else self.seed + index
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, stop=self.stops(), seed=seed, top_logprobs=top_logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart], None] = None  # None: an assistant turn that only called tools
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[dict[str, Any]]] = None  # function schemas (whale_ray/serve/tools.py: Hermes format)
    tool_choice: Optional[Literal["auto", "none"]] = None  # a forced call cannot be guaranteed: refused
    parallel_tool_calls: Optional[bool] = None
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def uses_tools(self) -> bool:
        on = bool(self.tools) and self.tool_choice != "none"
        if on and self.stream:
            raise ApiError(400, "stream with tools is not supported (ask without stream)", param="stream")
        return on

    def budget(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens

    def alternatives(self) -> int:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self.top_logprobs or 0


class CompletionRequest(_Request):
    prompt: Union[str, list[str]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the legacy API: how many alternatives
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts or any(not p for p in prompts):
            raise ApiError(400, "prompt must be a non-empty string or a list of them", param="prompt")
        return prompts


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "TextPart", "function-after"}


def parse(model: type[BaseModel], raw: bytes) -> Any:
    """The request body as `model`, or a 400 naming the first bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # a Union field's loc names the member tried ("content.str"): the param is the field itself
        param = ".".join(str(x) for x in err["loc"] if str(x) not in _TYPE_TAGS and "[" not in str(x)) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"{param}: not supported by this endpoint", param=param,
                           code="unsupported_parameter") from None
        raise ApiError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None


# ---------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def fingerprint(version: int) -> str:
    return f"whale-v{version}"


def _lp(x: float) -> float:
    return x if x > MISSING_LOGPROB else MISSING_LOGPROB


def chat_logprobs(tokenizer: Any, out: GenerationOutput) -> dict[str, Any]:
    def entry(token_id: int, lp: float) -> dict[str, Any]:
        text = decode_completion(tokenizer, [token_id])
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    content = []
    for i, (token_id, lp) in enumerate(zip(out.completion_ids, out.logprobs)):
        alts = out.top_logprobs[i] if out.top_logprobs else []
        content.append({**entry(token_id, lp), "top_logprobs": [entry(a, b) for a, b in alts]})
    return {"content": content}


def completion_logprobs(tokenizer: Any, out: GenerationOutput) -> dict[str, Any]:
    tokens = [decode_completion(tokenizer, [t]) for t in out.completion_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    top = [{decode_completion(tokenizer, [a]): _lp(b) for a, b in alts} for alts in out.top_logprobs] or None
    return {"tokens": tokens, "token_logprobs": [_lp(x) for x in out.logprobs], "top_logprobs": top,
            "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def body(kind: str, rid: str, model: str, version: int, choices: list[dict[str, Any]],
         usage_: dict[str, int] | None) -> dict[str, Any]:
    """A whole reply or one stream chunk; `kind` is its OpenAI `object` ("chat.completion", ...)."""
    out = {"id": rid, "object": kind, "created": int(time.time()), "model": model,
           "system_fingerprint": fingerprint(version), "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

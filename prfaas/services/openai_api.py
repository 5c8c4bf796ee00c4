"""The OpenAI-compatible surface: request validation and response/chunk shapes for completions and chat."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prfaas.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 256
MAX_STOP = 4


@dataclass(frozen=True)
class CompletionRequest:
    chat: bool
    model: str
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    def tokenize_body(self) -> dict[str, Any]:
        return {"messages": self.messages} if self.chat else {"prompt": self.prompt}


def parse(body: Any, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequest("only n=1 is supported")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(f"stop must be a string or a list of at most {MAX_STOP} strings")
    options = body.get("stream_options") or {}
    return CompletionRequest(
        chat=chat, model=_text(body, "model", required=False), max_tokens=_max_tokens(body),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=_seed(body), stop=stop, stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)) if isinstance(options, dict) else False,
        ignore_eos=bool(body.get("ignore_eos", False)),
        prompt=None if chat else _prompt(body), messages=_messages(body) if chat else [])


def _text(body: dict[str, Any], key: str, required: bool = True) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or (required and not value):
        raise InvalidRequest(f"'{key}' must be a non-empty string")
    return value


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise InvalidRequest(f"'{key}' must be a number within [{lo:g}, {hi:g}]")
    return float(value)


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest("'max_tokens' must be a positive integer")
    return value


def _seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidRequest("'seed' must be an integer")
    return value


def _prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InvalidRequest("'prompt' must be a non-empty string or list of token ids (one prompt per request)")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise InvalidRequest(f"messages[{i}] needs a role of system, user, assistant or developer")
        out.append({"role": "system" if message["role"] == "developer" else message["role"],
                    "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def response(req: CompletionRequest, rid: str, model: str, text: str, finish: str, usage: dict[str, int],
             extension: dict[str, Any]) -> dict[str, Any]:
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "prfaas": extension}


def chunk(req: CompletionRequest, rid: str, model: str, text: str | None, finish: str | None,
          first: bool = False) -> dict[str, Any]:
    if req.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}

"""The OpenAI-compatible surface: request validation and response/chunk shapes for completions and chat."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from prfaas import fields as check
from prfaas.errors import InvalidRequest
from prfaas.messages import MAX_STOP, MAX_TOKENS, SEED_BITS, ResponseMeta, SamplingParams, TokenizeRequest

DEFAULT_MAX_TOKENS = 256


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

    def tokenize_request(self) -> TokenizeRequest:
        return TokenizeRequest(messages=self.messages) if self.chat else TokenizeRequest(prompt=self.prompt)


# Accepted by OpenAI but not served here: refused by name rather than silently ignored (a client that asks for
# logprobs must not get a 200 without them). A value that asks for nothing (null, false, empty) passes.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "functions",
               "response_format")


def parse(body: Any, chat: bool) -> CompletionRequest:
    """The request, every field checked; ``InvalidRequest`` (400, naming the field) for anything prfaas cannot
    serve exactly as asked. The sampling fields are checked by ``SamplingParams``, the same rules an instance
    applies to the internal bodies it receives."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _refuse_unsupported(body)
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise InvalidRequest("only n=1 is supported", param="n")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    seed = _seed(body)
    sampling = SamplingParams(temperature=_given(body, "temperature", 1.0), top_p=_given(body, "top_p", 1.0),
                              seed=seed or 0)
    return CompletionRequest(
        chat=chat, model=_text(body, "model", required=False), max_tokens=_max_tokens(body),
        temperature=sampling.temperature, top_p=sampling.top_p, seed=seed, stop=_stop(body),
        stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage", "stream_options.include_usage"),
        ignore_eos=_flag(body, "ignore_eos"),
        prompt=None if chat else _prompt(body), messages=_messages(body) if chat else [])


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in UNSUPPORTED:
        value = body.get(key)
        if not (value is None or value is False or _empty(value) or _NOTHING.get(key, _MISSING) == value):
            raise InvalidRequest(f"'{key}' is not supported by prfaas; leave it out", param=key)


_MISSING = object()
_NOTHING: dict[str, Any] = {"top_logprobs": 0, "best_of": 1, "response_format": {"type": "text"}}  # the defaults


def _empty(value: Any) -> bool:
    return isinstance(value, list | dict | str) and not value


def _flag(body: dict[str, Any], key: str, name: str = "") -> bool:
    value = body.get(key)
    return False if value is None else check.boolean(value, name or key)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop") or []
    return check.strings([stop] if isinstance(stop, str) else stop, "stop", MAX_STOP)


def _text(body: dict[str, Any], key: str, required: bool = True) -> str:
    value = body.get(key, "")
    if not isinstance(value, str) or (required and not value):
        raise InvalidRequest(f"'{key}' must be a non-empty string")
    return value


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    value = body.get(key)
    return default if value is None else value


def _max_tokens(body: dict[str, Any]) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    return None if value is None else check.integer(value, key, 1, MAX_TOKENS)


def _seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    return None if value is None else check.integer(value, "seed", -(1 << SEED_BITS), (1 << SEED_BITS) - 1)


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
             meta: ResponseMeta) -> dict[str, Any]:
    """A whole response; ``meta`` becomes its ``prfaas`` field."""
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if req.chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "prfaas": meta.to_json()}


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


def model_card(name: str, root: str, max_model_len: int) -> dict[str, Any]:
    """One entry of ``/v1/models`` in vLLM's shape (OpenAI's four fields plus ``root``, ``parent`` and
    ``max_model_len``)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "prfaas", "root": root, "parent": None,
            "max_model_len": max_model_len}

"""One streamed completion over the OpenAI API, timed: TTFT, inter-token gaps, E2E, output tokens, and the
``prfaas`` response field when the target is prfaas. Works against any OpenAI-compatible server (vLLM, SGLang).

Never raises for a failed request: the failure is returned in the record (``error``: the answer's error code, else
``HTTP_<status>``, or the transport failure; ``status``: the HTTP status; ``message``: the answer's message), so a
load run always completes and counts it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestRecord:
    start: float  # seconds since the run's epoch
    input_len: int
    max_tokens: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    status: int | None = None  # HTTP status of a refused request (None: answered 200, or no answer at all)
    message: str = ""  # what the target said about the failure
    prfaas: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Token-id prompt, greedy, and the usual 'exactly max_tokens' extensions (vLLM/SGLang honour them)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "min_tokens": max_tokens}
    if model:
        body["model"] = model
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], epoch: float,
               timeout_s: float) -> RequestRecord:
    started = time.perf_counter()
    record = RequestRecord(start=started - epoch, input_len=len(body["prompt"]), max_tokens=body["max_tokens"])
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as reply:
            if reply.status_code != 200:
                record.status = reply.status_code
                record.error, record.message = _error_of(reply.status_code, await reply.aread())
                return record
            await _consume(reply, record, started)
    except httpx.TimeoutException:
        record.error = "TIMEOUT"
    except httpx.HTTPError as exc:
        record.error, record.message = f"HTTP_ERROR: {type(exc).__name__}", str(exc)[:200]
    record.e2e_s = time.perf_counter() - started if record.error is None else None
    return record


async def _consume(reply: httpx.Response, record: RequestRecord, started: float) -> None:
    last: float | None = None
    chunks = 0
    async for line in reply.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        now = time.perf_counter()
        if "error" in event:
            record.error = str(event["error"].get("code") or event["error"].get("type") or "stream error")
            record.message = str(event["error"].get("message") or "")[:200]
            return
        if event.get("choices"):
            choice = event["choices"][0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if last is None:
                record.ttft_s, last, chunks = now - started, now, 1
            elif text:  # the closing chunk (finish_reason only) is not a token
                record.itl_s.append(now - last)
                last, chunks = now, chunks + 1
        if event.get("usage"):
            record.output_tokens = int(event["usage"].get("completion_tokens", 0))
        if "prfaas" in event:
            record.prfaas = event["prfaas"]
    record.output_tokens = record.output_tokens or chunks
    if record.ttft_s is None:
        record.error = "NO_TOKENS"


def _error_of(status: int, raw: bytes) -> tuple[str, str]:
    """(code, message) of a refusal: the OpenAI error body's code (else ``HTTP_<status>``) and message."""
    try:
        error = json.loads(raw).get("error") or {}
        return str(error.get("code") or f"HTTP_{status}"), str(error.get("message") or "")[:200]
    except (ValueError, AttributeError):
        return f"HTTP_{status}", raw[:200].decode(errors="replace")

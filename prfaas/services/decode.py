"""The decode role (datacenter B): pulls KV by ``kv_id``, verifies and restores it, acknowledges release, then
generates and streams tokens. Short prompts are prefilled here too (the local route).

Events (NDJSON to the router): ``token`` {text, token}, the first one with ``stages``; ``done`` {finish_reason,
completion_tokens}; or ``error`` {code, message}.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from prfaas.config import Config
from prfaas.errors import InvalidRequest, KVNotFound, PrfaasError
from prfaas.kv import BlobReader, KVState
from prfaas.messages import GenerateRequest, SamplingParams
from prfaas.obs import metrics
from prfaas.services.runner import EngineRunner
from prfaas.services.textstream import TextStream
from prfaas.store.abandon import release_abandoned
from prfaas.transfer import pull, release
from prfaas.transfer import stats as transfer_stats

CREATION_GRACE_S = 2.0  # relay mode: the header may still be on its way to the relay


class DecodeService:
    def __init__(self, engine: Any, config: Config) -> None:
        self.engine = engine
        self.config = config
        self.runner = EngineRunner()
        self.reserved_kv_bytes = 0
        self.fixed_bytes, self.bytes_per_token = engine.kv_footprint

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if "messages" in body:
            try:
                encoded = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
            except Exception as exc:
                raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"], add_special_tokens=False)
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            ids = body["prompt"]
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        return [int(t) for t in ids]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict[str, Any]]:
        """Holds a reservation of the sequence's KV bytes (prompt + max_tokens) while it runs, so the free KV
        memory in heartbeats is what new requests can really get."""
        need = self.fixed_bytes + self.bytes_per_token * (len(request.token_ids) + request.max_tokens)
        self.reserved_kv_bytes += need
        try:
            sampling = SamplingParams.from_json(request.sampling)
            stages, cache, first, position = await self._prepare(request, sampling)
            async for event in self._stream(request, sampling, cache, first, position, stages):
                yield event
        except PrfaasError as exc:
            yield {"event": "error", **exc.to_wire()}
        finally:
            self.reserved_kv_bytes -= need

    async def _prepare(self, request: GenerateRequest,
                       sampling: SamplingParams) -> tuple[dict[str, float], Any, int, int]:
        if not request.kv_id:
            started = time.perf_counter()
            cache, first, seconds = await self.runner.run(self.engine.prefill_cache, request.token_ids, None,
                                                          sampling, request.step_offset)
            queued = time.perf_counter() - started - seconds
            return {"queue_ms": queued * 1e3, "prefill_ms": seconds * 1e3}, cache, first, len(request.token_ids)
        started = time.perf_counter()
        try:
            kv = await self._pull(request)
        except BaseException:  # failed or cancelled (the client left): this consumer gives the blob up now
            await release_abandoned(request.kv_address, request.kv_id)
            raise
        pulled = time.perf_counter()
        try:
            cache = await self.runner.run(self.engine.restore, kv)
        finally:
            await release(request.kv_address, request.kv_id, timeout_s=5.0)
        restored = time.perf_counter()
        metrics.TRANSFER_SECONDS.observe(pulled - started)
        stages = {"transfer_ms": (pulled - started) * 1e3, "restore_ms": (restored - pulled) * 1e3}
        if kv.first_token is None:
            raise InvalidRequest("the KV blob carries no first token")
        return stages, cache, kv.first_token, kv.seq_len

    async def _pull(self, request: GenerateRequest) -> KVState:
        deadline = time.monotonic() + CREATION_GRACE_S
        timeout_s = self.config.kv_transfer_timeout_ms / 1e3 + 10.0
        while True:
            reader = BlobReader()
            try:
                kv = await pull(request.kv_address, request.kv_id, reader, timeout_s=timeout_s,
                                retries=self.config.kv_retry_budget, streams=self.config.transfer_streams,
                                limit=transfer_stats.process_limit(self.config.max_inflight_kv))
                metrics.TRANSFER_BYTES.inc(kv.nbytes)
                return kv
            except KVNotFound:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)

    async def _stream(self, request: GenerateRequest, sampling: SamplingParams, cache: Any, first: int,
                      position: int, stages: dict[str, float]) -> AsyncIterator[dict[str, Any]]:
        text = TextStream(self.engine.tokenizer, request.stop)
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        halt = threading.Event()
        loop = asyncio.get_running_loop()

        def produce() -> None:
            try:
                for token in self.engine.stream(cache, first, position, request.max_tokens - 1, sampling,
                                                request.step_offset + 1):
                    loop.call_soon_threadsafe(queue.put_nowait, token)
                    if halt.is_set():
                        break
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        producer = asyncio.ensure_future(self.runner.run(produce))
        count, extra = 0, {"stages": stages}
        token: int | None = first
        try:
            while token is not None:
                count += 1
                delta = text.feed(token)
                yield {"event": "token", "token": token, "text": delta, **extra}
                extra = {}
                if text.stopped or token in self.engine.eos_token_ids:
                    break
                token = await queue.get()
        finally:
            halt.set()
            await producer
        reason = "stop" if text.stopped or token in self.engine.eos_token_ids else "length"
        tail = text.flush()
        yield {"event": "done", "finish_reason": reason, "completion_tokens": count, "text": tail}

    def load(self) -> dict[str, int]:
        budget = self.config.store_budget_bytes
        return {"queue_depth": self.runner.queue_depth, "free_kv_bytes": max(0, budget - self.reserved_kv_bytes),
                "kv_budget_bytes": budget, "kv_bytes_per_token": self.bytes_per_token,
                "kv_fixed_bytes": self.fixed_bytes}

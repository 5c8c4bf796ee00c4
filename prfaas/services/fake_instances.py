"""``FakeInstances``: an in-memory ``InstanceClient`` whose prefill and decode instances answer from a script.

The router's rules (routing, fallback, resume, queueing, tenancy, the ``prfaas`` field) run on it unchanged, in
one process and in milliseconds; what only real processes prove (sockets, TLS, the data plane, engines) stays in
the multi-process tests. The fake keeps the contracts the real instances keep:
- a prefill creates its blob under the router's ``kv_id`` at the address decode pulls from (``push_to``, or its
  own ``kv_address``) before ``Accepted``, completes it before ``PrefillDone``, drops it before ``Failed``;
- a decode given a ``kv_id`` waits for that blob, answers ``Failed`` (``KV_NOT_FOUND``) if it never completes,
  and releases it once restored (before its first token); a decode that fails a pull releases it too;
- token ids depend only on the sampling step (``token_at``), so a stream resumed with ``step_offset`` continues
  where the dead instance stopped, and remote and local prefill yield the same tokens.
``blobs`` holds every blob not yet released: empty after each request is the leak check.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from prfaas.errors import InstanceUnreachable, KVNotFound, PrfaasError
from prfaas.events import Accepted, Done, Failed, GenerateEvent, PrefillDone, PrefillEvent, Stages, Token
from prfaas.kv import Fingerprint
from prfaas.messages import GenerateRequest, InstanceInfo, Message, PrefillRequest, TokenizeRequest

FINGERPRINT = Fingerprint("fake-model", "llama", "w0", "t0", "float32", 4096)
BLOB_WAIT_S = 1.0  # how long a fake decode waits for a blob still being written


@dataclass
class PrefillScript:
    """How one fake prefill instance answers ``/prefill``."""

    unreachable: bool = False  # connection refused: ``InstanceUnreachable`` before any event
    refuse: PrfaasError | None = None  # ``Failed`` before ``Accepted`` (store full, prompt refused)
    fail_after_accept: PrfaasError | None = None  # ``Failed`` instead of ``PrefillDone``; the blob is dropped
    lost_after_blob: bool = False  # completes the blob, then drops the connection instead of ``PrefillDone``
    first_token_at_accept: bool = False  # as on vLLM: completes the blob, then ``Accepted`` says the first token
    kv_bytes_per_token: int = 64
    prefill_ms: float = 5.0
    queue_ms: float = 1.0


@dataclass
class DecodeScript:
    """How one fake decode instance answers ``/generate`` and ``/tokenize``."""

    unreachable: bool = False  # connection refused: ``InstanceUnreachable`` before any event
    die_after: int | None = None  # drops the connection after streaming this many tokens
    fail: PrfaasError | None = None  # ``Failed`` before the first token
    refuse_tokenize: PrfaasError | None = None
    stop_at_step: int | None = None  # the step whose token completes a stop sequence: ``Done("stop")``
    recompute: bool = False  # a remote prompt's KV not used (vLLM recomputes it): ``Done.recomputed`` says so
    token_delay_s: float = 0.0
    transfer_ms: float = 3.0
    restore_ms: float = 1.0


@dataclass
class _Blob:
    address: str
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    complete: bool = False


@dataclass
class Call:
    operation: str  # prefill, generate, tokenize
    instance_id: str
    request: Message | TokenizeRequest


def token_at(step: int) -> int:
    """The token a fake instance samples at ``step`` of a sequence."""
    return 1000 + step


def text_of(token: int) -> str:
    return f" w{token}"


class FakeInstances:
    """``InstanceClient`` in memory. Scripts are per instance id; an instance without one answers normally."""

    def __init__(self) -> None:
        self.prefills: dict[str, PrefillScript] = {}
        self.decodes: dict[str, DecodeScript] = {}
        self.blobs: dict[str, _Blob] = {}  # kv_id → blob not yet released
        self.calls: list[Call] = []
        self.released: list[str] = []  # kv_ids released by the router (decode's own releases are not listed)

    def info(self, role: str, instance_id: str, datacenter: str = "dc-b", **fields: Any) -> InstanceInfo:
        """An instance's registration: decode instances with a KV budget and a context, every one fingerprinted."""
        sizes = {"max_seq_len": 4096, "kv_budget_bytes": 1 << 30, "free_kv_bytes": 1 << 30,
                 "kv_bytes_per_token": 64} if role == "decode" else {}
        return InstanceInfo(instance_id=instance_id, role=role, url=f"fake://{instance_id}",
                            kv_address=f"{instance_id}:1", datacenter=datacenter,
                            fingerprint=FINGERPRINT.to_wire() if role != "relay" else {}, **{**sizes, **fields})

    def calls_to(self, operation: str, instance_id: str | None = None) -> list[Any]:
        return [c.request for c in self.calls
                if c.operation == operation and instance_id in (None, c.instance_id)]

    async def prefill(self, instance: InstanceInfo, request: PrefillRequest) -> AsyncGenerator[PrefillEvent, None]:
        self._called("prefill", instance, request)
        script = self.prefills.setdefault(instance.instance_id, PrefillScript())
        self._reach(instance, script.unreachable)
        if script.refuse is not None:
            yield Failed.of(script.refuse)
            return
        blob = self.blobs[request.kv_id] = _Blob(request.push_to or instance.kv_address)
        if script.first_token_at_accept:
            blob.complete = True
            blob.settled.set()
            yield Accepted(first_token=token_at(0), first_text=text_of(token_at(0)), kv_tokens=len(request.token_ids))
        else:
            yield Accepted()
        if script.fail_after_accept is not None:
            self._drop(request.kv_id)
            yield Failed.of(script.fail_after_accept)
            return
        blob.complete = True
        blob.settled.set()
        await asyncio.sleep(0)  # the blob is there before its trailer's news: decode may take it first
        self._reach(instance, script.lost_after_blob)
        yield PrefillDone(first_token=token_at(0), kv_bytes=script.kv_bytes_per_token * len(request.token_ids),
                          chunks=1, prefill_ms=script.prefill_ms, queue_ms=script.queue_ms)

    async def generate(self, instance: InstanceInfo, request: GenerateRequest) -> AsyncGenerator[GenerateEvent, None]:
        script = self._decode(instance, "generate", request)
        stages = Stages(queue_ms=0.5, prefill_ms=2.0)  # a local prefill's
        if request.first_token >= 0:  # as vLLM's decode: prefill's first token at once, then the pull
            yield Token(token=request.first_token, text=request.first_text, stages=Stages(decode_ms=0.0))
            if request.max_tokens == 1:
                self._drop(request.kv_id)
                yield Done(finish_reason="length", completion_tokens=1)
                return
            request, sent = replace(request, max_tokens=request.max_tokens - 1, step_offset=request.step_offset + 1), 1
        else:
            sent = 0
        if request.kv_id:
            pulled = await self._pull(request)
            if pulled is not None:
                yield pulled
                return
            stages = Stages(transfer_ms=script.transfer_ms, restore_ms=script.restore_ms)
        if script.fail is not None:
            yield Failed.of(script.fail)
            return
        async for event in self._tokens(instance, request, script, None if sent else stages, sent):
            yield event

    async def tokenize(self, instance: InstanceInfo, request: TokenizeRequest) -> list[int]:
        script = self._decode(instance, "tokenize", request)
        if script.refuse_tokenize is not None:
            raise script.refuse_tokenize
        if isinstance(request.prompt, list):
            return [int(t) for t in request.prompt]
        text = request.prompt if isinstance(request.prompt, str) else " ".join(
            str(m.get("content", "")) for m in request.messages or [])
        return [1 + len(word) for word in text.split()] or [1]

    async def release(self, kv_address: str, kv_id: str) -> None:
        blob = self.blobs.get(kv_id)
        if blob is not None and blob.address == kv_address:
            self.released.append(kv_id)
            self._drop(kv_id)

    def _decode(self, instance: InstanceInfo, operation: str, request: Message | TokenizeRequest) -> DecodeScript:
        self._called(operation, instance, request)
        script = self.decodes.setdefault(instance.instance_id, DecodeScript())
        self._reach(instance, script.unreachable)
        return script

    def _called(self, operation: str, instance: InstanceInfo, request: Message | TokenizeRequest) -> None:
        self.calls.append(Call(operation, instance.instance_id, request))

    @staticmethod
    def _reach(instance: InstanceInfo, unreachable: bool) -> None:
        if unreachable:
            raise InstanceUnreachable(f"{instance.instance_id} could not be reached: connection refused",
                                      instance.instance_id)

    async def _pull(self, request: GenerateRequest) -> Failed | None:
        """Wait for the blob and consume it (restored: released); a ``Failed`` if it never completes."""
        blob = self.blobs.get(request.kv_id)
        if blob is not None and blob.address == request.kv_address:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(blob.settled.wait(), BLOB_WAIT_S)
        if blob is None or not blob.complete:
            self._drop(request.kv_id)  # a consumer whose pull failed gives the blob up
            return Failed.of(KVNotFound(f"no blob {request.kv_id} at {request.kv_address}"))
        self._drop(request.kv_id)
        return None

    async def _tokens(self, instance: InstanceInfo, request: GenerateRequest, script: DecodeScript,
                      stages: Stages | None, sent: int = 0) -> AsyncGenerator[GenerateEvent, None]:
        """``sent``: tokens this stream already carried (prefill's first one)."""
        for count in range(request.max_tokens):
            if script.die_after is not None and count >= script.die_after:
                raise InstanceUnreachable(f"{instance.instance_id} dropped the stream", instance.instance_id)
            await asyncio.sleep(script.token_delay_s)
            step = request.step_offset + count
            yield Token(token=token_at(step), text=text_of(token_at(step)), stages=stages if count == 0 else None)
            if step == script.stop_at_step:
                yield Done(finish_reason="stop", completion_tokens=sent + count + 1)
                return
        recomputed = len(request.token_ids) - 1 if script.recompute and request.kv_id else 0
        yield Done(finish_reason="length", completion_tokens=sent + request.max_tokens, recomputed=recomputed)

    def _drop(self, kv_id: str) -> None:
        blob = self.blobs.pop(kv_id, None)
        if blob is not None:
            blob.settled.set()

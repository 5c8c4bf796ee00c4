"""A prefill or decode instance with vLLM as its engine (``prfaas serve prefill|decode --engine vllm``).

The instance keeps prfaas's side unchanged — registration, heartbeats, drain, the router's internal protocol —
and translates that protocol into vLLM's P/D requests to its child vLLM server (``prfaas.vllm.server``):

- ``/prefill`` (router → prefill): vLLM ``/v1/completions`` with the prompt's token ids, ``max_tokens: 1`` and
  ``kv_transfer_params {do_remote_decode, kv_id, relay}``: the router's ``kv_id``, and the relay it named
  (``push_to``; none: the blob stays in the producer's own store, served on this instance's KV address). Once vLLM
  answers, ``accepted`` (the router then dispatches decode) and ``done`` with vLLM's first token and the blob's KV
  bytes; a failure before that is an ``error`` instead of ``accepted``, so the router falls back to local prefill.
  Why not ``accepted`` at once, so that decode's pull overlaps the prefill as on prfaas's engine: a vLLM request
  waiting for remote KV keeps its engine loop stepping every millisecond, and on shared cores that starved the
  producer's prefill (341 tokens took 26 s instead of about 1 s with vLLM's reader spin; without it, as
  ``prfaas.vllm.launch`` starts vLLM, still twice the prefill alone: ``benchmarks/vllm_spin.py``); in relay mode
  the pull still overlaps the push.
- ``/generate`` (router → decode): vLLM streaming ``/v1/completions`` with the token ids and, on the remote
  route, ``kv_transfer_params {do_remote_prefill, kv_id, kv_address}``; each generated token id becomes a
  ``token`` event (``return_token_ids``), then ``done``. The connector restores the KV, releases the blob, and
  recomputes the prompt itself if the KV cannot be had (``kv_load_failure_policy: recompute``). The stream's last
  chunk (``include_usage``; vLLM runs with ``--enable-prompt-tokens-details``) says how many prompt tokens vLLM
  did not compute (``cached_tokens``: those it restored); ``done``'s ``recomputed`` is the rest but the last token
  (which vLLM always computes, for its logits), so the router reports a prompt recomputed after a failed pull as
  prefilled locally (``fallback``), not as remote. Where the router passes on the first token the prefill's vLLM
  sampled (``accepted`` says it, ``_accepted``), that token goes out at once and vLLM continues from the prompt
  plus it (``known_first`` says where that is exact), so the client's first token does not wait for the pull,
  the restore and a step of decode's vLLM.
- ``/tokenize``: vLLM's ``/tokenize`` (the chat template, the same tokenizer as the weights).

Load for the heartbeat comes from vLLM's ``/metrics``; the fingerprint from the connector (weights, tokenizer and
KV layout), so the router never pairs a vLLM instance with a prfaas-engine one (``KV_INCOMPATIBLE`` at
registration). Tenants' codec and TTL overrides are not applied on this engine (the connector's settings are).
"""

from __future__ import annotations

import json
import math
import ssl
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from prfaas.config import Config
from prfaas.errors import InvalidRequest, KVUnavailable, PrfaasError
from prfaas.events import Accepted, Done, Failed, GenerateEvent, PrefillDone, PrefillEvent, Stages, Token
from prfaas.messages import GenerateRequest, PrefillRequest, SamplingParams, TcpPeer
from prfaas.services.instance import Instance
from prfaas.tenancy.clusters import DEFAULT_POLICY, ClusterPolicy
from prfaas.transfer.abandon import release_abandoned
from prfaas.vllm.server import LaunchSpec, VllmServer, eager, free_port, resolve_model, vllm_python

CREATION_GRACE_S = 5.0  # relay mode: the push that creates the blob may be a moment behind vLLM's answer
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)


def start(instance: Instance) -> VllmPrefill | VllmDecode:
    """Start this instance's vLLM server (bounded), fill in what the instance advertises, and return the role's
    service; the server is stopped when the instance closes (or here, if anything fails)."""
    options, config = instance.options, instance.config
    vllm_python()  # a missing vLLM, or a bad setting of it, says so first, before the model is resolved
    eager()
    model_dir, dtype = resolve_model(options.model, options.dtype)
    extra = _connector_settings(config)
    if options.role == "prefill":
        bound = f"{options.host}:{options.kv_port or free_port(options.host)}"
        extra.update(kv_address=bound, relay_from_request=True)
        instance.kv_address = options.advertise_kv or bound
    else:
        extra.update(creation_grace_s=CREATION_GRACE_S)
    server = VllmServer(LaunchSpec(model_dir, options.model, dtype,
                                   "kv_producer" if options.role == "prefill" else "kv_consumer", extra),
                        on_death=instance.fail)
    instance.closers.append(server.stop)
    server.start()
    instance.fingerprint = dict(server.info["fingerprint"])
    instance.model, instance.max_seq_len = options.model, server.max_model_len
    instance.model_root = model_dir  # vLLM loads its tokenizer from the directory it serves
    if options.role == "prefill":
        return VllmPrefill(server, config)
    return VllmDecode(server, config, instance.security.client_ssl())


def _connector_settings(config: Config) -> dict[str, Any]:
    """The connector's settings from prfaas's config (the data plane's codec, chunks, timeouts, retries, TLS)."""
    extra: dict[str, Any] = {"codec": config.kv_codec, "chunk_kb": config.chunk_size_kb,
                             "store_budget_mb": config.store_budget_mb, "kv_ttl_s": config.kv_ttl_seconds,
                             "kv_transfer_timeout_s": max(2.0, config.kv_transfer_timeout_ms / 1e3),
                             "retries": config.kv_retry_budget}
    tls = config.tls
    if tls.ca or tls.cert:
        extra["tls"] = {"ca": tls.ca, "cert": tls.cert, "key": tls.key, "required": tls.required, "crl": tls.crl}
    return extra


class _VllmService:
    def __init__(self, server: VllmServer, config: Config) -> None:
        self.server = server
        self.config = config
        self.client = httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT)

    def _body(self, token_ids: list[int], sampling: SamplingParams, max_tokens: int) -> dict[str, Any]:
        return {"model": self.server.spec.served_name, "prompt": token_ids, "max_tokens": max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
                "return_token_ids": True}

    def _kv_budget(self) -> int:
        return int(self.server.info.get("kv_budget_bytes", 0))

    def tcp_peers(self) -> list[TcpPeer]:
        """``TCP_INFO`` per peer of the connector's pulls (decode) or pushes (prefill, relay mode): the connector
        runs in vLLM's process and hands them over in a file (``VllmServer.tcp_peers``)."""
        return self.server.tcp_peers

    def load(self) -> dict[str, int]:
        load, budget = self.server.load, self._kv_budget()
        return {"queue_depth": load.waiting + load.running,
                "free_kv_bytes": max(0, int(budget * (1.0 - load.kv_usage)))}


class VllmPrefill(_VllmService):
    """The prefill role on vLLM: its connector owns the blob from the first saved layer (own store or push)."""

    async def prefill(self, request: PrefillRequest, cluster: ClusterPolicy = DEFAULT_POLICY
                      ) -> AsyncIterator[PrefillEvent]:
        """``accepted``, then ``done`` (first token, KV bytes) or ``error``. ``cluster`` is not used: vLLM's own
        scheduler orders its queue (the pool's quotas and metering apply in front of it, ``PrefillServer``)."""
        arrived = time.perf_counter()
        try:
            self._check(request)
            params = {"do_remote_decode": True, "kv_id": request.kv_id}
            if request.push_to:
                params["relay"] = request.push_to
            body = {**self._body(request.token_ids, request.sampling, 1), "kv_transfer_params": params}
            answer = _answer(await self.client.post("/v1/completions", json=body))
            done = self._done(request, answer, time.perf_counter() - arrived)
            yield _accepted(request, answer)
            yield done
        except (PrfaasError, httpx.HTTPError) as exc:
            yield _failure(exc)

    def _check(self, request: PrefillRequest) -> None:
        if len(request.token_ids) >= self.server.max_model_len:
            raise InvalidRequest(f"the prompt has {len(request.token_ids)} tokens; this vLLM server's context is "
                                 f"{self.server.max_model_len}")

    def _done(self, request: PrefillRequest, answer: dict[str, Any], seconds: float) -> PrefillDone:
        params = answer.get("kv_transfer_params") or {}
        if params.get("kv_id") != request.kv_id:
            raise KVUnavailable("vLLM did not save the prompt's KV (see the prefill instance's log)")
        kv_bytes = int(params.get("kv_bytes", 0))
        return PrefillDone(first_token=int(answer["choices"][0]["token_ids"][0]), kv_bytes=kv_bytes,
                           chunks=math.ceil(kv_bytes / self.config.chunk_bytes), prefill_ms=seconds * 1e3,
                           queue_ms=0.0)


def _accepted(request: PrefillRequest, answer: dict[str, Any]) -> Accepted:
    """``accepted`` with vLLM's first token, for decode to stream at once, where it is the answer's first token:
    the blob covers the whole prompt (a model with a state group holds its last token back, so vLLM's one token
    there follows the prompt but one) and the token did not end the sequence (decode then computes it again and
    stops there, as vLLM alone would)."""
    choice = answer["choices"][0]
    covered = int((answer.get("kv_transfer_params") or {}).get("kv_tokens", 0))
    if covered != len(request.token_ids) or choice.get("finish_reason") != "length":
        return Accepted()
    return Accepted(first_token=int(choice["token_ids"][0]), first_text=str(choice.get("text") or ""),
                    kv_tokens=covered)


class VllmDecode(_VllmService):
    """The decode role on vLLM: vLLM's connector pulls, verifies, restores and releases the KV."""

    def __init__(self, server: VllmServer, config: Config, kv_ssl: ssl.SSLContext | None = None) -> None:
        """``kv_ssl``: the role's client TLS for the data plane (releasing a blob vLLM never pulls)."""
        super().__init__(server, config)
        self.kv_ssl = kv_ssl

    def load(self) -> dict[str, int]:
        """vLLM's queue and free KV cache, and the sizes the router's placement reserves by."""
        return {**super().load(), "kv_budget_bytes": self._kv_budget(),
                "kv_bytes_per_token": int(self.server.info.get("kv_bytes_per_token", 0)), "kv_fixed_bytes": 0}

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        if "messages" in body:
            ask: dict[str, Any] = {"messages": body["messages"], "add_generation_prompt": True}
        elif isinstance(prompt, str):
            ask = {"prompt": prompt, "add_special_tokens": False}
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        answer = _answer(await self.client.post("/tokenize", json={"model": self.server.spec.served_name, **ask}))
        return [int(t) for t in answer["tokens"]]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateEvent]:
        """``token`` events (one per token id, the chunk's text on its last), then ``done``; or ``error``.
        With the first token prefill sampled (``known_first``), that token at once, then vLLM on the prompt and
        it, for one token less: vLLM's first step over the pulled KV computes the second token, not the first
        again."""
        first = known_first(request)
        token_ids, max_tokens = request.token_ids, request.max_tokens
        if first is not None:
            yield first
            if max_tokens == 1:  # nothing left for vLLM: the blob is only released
                await release_abandoned(request.kv_address, request.kv_id, ssl=self.kv_ssl)
                yield Done(finish_reason="length", completion_tokens=1)
                return
            token_ids, max_tokens = [*token_ids, first.token], max_tokens - 1
        body = {**self._body(token_ids, request.sampling, max_tokens), "stream": True,
                "stream_options": {"include_usage": True}, "stop": request.stop, "ignore_eos": request.ignore_eos}
        if request.kv_id:
            params: dict[str, Any] = {"do_remote_prefill": True, "kv_id": request.kv_id,
                                      "kv_address": request.kv_address}
            body["kv_transfer_params"] = {**params, "kv_tokens": request.kv_tokens} if request.kv_tokens else params
        try:  # a failure after prefill's token: the router resumes elsewhere and releases the blob
            async for event in self._stream(body, remote=bool(request.kv_id), sent=0 if first is None else 1):
                yield event
        except (PrfaasError, httpx.HTTPError) as exc:
            yield _failure(exc)

    async def _stream(self, body: dict[str, Any], remote: bool, sent: int) -> AsyncIterator[GenerateEvent]:
        """``sent``: tokens already streamed before vLLM's (prefill's first one)."""
        count, rest, reason, started = sent, "", "length", time.perf_counter()
        usage: dict[str, Any] = {}
        async with self.client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                _answer(reply)
            async for chunk in _chunks(reply):
                usage = chunk.get("usage") or usage
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                ids, text = list(choice.get("token_ids") or ()), str(choice.get("text") or "")
                for i, token in enumerate(ids):
                    first = Stages(decode_ms=(time.perf_counter() - started) * 1e3) if count == 0 else None
                    count += 1
                    yield Token(token=int(token), text=text if i == len(ids) - 1 else "", stages=first)
                rest += "" if ids else text
                reason = _finish(choice.get("finish_reason")) or reason
        yield Done(finish_reason=reason, completion_tokens=count, text=rest,
                   recomputed=recomputed_tokens(usage) if remote else 0)


def known_first(request: GenerateRequest) -> Token | None:
    """The first token prefill sampled, as the stream's first ``token``, where streaming it and continuing vLLM
    from the next one gives exactly what vLLM alone would: a remote prompt whose blob covers all of it, greedy
    (vLLM's seeded sampler would be a step behind), no stop strings (one could span the first two tokens'
    text), text that does not end inside a character (vLLM's detokenizer would still be holding bytes), not a
    resumed stream. Otherwise None: vLLM computes the first token again after the pull."""
    if (request.first_token < 0 or not request.kv_id or request.kv_tokens != len(request.token_ids)
            or request.step_offset or request.stop or request.sampling.temperature > 0
            or request.first_text.endswith("\ufffd")):
        return None
    return Token(token=request.first_token, text=request.first_text, stages=Stages(decode_ms=0.0))


async def _chunks(reply: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Each server-sent chunk of a vLLM stream, up to ``[DONE]``."""
    async for line in reply.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:
            raise KVUnavailable(f"vLLM failed mid-stream: {_message(chunk)}")
        yield chunk


def recomputed_tokens(usage: dict[str, Any]) -> int:
    """Prompt tokens vLLM computed although their KV was sent, from the stream's final ``usage``: all but the
    ``cached_tokens`` it restored and the last one, which it always computes. 0 when vLLM does not say."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None or "prompt_tokens" not in usage:
        return 0
    return max(0, int(usage["prompt_tokens"]) - 1 - int(cached))


def _finish(reason: Any) -> str | None:
    if reason in (None, "stop", "length"):
        return reason
    raise KVUnavailable(f"vLLM ended the request: {reason}")


def _answer(reply: httpx.Response) -> dict[str, Any]:
    """vLLM's JSON answer; its refusal mapped to prfaas's errors (a 4xx: the request's fault)."""
    try:
        body = reply.json()
    except ValueError:
        body = {}
    if reply.status_code == 200 and isinstance(body, dict):
        return body
    message = f"vLLM answered HTTP {reply.status_code}: {_message(body)}"
    raise InvalidRequest(message) if 400 <= reply.status_code < 500 else KVUnavailable(message)


def _message(body: Any) -> str:
    if not isinstance(body, dict):
        return str(body)[:300]
    error = body.get("error")
    return str(error.get("message") if isinstance(error, dict) else error or body.get("message", ""))[:300]


def _failure(exc: PrfaasError | httpx.HTTPError) -> Failed:
    """The ``error`` event of a failed vLLM call: a prfaas error as it is, an HTTP failure as ``KV_UNAVAILABLE``."""
    error = exc if isinstance(exc, PrfaasError) else KVUnavailable(f"vLLM did not answer: {exc!r}")
    return Failed.of(error)

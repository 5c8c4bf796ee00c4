"""The router: the only public endpoint. OpenAI API in, routing decisions, tokens streamed back.

Instances register and heartbeat on ``/internal/*``; ``/health`` is 200 only when every role of the deployment
has a healthy instance; ``/admin/kv`` gathers the stores' contents and deletion records (for operators and the
leak checks of the tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from prfaas.config import Config
from prfaas.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    KVIncompatible,
    KVTruncated,
    KVUnauthorized,
    KVUnavailable,
    ModelNotFound,
    PrfaasError,
    RateLimited,
)
from prfaas.events import Done
from prfaas.messages import InstanceInfo, SamplingParams
from prfaas.obs import metrics
from prfaas.ratelimit import TokenBucket
from prfaas.scheduler import Scheduler
from prfaas.scheduler.links import feed_tcp, link_name
from prfaas.security import apikeys, guards, registration
from prfaas.security.asgi import peer_of
from prfaas.security.identity import Peer
from prfaas.security.runtime import PLAINTEXT, Security
from prfaas.services import admin_routes, drain, http, jsonbody, openai_api, pool_weights
from prfaas.services.dispatch import Dispatcher, Job, Streamed
from prfaas.services.instance_client import HttpInstanceClient, InstanceClient
from prfaas.services.registry import Registry
from prfaas.services.signals import Signals
from prfaas.services.tokenizing import LocalTokenizers
from prfaas.tenancy import DEFAULT_TENANT, TenantPolicy, Tenants, clusters, metering, redact
from prfaas.transfer.abandon import Releaser

log = logging.getLogger("prfaas.router")


class Router:
    def __init__(self, config: Config, mode: str = "relay", instances: InstanceClient | None = None,
                 security: Security = PLAINTEXT) -> None:
        """``instances``: how requests reach the instances; HTTP (``HttpInstanceClient``) unless given.
        ``security``: the router's TLS (``Security.of(config, "router")``), plaintext unless given."""
        if mode not in ("relay", "direct"):
            raise InvalidRequest("mode must be relay or direct")
        self.config = config
        self.mode = mode
        self.security = security
        self.registry = Registry(config.common.heartbeat_timeout_ms / 1e3,
                                 pools={**config.router.pools, **pool_weights.load(config.router.pool_weights_file)})
        self.scheduler = Scheduler(config.router, mode, chunk_bytes=config.transfer.chunk_bytes)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0), verify=security.http_verify())
        cluster = clusters.router_headers(clusters.parse_clusters(config.clusters), config.router.cluster)
        self.releaser = Releaser(security.client_ssl())  # abandoned blobs' releases, retried while unreachable
        self.instances = instances or HttpInstanceClient(self.client, self.releaser, cluster)
        self.dispatcher = Dispatcher(self.registry, self.scheduler, config, self.instances)
        self.tokenizers = LocalTokenizers(config.router.local_tokenizer)  # else through a decode instance
        self.signals = Signals()  # what an autoscaler reads (/admin/signals, prfaas admin recommend)
        self.tenants = Tenants.from_config(config.tenants,
                                           [k.tenant for k in apikeys.parse_keys(config.common.api_keys)])
        self.meter = metering.Meter(metering.router_log_path(config.store.audit_log), config.common.datacenter)

    def required_roles(self) -> tuple[str, ...]:
        return ("prefill", "decode", "relay") if self.mode == "relay" else ("prefill", "decode")

    def ready(self) -> bool:
        return all(self.registry.healthy(role) for role in self.required_roles())

    @property
    def model_name(self) -> str:
        return self.registry.fingerprint.model if self.registry.fingerprint else ""

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: each model name served, the deployment's first. ``root`` is the directory its decode
        instances load the tokenizer from, as vLLM answers (``vllm bench serve`` without ``--model`` loads the
        tokenizer from it; every load tool given it as the model name does), and a request may name the model by
        it; ``max_model_len`` is the context its decode instances take."""
        names = dict.fromkeys([self.model_name, *(f.model for f in self.registry.models.values())])
        return [openai_api.model_card(name, *self._served(name)) for name in names if name]

    def _served(self, name: str) -> tuple[str, int]:
        """(root, context) of a model name; the name itself as root where no decode instance gave one."""
        pools = [key for key, fingerprint in self.registry.models.items() if fingerprint.model == name]
        roots = [root for key in pools for root in self.registry.roots(key)]
        lengths = [i.max_seq_len for key in pools for i in self.registry.healthy("decode", key) if i.max_seq_len]
        context = min(lengths) if lengths else self.registry.models[pools[0]].max_seq_len
        return (roots[0] if roots else name), context

    async def complete(self, body: Any, chat: bool, tenant: str = DEFAULT_TENANT) -> Any:
        try:
            return await self._complete(body, chat, self.tenants.policy(tenant))
        except PrfaasError as exc:
            metrics.ERRORS.labels(code=exc.code).inc()
            raise

    async def _complete(self, body: Any, chat: bool, tenant: TenantPolicy) -> Any:
        req = _redacted(openai_api.parse(body, chat), tenant)
        pool = self.registry.choose_pool(req.model, self.scheduler.rng)  # canary weights (registry.py)
        try:
            return await self._placed(req, chat, tenant, pool)
        except PrfaasError as exc:  # per pool, so a rollout can tell a failing canary from the rest
            metrics.POOL_REQUESTS.labels(pool, exc.code).inc()
            raise

    async def _placed(self, req: openai_api.CompletionRequest, chat: bool, tenant: TenantPolicy, pool: str) -> Any:
        self._admit(tenant)
        tokenizer = next((i for i in self.registry.healthy("decode", pool or None) if tenant.allows(i.datacenter)),
                         None)
        if tokenizer is None:
            where = f" in tenant {tenant.name}'s datacenters" if tenant.allowed_datacenters else ""
            raise KVUnavailable(f"no healthy decode instance{where}")
        job = await self._job(req, tokenizer)
        job.pool, job.tenant = pool, tenant
        job.meta.tenant = tenant.name
        if pool:
            job.meta.pool, job.meta.model = pool, self.registry.models[pool].model
        decode = await self.dispatcher.acquire_decode(job)
        rid = openai_api.new_id(chat)
        events = self.dispatcher.run(job, decode)
        if req.stream:
            try:
                first = await anext(events)  # errors before the first token still get a proper HTTP status
            except BaseException:
                await events.aclose()
                raise
            return StreamingResponse(self._sse(req, rid, job, first, events), media_type="text/event-stream")
        # closed before the answer leaves: what it held on its decode instance is free for the next request
        async with contextlib.aclosing(events):
            return await self._collect(req, rid, job, events)

    def _admit(self, tenant: TenantPolicy) -> None:
        """The cluster's rate limit, then the tenant's own; ``RateLimited`` (429) from either."""
        try:
            self.scheduler.admit()
            wait = self.tenants.admit(tenant.name)
            if wait > 0:
                raise RateLimited(f"over tenant {tenant.name}'s rate limit of {tenant.rate_limit_qps:g} requests/s",
                                  retry_after_s=TokenBucket.retry_after(wait))
        except RateLimited:
            metrics.RATE_LIMITED.inc()
            raise

    async def _job(self, req: openai_api.CompletionRequest, decode: InstanceInfo) -> Job:
        local = self.tokenizers.get(decode)
        ids = await (local.tokenize(req.tokenize_request().to_json()) if local is not None
                     else self.instances.tokenize(decode, req.tokenize_request()))
        room = decode.max_seq_len - len(ids)
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            raise ContextLengthExceeded(
                f"This model's maximum context length is {decode.max_seq_len} tokens; the request has {len(ids)} "
                f"prompt tokens and asks for {req.max_tokens or 1} more", param="messages" if req.chat else "prompt")
        max_tokens = req.max_tokens or min(openai_api.DEFAULT_MAX_TOKENS, room)
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                  seed=req.seed if req.seed is not None else secrets.randbits(31))
        return Job(token_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=req.stop, ignore_eos=req.ignore_eos)

    async def _collect(self, req: openai_api.CompletionRequest, rid: str, job: Job,
                       events: AsyncGenerator[Streamed]) -> dict[str, Any]:
        parts: list[str] = []
        async for event in events:
            parts.append(event.text)
            if isinstance(event, Done):
                self._observe(job, "ok")
                return openai_api.response(req, rid, self.model_name, "".join(parts), event.finish_reason,
                                           self._usage(job), job.meta)
        raise KVTruncated("the stream ended without its 'done' event")  # Dispatcher.run ends with one

    async def _sse(self, req: openai_api.CompletionRequest, rid: str, job: Job, first: Streamed,
                   events: AsyncGenerator[Streamed]) -> AsyncIterator[bytes]:
        status = "cancelled"  # unless it ends with "done" or a prfaas error: the client left, or shutdown
        try:
            event, is_first = first, True
            while True:
                if isinstance(event, Done):
                    if event.text:
                        yield _sse(openai_api.chunk(req, rid, self.model_name, event.text, None))
                    last = openai_api.chunk(req, rid, self.model_name, None, event.finish_reason)
                    if req.include_usage:
                        yield _sse(last)
                        last = {**last, "choices": [], "usage": self._usage(job)}
                    yield _sse({**last, "prfaas": job.meta.to_json()})
                    status = "ok"
                    break
                if event.text or is_first:
                    yield _sse(openai_api.chunk(req, rid, self.model_name, event.text or None, None,
                                                first=is_first))
                    is_first = False
                event = await anext(events)
        except PrfaasError as exc:
            metrics.ERRORS.labels(code=exc.code).inc()
            status = exc.code
            yield _sse(http.error_body(exc.http_status, exc.message, exc.code))
        finally:
            await events.aclose()
            self._observe(job, status)
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _usage(job: Job) -> dict[str, int]:
        n = len(job.generated)
        return {"prompt_tokens": len(job.token_ids), "completion_tokens": n, "total_tokens": len(job.token_ids) + n}

    def _publish_links(self) -> None:
        links = self.scheduler.links.all()
        metrics.LINK_DEGRADED.set(1 if any(link.monitor.health().degraded for link in links) else 0)
        for link in links:
            metrics.LINK_BANDWIDTH.labels(link_name(link.key)).set(link.bandwidth.estimate_bps)
            metrics.LINK_INFLIGHT.labels(link_name(link.key)).set(link.inflight_bytes)

    def _observe(self, job: Job, outcome: str) -> None:
        """A request that reached decode ended: ``outcome`` is "ok", the error code, or "cancelled" (a stream that
        stopped without either)."""
        route, status = job.meta.route or "local", "ok" if outcome == "ok" else "error"
        metrics.REQUESTS.labels(route=route, status=status).inc()
        metrics.POOL_REQUESTS.labels(job.pool, outcome).inc()
        self._publish_links()
        if job.first_token_at is not None:
            metrics.TTFT.labels(route=route).observe(job.first_token_at - job.arrived)
            if job.last_token_at is not None and len(job.generated) > 1:
                metrics.TPOT.observe((job.last_token_at - job.first_token_at) / (len(job.generated) - 1))
        metrics.E2E.labels(route=route).observe(time.perf_counter() - job.arrived)
        self.signals.record(len(job.token_ids), len(job.generated), route, job.meta.kv_bytes or 0)
        crossed = route == "remote" and job.prefill_dc != job.decode_dc
        self.meter.record(metering.RequestUsage(
            job.tenant.name, job.prefill_dc, job.decode_dc, route, status, len(job.token_ids), len(job.generated),
            job.meta.kv_bytes or 0 if crossed else 0))

    async def stores(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for info, _ in self.registry.all():
            if info.role in ("prefill", "relay"):
                with contextlib.suppress(httpx.HTTPError):
                    out[info.instance_id] = (await self.client.get(f"{info.url}/stats")).json()
        return out


def _redacted(req: openai_api.CompletionRequest, tenant: TenantPolicy) -> openai_api.CompletionRequest:
    """The request with the tenant's redaction hook applied to its text (``prfaas.tenancy.redact``)."""
    if not tenant.redact:
        return req
    prompt, messages = redact.apply(redact.load_hook(tenant.redact), tenant.name, req.prompt, req.messages)
    return dataclasses.replace(req, prompt=prompt, messages=messages)


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.releaser.close()
        router.tokenizers.close()
        await router.client.aclose()
        router.meter.close()

    app = FastAPI(title="prfaas router", lifespan=lifespan)
    http.install_error_handlers(app)
    http.install_metrics(app, metrics.served("router"))
    admin_routes.install(app, router)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await router.complete(await jsonbody.read(request), chat=False, tenant=_tenant(request))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Any:
        return await router.complete(await jsonbody.read(request), chat=True, tenant=_tenant(request))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": router.model_cards()}

    @app.get("/v1/models/{model:path}")  # a root is a path: it holds slashes
    async def model_card(model: str) -> dict[str, Any]:
        card = next((c for c in router.model_cards() if model in (c["id"], c["root"])), None)
        if card is None:
            raise ModelNotFound(f"The model `{model}` does not exist or is not served here")
        return card

    @app.get("/health")
    async def health() -> JSONResponse:
        roles = {role: len(router.registry.healthy(role)) for role in router.required_roles()}
        return JSONResponse({"ready": router.ready(), "mode": router.mode, "healthy": roles,
                             "tokenizers_loading": router.tokenizers.loading()},
                            status_code=200 if router.ready() else 503)

    registrar = registration.Registrar(apikeys.parse_keys(router.config.common.api_keys), tls=router.security.enabled())
    if registrar.keys and not registrar.strict and not router.security.enabled():
        log.warning("no API key carries `roles`: any valid key may register instances of any role; give the "
                    "instances' keys roles (docs/security.md)")

    @app.post("/internal/heartbeat")
    async def heartbeat(request: Request) -> JSONResponse:
        info = InstanceInfo.from_json(await jsonbody.read(request))
        peer = peer_of(dict(request.scope))
        try:  # the claimed role and id must be the registrant's (prfaas.security.registration)
            owner = registrar.claim(peer, request.headers.get("authorization", ""), info.role, info.instance_id)
            router.registry.upsert(info, owner)
            if info.role == "decode":
                router.tokenizers.get(info)  # loads the router's own tokenizer for it, once (tokenizing.py)
            feed_tcp(router.scheduler.links, info, (known for known, _ in router.registry.all()))
        except KVUnauthorized as exc:
            return _refused(request, peer, exc)
        except KVIncompatible as exc:
            return JSONResponse(http.error_body(409, exc.message, exc.code), status_code=409)
        return JSONResponse({"ok": True})

    @app.post("/internal/deregister")
    async def deregister(request: Request) -> JSONResponse:
        peer = peer_of(dict(request.scope))
        try:  # only the owner of a live registration may remove it
            owner = registrar.identify(peer, request.headers.get("authorization", ""))
            router.registry.remove(str((await jsonbody.read_object(request)).get("instance_id", "")), owner)
        except KVUnauthorized as exc:
            return _refused(request, peer, exc)
        return JSONResponse({"ok": True})

    @app.get("/admin/instances")
    async def instances() -> list[dict[str, Any]]:
        quota = router.scheduler.quota  # seconds until a prefill instance that refused this cluster is asked again
        return [{**info.to_json(), "healthy": ok, "breaker": router.scheduler.breakers.state(info.instance_id),
                 "quota_hold_s": round(quota.remaining(info.instance_id, router.scheduler.cluster), 3)}
                for info, ok in router.registry.all()]

    @app.get("/admin/kv")
    async def kv() -> dict[str, Any]:
        return await router.stores()

    # API keys on /v1 and /admin; roles on /internal with TLS
    guards.protect_router(app, router.config, router.security)
    return app


def _refused(request: Request, peer: Peer, exc: KVUnauthorized) -> JSONResponse:
    """A refused registration: logged, in the router's audit log (``register``), answered 403."""
    log.warning("refused register to %s: %s", peer.identity, exc.message)
    on_refused = getattr(request.app.state, "tls_refused", None)  # the router's recorder (guards.protect_router)
    if on_refused is not None:
        on_refused(peer, "register", exc.message)
    return http.error_response(exc)


def _tenant(request: Request) -> str:
    """Whose request: set by the API-key guard from the key's tenant; ``default`` without keys."""
    return str(getattr(request.state, "tenant", DEFAULT_TENANT))


def run_router(config: Config, host: str, port: int, mode: str, insecure: bool = False) -> None:
    """Serve until SIGTERM. ``InvalidRequest`` (before binding) when ``host`` is not loopback and neither API keys
    nor TLS are configured, unless ``insecure``."""
    http.setup_logging("router")
    apikeys.check_exposure(host, config, insecure)
    router = Router(config, mode, security=Security.of(config, "router"))
    app = create_app(router)  # SIGTERM drains the router (app.state.drain, prfaas.services.drain.attach_router)
    http.run(http.serve(app, http.bind(host, port), ssl=router.security.server_ssl(client_certs=False),
                        server_class=drain.server_class(app.state.drain)))

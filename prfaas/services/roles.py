"""Wiring of each instance role: which service, which routes. ``prfaas serve prefill|decode|relay`` calls
``run_role``."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from prfaas.config import Config
from prfaas.errors import InvalidRequest
from prfaas.messages import GenerateRequest, PrefillRequest
from prfaas.security import runtime as tls_runtime
from prfaas.services import http, jsonbody
from prfaas.services.instance import Instance, InstanceOptions


def run_role(options: InstanceOptions, config: Config) -> None:
    http.setup_logging(options.instance_id)
    tls_runtime.configure(config, options.role)
    instance = build(options, config)
    try:
        asyncio.run(instance.run())
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has stopped
        if not instance.exit_code:
            raise  # an operator's Ctrl-C ends the process as one
    finally:
        instance.close()  # whatever ended the loop, the engine's child process ends with it
    if instance.exit_code:
        raise SystemExit(instance.exit_code)


def build(options: InstanceOptions, config: Config) -> Instance:
    if options.role == "relay":
        instance = Instance(options, config, with_store=True)
        assert instance.store is not None
        store = instance.store
        instance.load = lambda: {"queue_depth": store.stats().blobs,
                                 "free_kv_bytes": store.budget_bytes - store.stats().bytes}
        return instance
    if options.engine == "vllm":
        return _build_vllm(options, config)
    if options.engine != "prfaas":
        raise InvalidRequest(f"--engine must be prfaas or vllm, not {options.engine!r}")
    from prfaas.engine import load_engine

    engine = load_engine(options.model, dtype=options.dtype)
    _ = engine.layer_table  # computed once, before the first request needs it
    if options.role == "prefill":
        instance = Instance(options, config, with_store=True)
        _prefill_routes(instance, engine)
    elif options.role == "decode":
        instance = Instance(options, config, with_store=False)
        _decode_routes(instance, engine)
    else:
        raise ValueError(f"unknown role {options.role!r}")
    instance.fingerprint = engine.fingerprint.to_wire()
    instance.model, instance.max_seq_len = engine.name, engine.max_seq_len
    instance.model_root = engine.root
    return instance


def _build_vllm(options: InstanceOptions, config: Config) -> Instance:
    """The role on a child vLLM server (``prfaas.vllm.serving``): no store here (the connector's is inside vLLM),
    the same routes."""
    from prfaas.vllm import serving

    if options.role not in ("prefill", "decode"):
        raise ValueError(f"unknown role {options.role!r}")
    instance = Instance(options, config, with_store=False)
    try:
        service = serving.start(instance)
    except BaseException:
        instance.close()
        raise
    if isinstance(service, serving.VllmPrefill):
        _serve_prefill(instance, service)
    else:
        _serve_decode(instance, service)
    return instance


def _prefill_routes(instance: Instance, engine: Any) -> None:
    from prfaas.services.prefill import PrefillService

    _serve_prefill(instance, PrefillService(engine, instance.config, instance.store))


def _serve_prefill(instance: Instance, service: Any) -> None:
    instance.load = service.load

    @instance.app.post("/prefill")
    async def prefill(request: Request) -> StreamingResponse:
        return http.ndjson(service.prefill(PrefillRequest.from_json(await jsonbody.read(request))))


def _decode_routes(instance: Instance, engine: Any) -> None:
    from prfaas.services.decode import DecodeService

    _serve_decode(instance, DecodeService(engine, instance.config))


def _serve_decode(instance: Instance, service: Any) -> None:
    instance.load = service.load

    @instance.app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        return {"token_ids": await service.tokenize(await jsonbody.read_object(request))}

    @instance.app.post("/generate")
    async def generate(request: Request) -> StreamingResponse:
        return http.ndjson(service.generate(GenerateRequest.from_json(await jsonbody.read(request))))

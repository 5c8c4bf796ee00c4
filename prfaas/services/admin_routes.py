"""The router's operator endpoints beside ``/admin/instances`` and ``/admin/kv`` (used by ``prfaas admin``):

- ``GET /admin/pools``: the pools (one per model fingerprint), their weights and instances, the router's config
  digest and blob format versions; ``POST /admin/pools`` ``{"weights": {model or pool key: weight}}`` shifts
  traffic live (a canary step) without a restart; a new entry also lets that model's instances register. With
  ``pool_weights_file`` set the change is kept there first (``prfaas.services.pool_weights``): a change that cannot
  be written is refused (500) and not applied.
- ``GET /admin/signals``: the autoscaling signals (``prfaas.services.signals``).
- ``GET /admin/links``: each (prefill datacenter, decode datacenter) link's state (``prfaas.scheduler.links``:
  health, bandwidth estimate, bytes in flight and routed, utilisation, TCP RTT and retransmissions).
- ``GET /admin/prometheus/targets``: Prometheus HTTP service discovery, the router and every registered instance
  with their role, instance id and datacenter (``prfaas.obs.discovery``; ``deploy/prometheus/prometheus.yml``).
- ``POST /admin/drain/{instance_id}``: stop placing work on the instance at once and ask it to drain (it exits
  when done). 404 when unknown; 502 when the instance cannot be reached (it is still marked draining).
- ``POST /admin/drain``: drain the router itself (``prfaas.services.drain.attach_router``; its ``Drain`` is
  ``app.state.drain``, which ``run_router`` hands to uvicorn so that SIGTERM drains as well).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prfaas.kv.fingerprint import FORMAT_VERSION, SUPPORTED_VERSIONS
from prfaas.obs import discovery
from prfaas.services import drain as drain_module
from prfaas.services import http, jsonbody, pool_weights
from prfaas.services.registry import pool_of


def install(app: FastAPI, router: Any) -> None:
    registry = router.registry
    app.state.drain = drain_module.attach_router(app, router.config.common)

    @app.get("/admin/pools")
    async def pools() -> dict[str, Any]:
        roles: dict[str, Counter[str]] = {}
        for info, _ in registry.all():
            roles.setdefault(pool_of(info), Counter())[info.role] += 1
        out = [{"pool": key, "model": fp.model, "weight": registry.weight_of(key, fp.model),
                "fingerprint": fp.to_wire(), "instances": dict(roles.get(key, {}))}
               for key, fp in sorted(registry.models.items())]
        return {"pools": out, "configured": registry.pools, "kept_in": router.config.router.pool_weights_file or None,
                "router_config_hash": router.config.digest(),
                "router_format_version": FORMAT_VERSION, "router_reads": sorted(SUPPORTED_VERSIONS)}

    @app.post("/admin/pools")
    async def set_pools(request: Request) -> Any:
        weights = (await jsonbody.read_object(request)).get("weights", {})
        if not isinstance(weights, dict) or not all(isinstance(w, (int, float)) and w >= 0
                                                    for w in weights.values()):
            return JSONResponse(http.error_body(400, "weights must map names to numbers ≥ 0", None), 400)
        changed = {**registry.pools, **{str(k): float(v) for k, v in weights.items()}}
        if router.config.router.pool_weights_file:  # kept before applied: a restart never forgets an applied change
            try:
                pool_weights.save(router.config.router.pool_weights_file, changed)
            except OSError as exc:
                kept_in = router.config.router.pool_weights_file
                message = f"the weights could not be kept in {kept_in} ({exc}); nothing changed"
                return JSONResponse(http.error_body(500, message, None), 500)
        registry.pools = changed
        return await pools()

    @app.get("/admin/signals")
    async def signals() -> dict[str, Any]:
        return router.signals.snapshot(registry.healthy("prefill"), registry.healthy("decode"),
                                       router.scheduler.speeds, router.config.router.offload_threshold_tokens)

    @app.get("/admin/links")
    async def links() -> dict[str, Any]:
        return {"links": [link.stats() for link in router.scheduler.links.all()]}

    @app.get("/admin/prometheus/targets")
    async def prometheus_targets(request: Request) -> list[dict[str, Any]]:
        me = discovery.Target(_own_address(request), request.url.scheme, "router", "router",
                              router.config.common.datacenter)
        return discovery.target_groups(me, (info for info, _ in registry.all()))

    @app.post("/admin/drain/{instance_id}")
    async def drain(instance_id: str) -> JSONResponse:
        info = next((i for i, _ in registry.all() if i.instance_id == instance_id), None)
        if info is None or not registry.mark_draining(instance_id):
            return JSONResponse(http.error_body(404, f"no instance {instance_id!r}", None), 404)
        try:
            reply = await router.client.post(f"{info.url}/admin/drain", timeout=5.0)
            return JSONResponse(reply.json(), status_code=reply.status_code)
        except (httpx.HTTPError, ValueError) as exc:
            return JSONResponse(http.error_body(502, f"{instance_id} marked draining but not reached: {exc}",
                                                None), 502)


def _own_address(request: Request) -> str:
    """Where this request reached the router (the connection's local address, a real one even when the router
    listens on 0.0.0.0): Prometheus scrapes the router where it found the discovery."""
    server = request.scope.get("server")
    return discovery.address(server[0], server[1]) if server else request.url.netloc

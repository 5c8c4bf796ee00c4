"""The cost policy wired into the router: what the ``Dispatcher`` feeds the model and what it reports, on
``FakeInstances`` (no processes, no sockets; the request paths themselves are proven over real HTTP by
tests/services/)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from prfaas.config import from_dict
from prfaas.kv import Fingerprint
from prfaas.kv.prefix import block_hashes, prefix_salt, summary_key
from prfaas.obs import metrics
from prfaas.services.fake_instances import FakeInstances
from prfaas.services.router import Router

pytestmark = pytest.mark.timeout(30)
LONG = " ".join(["word"] * 2000)  # 2000 tokens for the fake tokenizer


def profile(tmp_path: Path, name: str, s_per_token: float) -> str:
    path = tmp_path / f"{name}.json"
    rows = [{"seq_len": n, "seconds": n * s_per_token} for n in (512, 4096)]
    kv = [{"seq_len": 4096, "codec": "none", "bytes": 4096 * 64},
          {"seq_len": 4096, "codec": "int8", "bytes": 4096 * 16}]
    path.write_text(json.dumps({"model": "m", "prefill": rows, "decode": [], "kv": kv}))
    return str(path)


def router(tmp_path: Path, remote_s: float, local_s: float, **config: Any) -> tuple[Router, FakeInstances]:
    fake = FakeInstances()
    keys = {"offload_policy": "cost", "offload_threshold_tokens": 0, "link_bandwidth_bps": 1e10,
            "prefill_profile": profile(tmp_path, "remote", remote_s),
            "local_profile": profile(tmp_path, "local", local_s)}
    r = Router(from_dict({**keys, **config}), "direct", instances=fake)
    r.registry.upsert(fake.info("decode", "d0", model="m"))
    r.registry.upsert(fake.info("prefill", "p0", datacenter="dc-a"))
    return r, fake


def complete(r: Router) -> dict[str, Any]:
    reply = asyncio.run(asyncio.wait_for(r.complete({"model": r.model_name, "prompt": LONG, "max_tokens": 4},
                                                    chat=False, tenant="default"), 10))
    assert isinstance(reply, dict)
    return reply


def routes(route: str, reason: str) -> float:
    return metrics.ROUTES.labels(route=route, reason=reason)._value.get()


def test_a_faster_remote_prefill_is_chosen_and_its_link_and_backlog_are_released(tmp_path: Path) -> None:
    r, fake = router(tmp_path, remote_s=0.0001, local_s=0.001)
    before = routes("remote", "cost_prefill")
    meta = complete(r)["prfaas"]
    assert (meta["route"], meta["reason_code"]) == ("remote", "cost_prefill")
    assert "predicted TTFT remote" in meta["reason"]
    assert routes("remote", "cost_prefill") == before + 1
    link = r.scheduler.links.get("dc-a", "dc-b")
    assert link.inflight_bytes == 0 and link.started_bytes() == 2000 * 64  # the decode's layout: 64 B per token
    assert link.monitor.health().samples == 1  # the transfer's outcome reached this link's monitor
    assert r.scheduler.estimator.backlog.seconds("p0") == pytest.approx(0.0)
    assert [p.kv_id for p in fake.calls_to("prefill")] and not fake.blobs


def test_a_faster_local_prefill_stays_local_and_teaches_the_local_speed(tmp_path: Path) -> None:
    r, fake = router(tmp_path, remote_s=0.001, local_s=0.0001)
    meta = complete(r)["prfaas"]
    assert (meta["route"], meta["reason_code"]) == ("local", "cost_prefill")
    assert not fake.calls_to("prefill")
    # the fake decode reports a local prefill of 2 ms: the router's view of d0 moved toward it
    learnt = r.scheduler.estimator.local_speed(r.registry.healthy("decode")[0]).seconds(2000)
    assert learnt < 2000 * 0.0001
    assert r.scheduler.estimator.backlog.seconds("d0") == pytest.approx(0.0)


def test_a_prefix_the_decode_instance_reused_is_not_taken_for_prefill_speed(tmp_path: Path) -> None:
    """Its summary held all but the last block of the prompt: the fake's 2 ms local prefill computed 16 tokens."""
    r, fake = router(tmp_path, remote_s=0.001, local_s=0.0001)
    ids = list(range(1000, 3000))
    salt = prefix_salt(Fingerprint.from_wire(r.registry.healthy("decode")[0].fingerprint), "default")
    held = [summary_key(h) for h in block_hashes(ids, salt)]
    r.registry.upsert(fake.info("decode", "d0", model="m", prefix_blocks=held[::-1]))
    reply = asyncio.run(asyncio.wait_for(r.complete({"model": r.model_name, "prompt": ids, "max_tokens": 4},
                                                    chat=False, tenant="default"), 10))
    assert isinstance(reply, dict) and reply["prfaas"]["route"] == "local"
    online = r.scheduler.estimator.local_speed(r.registry.healthy("decode")[0]).online
    assert online == pytest.approx(0.002 / (2000 - (2000 - 1) // 16 * 16))


def test_a_link_bound_request_asks_prefill_for_the_chosen_lossy_codec_and_says_so(tmp_path: Path) -> None:
    # 2000 tokens × 64 B over 0.5 Mbit/s: 2 s of transfer make remote (0.2 s of prefill) lose to local (2 s); in
    # int8 (a quarter of the bytes, per the profile) remote wins
    adaptive = {"min_agreement": 0.99, "agreement": {"m": {"int8": 1.0}}, "tenants": {"*": ["int8"]}}
    r, fake = router(tmp_path, remote_s=0.0001, local_s=0.001, link_bandwidth_bps=5e5, link_share=1.0,
                     adaptive_codec=adaptive)
    meta = complete(r)["prfaas"]
    assert (meta["route"], meta["reason_code"], meta["kv_codec"]) == ("remote", "link_codec", "int8")
    [request] = fake.calls_to("prefill")
    assert request.kv_codec == "int8"
    plain, _ = router(tmp_path, remote_s=0.0001, local_s=0.001, link_bandwidth_bps=5e5, link_share=1.0)
    meta = complete(plain)["prfaas"]
    assert (meta["route"], meta["reason_code"]) == ("local", "cost_transfer") and "kv_codec" not in meta

"""The cost policy in a real ``prfaas up``: the router predicts both routes from the configured speed profiles and
the instances' heartbeats, routes by the better one, says which term decided, and releases the link's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from tests.services.deploy import deployment

pytestmark = pytest.mark.timeout(400)
MODEL = "tiny-llama"


def profile(path: Path, s_per_token: float) -> str:
    rows = [{"seq_len": n, "seconds": n * s_per_token} for n in (64, 1024)]
    path.write_text(json.dumps({"model": MODEL, "prefill": rows, "decode": [], "kv": []}))
    return str(path)


def config(tmp_path: Path, remote_s: float, local_s: float) -> str:
    path = tmp_path / "prfaas.yaml"
    path.write_text(yaml.safe_dump({"offload_policy": "cost", "link_bandwidth_bps": 1e10,
                                    "prefill_profile": profile(tmp_path / "remote.json", remote_s),
                                    "local_profile": profile(tmp_path / "local.json", local_s)}))
    return str(path)


def metric(url: str, name: str) -> list[str]:
    return [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines() if line.startswith(name)]


@pytest.mark.parametrize(("remote_s", "local_s", "route"), [(0.0001, 0.01, "remote"), (0.01, 0.0001, "local")])
def test_the_router_takes_the_route_the_cost_model_predicts_faster(tmp_path: Path, remote_s: float, local_s: float,
                                                                   route: str) -> None:
    with deployment(MODEL, "direct", threshold=0, extra=("--config", config(tmp_path, remote_s, local_s))) as (
            url, _):
        body = {"model": MODEL, "prompt": "hello " * 40, "max_tokens": 4, "temperature": 0}
        meta = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["prfaas"]
        assert (meta["route"], meta["reason_code"]) == (route, "cost_prefill"), meta
        assert "predicted TTFT remote" in meta["reason"]
        assert any(f'reason="cost_prefill",route="{route}"' in line for line in
                   metric(url, "prfaas_router_routes_total"))
        if route == "remote":  # the link's bytes were counted while in flight and released at the first token
            [inflight] = metric(url, "prfaas_router_link_inflight_bytes")
            assert inflight.endswith(" 0.0"), inflight
        stores = httpx.get(f"{url}/admin/kv", timeout=30).json()
        assert stores and all(report["store"]["blobs"] == 0 for report in stores.values()), stores

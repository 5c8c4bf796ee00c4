"""``TCP_INFO`` from the data plane to the router's links: the pulling (direct mode) or pushing (relay mode) side
records its connections' RTT and retransmissions per peer address, heartbeats carry them (``InstanceInfo.tcp_peers``),
the router puts them on the link of that datacenter pair (its RTT/2 term of the exposed transfer), and
``GET /admin/links`` shows them; a malformed record is refused with a 400 in the OpenAI error body."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from prfaas.config import Config
from prfaas.errors import InvalidRequest
from prfaas.messages import MAX_TCP_PEERS, InstanceInfo, TcpPeer
from prfaas.scheduler.cost import Inputs, decide
from prfaas.scheduler.links import Links, feed_tcp
from prfaas.services import http
from prfaas.services.router import Router, create_app
from prfaas.transfer.stats import MAX_PEERS, LinkRecorder
from prfaas.transfer.tcp import TcpInfo, tcp_info
from tests.services.deploy import deployment

MIB = 2**20
STORE_A, RELAY_B = "127.0.0.1:9001", "127.0.0.1:9002"
MODEL = "synthetic-kimi-linear-48b"


def _info(instance_id: str, role: str, dc: str, kv_address: str = "", **extra: Any) -> InstanceInfo:
    return InstanceInfo.from_json({"instance_id": instance_id, "role": role, "url": f"http://{instance_id}",
                                   "datacenter": dc, "kv_address": kv_address, **extra})


def _registered() -> list[InstanceInfo]:
    return [_info("prefill-0", "prefill", "dc-a", STORE_A), _info("relay-0", "relay", "dc-b", RELAY_B)]


def test_a_decode_heartbeat_with_tcp_figures_moves_the_links_rtt_term() -> None:
    links = Links(50, 0.99, 10e9)
    link = links.get("dc-a", "dc-b")
    inputs = Inputs(kv_bytes=64 * MIB, remote_queue_s=0.0, remote_prefill_s=0.5, restore_s=0.01,
                    local_queue_s=0.0, local_prefill_s=1.0)
    before = decide(inputs, link.view(4 * MIB)).exposed_s
    decode = _info("decode-0", "decode", "dc-b", tcp_peers=[{"peer": STORE_A, "rtt_ms": 40.0, "retransmits": 3}])
    feed_tcp(links, decode, _registered())
    assert (link.rtt_ms, link.retransmits) == (40.0, 3)
    assert link.view(4 * MIB).rtt_s == pytest.approx(0.04)
    assert decide(inputs, link.view(4 * MIB)).exposed_s == pytest.approx(before + 0.02)  # RTT/2
    assert link.stats()["rtt_ms"] == 40.0


def test_relay_mode_figures_are_the_prefills_pushes_and_retransmits_add_up_per_reporter() -> None:
    links = Links(50, 0.99, 10e9)
    pusher = _info("prefill-1", "prefill", "dc-a", tcp_peers=[{"peer": RELAY_B, "rtt_ms": 25.0, "retransmits": 2}])
    other = _info("prefill-2", "prefill", "dc-a", tcp_peers=[{"peer": RELAY_B, "rtt_ms": 30.0, "retransmits": 5}])
    for reporter in (pusher, other, pusher):  # a heartbeat repeats its counts: they are not added twice
        feed_tcp(links, reporter, _registered())
    link = links.get("dc-a", "dc-b")  # prefill's datacenter → the relay's
    assert (link.rtt_ms, link.retransmits) == (25.0, 7)
    stranger = _info("decode-1", "decode", "dc-b", tcp_peers=[{"peer": "127.0.0.1:1", "rtt_ms": 9.0}])
    feed_tcp(links, stranger, _registered())  # an address no instance serves: no link can be told
    local = _info("decode-2", "decode", "dc-b", tcp_peers=[{"peer": RELAY_B, "rtt_ms": 0.1}])
    feed_tcp(links, local, _registered())  # decode's pulls from its relay stay inside dc-b
    assert [lnk.key for lnk in links.all()] == [("dc-a", "dc-b")]


@pytest.mark.parametrize(("tcp_peers", "says"), [
    ("fast", "'tcp_peers' must be a list"),
    ([{"peer": STORE_A}] * (MAX_TCP_PEERS + 1), f"at most {MAX_TCP_PEERS} records"),
    (["127.0.0.1:9001"], "TcpPeer must be a JSON object"),
    ([{"peer": STORE_A, "rtt_ms": -1.0}], "'rtt_ms' must be a number"),
    ([{"peer": STORE_A, "rtt_ms": "40"}], "'rtt_ms' must be a number"),
    ([{"peer": STORE_A, "retransmits": 1.5}], "'retransmits'"),
    ([{"peer": 7}], "'peer' must be a string"),
    ([{"peer": STORE_A, "cwnd": 10}], "fields this version does not know"),
    ([{"rtt_ms": 1.0}], "bad TcpPeer"),
])
def test_a_malformed_tcp_record_is_refused_with_a_clear_error(tcp_peers: Any, says: str) -> None:
    with pytest.raises(InvalidRequest, match=says):
        _info("decode-0", "decode", "dc-b", tcp_peers=tcp_peers)


def test_the_router_answers_a_malformed_record_with_400_and_shows_a_good_one_on_admin_links() -> None:
    app: Any = http.ErrorBoundary(create_app(Router(Config(), mode="direct")))

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                     base_url="http://router") as client:
            bad = {**_info("decode-0", "decode", "dc-b").to_json(), "tcp_peers": [{"peer": STORE_A, "rtt_ms": 1e9}]}
            good = _info("decode-0", "decode", "dc-b", tcp_peers=[{"peer": STORE_A, "rtt_ms": 12.5}]).to_json()
            prefill = _info("prefill-0", "prefill", "dc-a", STORE_A).to_json()
            replies = [await client.post("/internal/heartbeat", json=body) for body in (bad, prefill, good)]
            return [*replies, await client.get("/admin/links")]

    bad, prefill, good, links = asyncio.run(scenario())
    assert bad.status_code == 400, bad.text
    assert set(bad.json()["error"]) == {"message", "type", "code", "param"}
    assert "rtt_ms" in bad.json()["error"]["message"]
    assert prefill.status_code == good.status_code == 200
    (link,) = links.json()["links"]
    assert link["link"] == "dc-a:dc-b" and link["rtt_ms"] == 12.5


def test_the_recorder_keeps_the_peers_used_last_and_sums_their_retransmits() -> None:
    recorder = LinkRecorder("pull")
    for i in range(MAX_PEERS + 3):
        recorder.connection(TcpInfo(1000 * (i + 1), 0, 2, 0, 10, 1448), peer=f"10.0.0.{i}:9000")
    recorder.connection(TcpInfo(500, 0, 5, 0, 10, 1448), retrans_before=2, peer="10.0.0.3:9000")
    peers = recorder.peers()
    assert len(peers) == MAX_PEERS and peers[-1] == TcpPeer("10.0.0.3:9000", 0.5, 2 + 3)
    assert "10.0.0.0:9000" not in {p.peer for p in peers}  # the least recently used left first


def test_a_real_connections_tcp_info_is_recorded_for_its_peer() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = "{}:{}".format(*server.getsockname()[:2])
        with socket.create_connection(server.getsockname()[:2]) as conn:
            accepted, _ = server.accept()
            with accepted:
                conn.sendall(b"x" * 65536)
                accepted.recv(65536)
                recorder = LinkRecorder("pull")
                recorder.connection(tcp_info(conn), peer=address)
    (peer,) = recorder.peers()
    assert peer.peer == address and peer.rtt_ms > 0


def _links(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/admin/links", timeout=30).json()["links"])


@pytest.mark.parametrize("mode", ["direct", "relay"])
def test_a_remote_request_shows_its_rtt_and_bytes_on_admin_links(mode: str) -> None:
    """``prfaas up`` (the synthetic engine): one remote request; the next heartbeat of decode (direct mode: its
    pull) or prefill (relay mode: its push) carries the RTT to the router, whose ``dc-a:dc-b`` link then shows it
    beside the KV bytes routed; no other link appears (decode's pull from the relay stays inside dc-b)."""
    with deployment(MODEL, mode, threshold=0) as (url, _):
        body = {"model": MODEL, "prompt": list(range(100, 356)), "max_tokens": 2, "temperature": 0}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["prfaas"]["route"] == "remote", reply.json()["prfaas"]
        deadline, link = time.monotonic() + 30, {}
        while time.monotonic() < deadline:
            link = next((x for x in _links(url) if x["link"] == "dc-a:dc-b"), {})
            if link.get("rtt_ms", 0) > 0:
                break
            time.sleep(0.2)
        assert link.get("rtt_ms", 0) > 0, json.dumps(_links(url))
        assert link["sent_bytes"] > 0 and link["inflight_bytes"] == 0, link
        assert link["samples"] >= 1 and link["retransmits"] >= 0
        assert [x["link"] for x in _links(url)] == ["dc-a:dc-b"]
        cli = subprocess.run([sys.executable, "-m", "prfaas", "admin", "links", "--router", url, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        assert "dc-a:dc-b:" in cli.stdout and "RTT" in cli.stdout
        assert any(x["link"] == "dc-a:dc-b" for x in json.loads(cli.stdout.splitlines()[-1])["links"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the blob is released once decode restored it
            stores = httpx.get(f"{url}/admin/kv", timeout=30).json()
            if stores and all(report["store"]["blobs"] == 0 for report in stores.values()):
                break
            time.sleep(0.2)
        assert stores and all(report["store"]["blobs"] == 0 for report in stores.values()), stores

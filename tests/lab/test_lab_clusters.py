"""``prfaas up --lab --clusters 2`` in a three-datacenter lab, real processes (root only): one prefill pool in dc-a
serves cluster 0 in dc-b and cluster 1 in dc-c, each over its own link; cutting dc-c's link sends cluster 1's
prompts local while cluster 0's stay remote on the same prefill instance with the same greedy text.

``prfaas up --lab`` uses the default lab (dc-a, dc-b, dc-c), so this test skips when any of them exists; it ends
with the lab down and no process of the deployment left."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from prfaas.lab import Lab, LinkSettings, Topology, missing_support
from prfaas.lab.system import namespaces
from tests.services.deploy import alive, descendants, free_port, line_saying

REASON = missing_support()
MODEL = "smollm2-135m"
PROMPT = ("The capital of France is the city of Paris, which is known for its art, its food, its fashion and its "
          "long history as a centre of")  # 30 tokens: over the threshold of 16, so remote while the link is up
TOPO = Topology(decode_dcs=2)
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"lab unavailable here: {REASON}")]


@pytest.fixture
def clusters() -> Iterator[tuple[Lab, list[str]]]:
    if any(ns in namespaces() for ns in TOPO.namespaces):
        pytest.skip("a lab is up on this host (dc-a, dc-b or dc-c); `prfaas up --lab` would use it")
    lab = Lab(LinkSettings(rate="1gbit"), TOPO, {"dc-a:dc-c": LinkSettings(rate="1gbit", delay_ms=5)})
    lab.up()
    proc: subprocess.Popen[str] | None = None
    children: list[int] = []
    try:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "prfaas", "up", "--lab", "--clusters", "2", "--model", MODEL,
                                 "--port", str(port), "--offload-threshold", "16"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        line_saying(proc, "prfaas is up", 300)
        children = descendants(proc.pid)
        yield lab, [f"http://{wire.public}:{port + i}" for i, wire in enumerate(TOPO.wires)]
    finally:
        try:
            if proc is not None:
                _stop(proc)
            time.sleep(0.2)
        finally:
            lab.down()  # even when the deployment had to be killed: never leave the namespaces behind
    assert not [p for p in children if os.path.exists(f"/proc/{p}") and alive(p)], "processes left behind"
    assert not any(ns in namespaces() for ns in TOPO.namespaces)


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, and SIGKILL to the whole deployment if it has not stopped within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        raise


def _complete(url: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    data: dict[str, Any] = reply.json()
    return data


def _text(data: dict[str, Any]) -> str:
    return str(data["choices"][0]["text"])


def test_a_cut_link_sends_its_cluster_local_and_leaves_the_other_remote(clusters: tuple[Lab, list[str]]) -> None:
    lab, (url_b, url_c) = clusters
    before = {url: _complete(url) for url in (url_b, url_c)}
    for data in before.values():  # both clusters offload to the one shared prefill instance
        assert data["prfaas"]["route"] == "remote" and data["prfaas"]["prefill_instance"] == "prefill-0"
    assert _text(before[url_b]) == _text(before[url_c])

    lab.set("dc-a:dc-c", cut=True)
    for _ in range(3):
        cut_side = _complete(url_c)
        assert cut_side["prfaas"]["route"] == "local" and _text(cut_side) == _text(before[url_c])
        other = _complete(url_b)  # its own link is untouched: still remote, same pool, same text
        assert other["prfaas"]["route"] == "remote" and other["prfaas"]["prefill_instance"] == "prefill-0"
        assert not other["prfaas"]["fallback"] and _text(other) == _text(before[url_b])

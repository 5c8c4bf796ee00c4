"""Faults through prfaas's router with vLLM as the engine, on one real deployment: ``prfaas up --engine vllm
--mode relay --tls --offload-threshold 0`` (SmolLM2-135M fp32; every prompt remote; mutual TLS 1.3 on every hop,
the connector's data plane included, with the certificates of prfaas's ``certs init``).

The reference is the local route: the decode instance's vLLM server alone, greedy, on the same token ids.
- TLS: the remote route is exact and its prompt came from ``external_kv_transfer``; the producer's data plane
  refuses a peer without a certificate (handshake) and a role the policy does not let read (``KV_UNAUTHORIZED``);
  a consumer sent to a store whose certificate another CA signed (the blob there is real) cannot pull it, and
  vLLM recomputes the same tokens;
- a relay that stops (SIGSTOP: a link that black-holes) while a request is in flight, and a relay killed
  (SIGKILL: the link reset; ``prfaas up`` restarts it): the request ends in the same tokens (vLLM recomputes what
  it could not pull), bounded in time, its ``prfaas`` field says the prompt was prefilled locally (``route:
  local``, ``fallback``), and the next one is remote again;
- the prefill instance's vLLM server killed mid-request: the router falls back to local prefill, same tokens;
  the instance stops (exit 1) and ``prfaas up`` restarts it; nothing of the dead server is left;
- no blob is left in the relay's or the producer's store, no process of the deployment is left.

Skips only where vLLM's CPU build is not installed (``make vllm``). One deployment for the module: about 3-5
minutes on 2 shared cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from prfaas import tls as tls_contexts
from prfaas.config import TLSConfig
from prfaas.errors import KVUnauthorized, PrfaasError
from prfaas.kv.format import BlobReader, BlobWriter
from prfaas.kv.kvid import new_kv_id
from prfaas.security import certs, local
from prfaas.store.memory import BlobStore
from prfaas.transfer import client
from tests.services.deploy import alive, deployment, descendants, line_saying, tls_dir
from tests.transfer.helpers import fill
from tests.vllm.servers import EAGER, NEEDS_VLLM, StoreThread

MODEL = "smollm2-135m"
MAX_TOKENS = 20
REQUEST_S = 300.0  # httpx's bound on one request: never reached unless something hangs
FAULT_S = 150.0  # what a faulted request may take on 2 shared cores (a recompute after the pulls gave up)
HEAL_S = 120.0  # the relay restarted or resumed and registered again
# into the request: inside its prefill on either kind of CPU (0.25-0.29 s with AVX-512, 1-4 s with AVX2 only); a
# fault that comes before the request reaches the prefill instance, or before its KV reaches the relay, ends the
# same way
FAULT_AFTER_S = 0.12
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(30))  # about 340 tokens: 3 blocks
ERROR_CODES = {"KV_UNAVAILABLE", "KV_TIMEOUT", "KV_TRUNCATED", "KV_NOT_FOUND"}

pytestmark = [
    pytest.mark.slow,
    NEEDS_VLLM,
]


@dataclass
class Up:
    url: str
    proc: Any
    certs: Path
    token_ids: list[int]
    reference: str  # the local route's greedy text

    @property
    def verify(self) -> ssl.SSLContext:
        """What a public client of the router trusts: the deployment's CA."""
        return local.ca_client_context(str(self.certs / "ca.pem"))

    def ssl(self, role: str) -> ssl.SSLContext:
        """A data-plane client context of ``role`` (its certificate from the deployment's CA)."""
        return tls_contexts.client_context(TLSConfig(ca=str(self.certs / "ca.pem"), cert=str(self.certs /
                                                     f"{role}.pem"), key=str(self.certs / f"{role}.key"),
                                                     required=True))


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    left: list[int] = []
    with deployment(MODEL, "relay", threshold=0,
                    extra=("--engine", "vllm", "--dtype", "float32", "--tls"), env=EAGER) as (url, proc):
        decode_port = _vllm(proc, "kv_consumer")[1]
        token_ids = _tokenize(decode_port)
        yield Up(url, proc, tls_dir(proc), token_ids, _local_text(decode_port, token_ids))
        left = descendants(proc.pid)  # roles restarted by the tests included
    deadline = time.monotonic() + 30
    while (alive_left := [p for p in left if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive_left, f"processes left behind: {alive_left}"


# -- the deployment's processes -------------------------------------------------------------------------------


def _processes(proc: Any) -> Iterator[tuple[int, list[str]]]:
    for pid in descendants(proc.pid):
        try:
            yield pid, Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue


def _vllm(proc: Any, kv_role: str) -> tuple[int, int]:
    """(pid, port) of the deployment's vLLM server in ``kv_role``."""
    for pid, args in _processes(proc):
        if "prfaas.vllm.launch" in args and any(kv_role in a for a in args):
            return pid, int(args[args.index("--port") + 1])
    raise AssertionError(f"no {kv_role} vLLM server running")


def _role(proc: Any, role: str) -> int:
    """The pid of the deployment's ``prfaas serve ROLE``."""
    for pid, args in _processes(proc):
        if args[2:5] == ["prfaas", "serve", role]:
            return pid
    raise AssertionError(f"no {role} running")


def _instances(up: Up) -> dict[str, dict[str, Any]]:
    reply = httpx.get(f"{up.url}/admin/instances", verify=up.verify, timeout=30)
    return {i["instance_id"]: i for i in reply.json()}


# -- requests --------------------------------------------------------------------------------------------------


def _vllm_post(port: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": MODEL, **body}, timeout=REQUEST_S)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _tokenize(port: int) -> list[int]:
    """As the decode instance tokenises a completion's prompt for the router."""
    return [int(t) for t in _vllm_post(port, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]]


def _local_text(port: int, token_ids: list[int], **extra: Any) -> str:
    body = {"prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return str(_vllm_post(port, "/v1/completions", body)["choices"][0]["text"])


def _prompt_sources(port: int) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            found[line.split('source="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


@dataclass
class Outcome:
    status: int
    text: str
    extension: dict[str, Any]
    error: dict[str, Any] | None
    seconds: float


def _ask(up: Up, stream: bool) -> Outcome:
    """One completion through the router (``stream``: server-sent events, an error chunk kept)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    started, verify = time.monotonic(), up.verify
    if not stream:
        reply = httpx.post(f"{up.url}/v1/completions", json=body, verify=verify, timeout=REQUEST_S)
        data = reply.json()
        text = data["choices"][0]["text"] if reply.status_code == 200 else ""
        return Outcome(reply.status_code, text, data.get("prfaas", {}), data.get("error"),
                       time.monotonic() - started)
    text, error = "", None
    extension: dict[str, Any] = {}
    with httpx.stream("POST", f"{up.url}/v1/completions", json=body, verify=verify, timeout=REQUEST_S) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                error = chunk.get("error", error)
                text += "".join(c.get("text") or "" for c in chunk.get("choices", []))
                extension = chunk.get("prfaas", extension)
        status = reply.status_code
    return Outcome(status, text, extension, error, time.monotonic() - started)


def _during(fault: Callable[[], None], up: Up, stream: bool = False) -> Outcome:
    """``fault`` ``FAULT_AFTER_S`` into a request; the request's outcome."""
    timer = threading.Timer(FAULT_AFTER_S, fault)
    timer.start()
    try:
        return _ask(up, stream)
    finally:
        timer.join()


def _assert_exact_or_clear_error(up: Up, outcome: Outcome) -> None:
    print(f"\n  -> HTTP {outcome.status} in {outcome.seconds:.1f} s, route {outcome.extension.get('route')}, "
          f"fallback {outcome.extension.get('fallback')}, error {outcome.error}")
    assert outcome.seconds < FAULT_S
    if outcome.status == 200 and outcome.error is None:
        assert outcome.text == up.reference, outcome
        return
    assert outcome.error is not None and set(outcome.error) >= {"message", "type", "code"}, outcome
    assert outcome.error["code"] in ERROR_CODES, outcome


def _assert_prefilled_locally(outcome: Outcome) -> None:
    """A 200 whose prompt decode did not get the KV of (recomputed, or the router's local prefill) says so."""
    if outcome.status == 200 and outcome.error is None:
        assert outcome.extension["route"] == "local" and outcome.extension["fallback"], outcome.extension


def _assert_remote_exact(up: Up) -> None:
    outcome = _ask(up, stream=False)
    print(f"\n  -> remote, no fault: HTTP {outcome.status} in {outcome.seconds:.1f} s")
    assert outcome.status == 200 and outcome.text == up.reference, outcome
    assert outcome.extension["route"] == "remote" and outcome.extension["kv_bytes"] > 0, outcome.extension


# -- leaks ------------------------------------------------------------------------------------------------------


def _relay_blobs(up: Up) -> int:
    reply = httpx.get(f"{up.url}/admin/kv", verify=up.verify, timeout=30).json()
    return sum(int((report.get("store") or {}).get("blobs", 0)) for report in reply.values())


def _producer_blobs(up: Up) -> int:
    address = _instances(up)["prefill-0"]["kv_address"]
    return int(asyncio.run(client.stat(address, ssl=up.ssl("router"), timeout_s=10))["blobs"])


def _assert_no_blob_left(up: Up, producer: bool = True) -> None:
    deadline = time.monotonic() + 30  # releases are asynchronous; an aborted push ends when the relay sees it
    while (_relay_blobs(up) or (producer and _producer_blobs(up))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _relay_blobs(up) == 0, "a blob was left in the relay's store"
    assert not producer or _producer_blobs(up) == 0, "a blob was left in the producer's store"


def _wait_relay_healthy(up: Up, not_pid: int | None = None) -> None:
    deadline = time.monotonic() + HEAL_S
    while time.monotonic() < deadline:
        relay = _instances(up).get("relay-0")
        with contextlib.suppress(PrfaasError, AssertionError):  # not registered again yet, not restarted yet
            if relay and relay["healthy"] and (not_pid is None or _role(up.proc, "relay") != not_pid):
                asyncio.run(client.stat(relay["kv_address"], ssl=up.ssl("router"), timeout_s=5))
                return
        time.sleep(0.5)
    raise AssertionError(f"the relay was not back within {HEAL_S} s")


# -- the tests ---------------------------------------------------------------------------------------------------


def test_remote_over_tls_is_exact_and_not_recomputed(up: Up) -> None:
    decode_port = _vllm(up.proc, "kv_consumer")[1]
    before = _prompt_sources(decode_port)
    _assert_remote_exact(up)
    after = _prompt_sources(decode_port)
    # decode's prompt is the prompt and the first token prefill sampled: every prompt token came from the blob
    assert after["external_kv_transfer"] - before.get("external_kv_transfer", 0) == len(up.token_ids)
    _assert_no_blob_left(up)


def test_the_producers_data_plane_checks_certificates_and_roles(up: Up) -> None:
    address = _instances(up)["prefill-0"]["kv_address"]
    no_certificate = local.ca_client_context(str(up.certs / "ca.pem"))
    with pytest.raises(KVUnauthorized, match="refused our certificate"):  # mutual TLS is required
        asyncio.run(client.stat(address, ssl=no_certificate, timeout_s=10))
    with pytest.raises(KVUnauthorized, match=r"may not kv\.read"):  # a prefill may not read (decode, router may)
        asyncio.run(client.pull(address, new_kv_id("0" * 12), BlobReader(), ssl=up.ssl("prefill"),
                                timeout_s=10, retries=0))
    assert asyncio.run(client.stat(address, ssl=up.ssl("decode"), timeout_s=10))["blobs"] == 0


class OtherCAStore(StoreThread):
    """A data-plane store whose certificate another CA signed (``certs.init`` in a directory of its own)."""

    def __init__(self, directory: Path) -> None:
        paths = certs.init(directory)
        tls = TLSConfig(ca=str(paths["ca"]), cert=str(paths["relay"]), key=str(directory / "relay.key"))
        super().__init__(120.0, tls_contexts.server_context(tls))


def _real_blob(up: Up) -> tuple[str, list[bytes]]:
    """The producer's blob of the prompt, pushed to the relay, pulled back out and released: (kv_id, frames)."""
    relay = _instances(up)["relay-0"]["kv_address"]
    params = {"do_remote_decode": True, "relay": relay}
    answer = _vllm_post(_vllm(up.proc, "kv_producer")[1], "/v1/completions",
                        {"prompt": up.token_ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params})
    kv_id = answer["kv_transfer_params"]["kv_id"]

    async def take() -> list[bytes]:
        state = await client.pull(relay, kv_id, BlobReader(), ssl=up.ssl("decode"), timeout_s=10)
        await client.release(relay, kv_id, ssl=up.ssl("decode"))
        writer = BlobWriter.for_state(state, kv_id=kv_id)
        frames = [writer.header_frame()]
        for layer in state.layers:
            frames += writer.add_layer(layer)
        return frames + writer.finish(None)

    return kv_id, asyncio.run(take())


def test_a_consumer_without_the_stores_ca_recomputes(up: Up) -> None:
    kv_id, frames = _real_blob(up)
    other = OtherCAStore(Path(tempfile.mkdtemp(prefix="prfaas-other-ca-")))
    try:
        other.call(_fill(other.store, kv_id, frames))
        decode_port = _vllm(up.proc, "kv_consumer")[1]
        before, started = _prompt_sources(decode_port), time.monotonic()
        text = _local_text(decode_port, up.token_ids,
                           kv_transfer_params={"do_remote_prefill": True, "kv_id": kv_id,
                                               "kv_address": other.address})
        seconds, after = time.monotonic() - started, _prompt_sources(decode_port)
        print(f"\n  -> recomputed in {seconds:.1f} s")
        assert text == up.reference and seconds < FAULT_S
        assert after["external_kv_transfer"] == before.get("external_kv_transfer", 0)
        assert after["local_compute"] - before.get("local_compute", 0) == len(up.token_ids)
        assert other.store.stats().blobs == 1  # never read (nor released): the consumer refused the store
    finally:
        other.close()
    _assert_no_blob_left(up)


async def _fill(store: BlobStore, kv_id: str, frames: list[bytes]) -> None:
    fill(store, kv_id, frames)


def test_a_relay_that_stops_mid_request(up: Up) -> None:
    relay = _role(up.proc, "relay")
    try:
        outcome = _during(lambda: os.kill(relay, signal.SIGSTOP), up)
    finally:
        os.kill(relay, signal.SIGCONT)
    _assert_exact_or_clear_error(up, outcome)
    _assert_prefilled_locally(outcome)
    _wait_relay_healthy(up)
    _assert_no_blob_left(up)
    _assert_remote_exact(up)


def test_a_relay_killed_mid_request(up: Up) -> None:
    relay = _role(up.proc, "relay")
    outcome = _during(lambda: os.kill(relay, signal.SIGKILL), up, stream=True)
    _assert_exact_or_clear_error(up, outcome)
    _assert_prefilled_locally(outcome)
    _wait_relay_healthy(up, not_pid=relay)  # prfaas up restarted it
    _assert_no_blob_left(up)
    _assert_remote_exact(up)


def test_a_prefill_vllm_killed_mid_request(up: Up) -> None:
    server, _ = _vllm(up.proc, "kv_producer")
    engine = [server, *descendants(server)]
    _assert_no_blob_left(up)
    outcome = _during(lambda: os.kill(server, signal.SIGKILL), up)
    _assert_exact_or_clear_error(up, outcome)
    _assert_prefilled_locally(outcome)
    line = line_saying(up.proc, "prefill prefill-0 exited with code 1", HEAL_S)  # fail()'s code, not SIGINT's
    assert "restarting" in line, line
    deadline = time.monotonic() + 30
    while left := [p for p in engine if alive(p)]:
        assert time.monotonic() < deadline, f"the dead vLLM server left processes behind: {left}"
        time.sleep(0.2)
    _assert_no_blob_left(up, producer=False)  # the producer's store went with its server

"""A whole deployment through ``prfaas up --tls`` (mutual TLS 1.3 on every hop) with the OpenAI client: the same
tokens as the same deployment without TLS, the KV really took the remote path, and plaintext is refused
(403 ``KV_UNAUTHORIZED``, sent in plaintext before anything the client sent is read)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from prfaas.security.local import ca_client_context
from tests.services.deploy import free_port

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


@contextmanager
def up(tls: bool) -> Iterator[tuple[str, httpx.Client]]:
    port = free_port()
    cmd = [sys.executable, "-m", "prfaas", "up", "--model", "tiny-llama", "--port", str(port),
           "--offload-threshold", "16", *(["--tls"] if tls else [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = next((line for line in proc.stdout if "prfaas is up" in line), "")
        assert line, "deployment did not come up"
        found = re.search(r"CA (\S+)\)", line)
        assert bool(found) == tls
        verify = ca_client_context(found.group(1)) if found else True
        scheme = "https" if tls else "http"
        with httpx.Client(verify=verify, timeout=60) as client:
            yield f"{scheme}://127.0.0.1:{port}", client
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def complete(url: str, client: httpx.Client) -> tuple[str, dict[str, object]]:
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", http_client=client)
    reply = api.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12, temperature=0)
    return reply.choices[0].text, dict(reply.model_extra or {}).get("prfaas", {})  # type: ignore[return-value]


@pytest.mark.timeout(600)
def test_mtls_deployment_gives_the_same_tokens() -> None:
    with up(tls=False) as (url, client):
        plain_text, _ = complete(url, client)
    with up(tls=True) as (url, client):
        text, extension = complete(url, client)
        assert extension["route"] == "remote" and not extension["fallback"], extension
        plain = httpx.get(url.replace("https", "http") + "/health", timeout=5)  # answered without reading it
        assert plain.status_code == 403 and plain.json()["error"]["code"] == "KV_UNAUTHORIZED"
    assert text == plain_text

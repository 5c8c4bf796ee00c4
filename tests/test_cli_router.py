"""``prfaas admin`` and ``prfaas bench run`` against a real ``prfaas serve router`` process: over HTTPS with the
CA of ``prfaas certs init`` (``--ca`` and ``$PRFAAS_CA``; without it a one-line refusal that names ``--ca``), and
``prfaas admin weight`` refusing a name no pool has unless ``--admit``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prfaas.security import certs
from prfaas.tls import https_verify
from tests.services.deploy import free_port


@contextlib.contextmanager
def router(config: Path) -> Iterator[tuple[str, Path | None]]:
    """``prfaas serve router`` on a free port; yields its URL and the CA when the config has TLS."""
    port = free_port()
    tls = "tls:" in config.read_text()
    ca = config.parent / "pki" / "ca.pem" if tls else None
    url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prfaas", "serve", "router", "--port", str(port), "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/admin/pools", timeout=1, verify=https_verify(str(ca) if ca else None)
                             ).status_code == 200:
                    break
            time.sleep(0.1)
        yield url, ca
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        if proc.stderr:
            proc.stderr.close()


def prfaas(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("PRFAAS_CA", "SSL_CERT_FILE")}
    return subprocess.run([sys.executable, "-m", "prfaas", *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **(env or {})})


@pytest.fixture
def tls_config(tmp_path: Path) -> Path:
    paths = certs.init(tmp_path / "pki")
    config = tmp_path / "prfaas.yaml"
    config.write_text(f"tls: {{ca: {paths['ca']}, cert: {paths['router']}, key: {tmp_path / 'pki' / 'router.key'}, "
                      "required: true}\n")
    return config


def test_admin_and_bench_take_the_routers_ca_by_flag_or_environment(tls_config: Path, tmp_path: Path) -> None:
    with router(tls_config) as (url, ca):
        assert ca is not None
        refused = prfaas("admin", "check", "--router", url)
        by_flag = prfaas("admin", "check", "--router", url, "--ca", str(ca), "--json")
        by_env = prfaas("admin", "check", "--router", url, "--json", env={"PRFAAS_CA": str(ca)})
        bench_refused = prfaas("bench", "run", "--target", url, "--out", str(tmp_path / "a"), "--requests", "1",
                               "--network", "normal", "--input-len", "8", "--output-len", "2", "--quiet")
        bench = prfaas("bench", "run", "--target", url, "--out", str(tmp_path / "b"), "--requests", "1",
                       "--network", "normal", "--input-len", "8", "--output-len", "2", "--quiet",
                       env={"PRFAAS_CA": str(ca)})
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--ca" in refused.stderr and "certificate" in refused.stderr, refused.stderr
    for done in (by_flag, by_env):
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.strip().splitlines()[-1])["instances"] == 0
    assert bench_refused.returncode == 2 and "--ca" in bench_refused.stderr, bench_refused.stderr
    # Connected over TLS: the one request reached the router, which has no instances to serve it.
    assert bench.returncode == 1, bench.stderr[-2000:]
    failures = json.loads((tmp_path / "b" / "results.json").read_text())["cells"][0]["metrics"]["failures"]
    assert failures and failures[0]["status"] == 503, failures


def test_admin_weight_refuses_a_name_no_pool_has_unless_admitted(tmp_path: Path) -> None:
    config = tmp_path / "prfaas.yaml"
    config.write_text("pools: {m: 100}\n")
    with router(config) as (url, _):
        unknown = prfaas("admin", "weight", "nosuchpool", "5", "--router", url)
        pools = httpx.get(f"{url}/admin/pools", timeout=10).json()["configured"]
        configured = prfaas("admin", "weight", "m", "50", "--router", url)
        admitted = prfaas("admin", "weight", "m-v2", "5", "--admit", "--router", url)
        after = httpx.get(f"{url}/admin/pools", timeout=10).json()["configured"]
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1, unknown.stderr
    assert "no pool is named 'nosuchpool'" in unknown.stderr and "--admit" in unknown.stderr
    assert pools == {"m": 100}  # nothing was changed
    assert configured.returncode == 0, configured.stderr
    assert admitted.returncode == 0 and "m-v2: admitted at weight 5" in admitted.stdout, admitted.stderr
    assert after == {"m": 50, "m-v2": 5}

"""``benchmarks/tls_copy.py``, the bare TLS copy ``benchmarks/transport.py`` sets beside prfaas: a real TLS 1.3
copy over loopback moves every byte and reports time and CPU, and the transport table divides by it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from prfaas.bench.transfer import self_signed

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "benchmarks" / "tls_copy.py"


def _transport() -> ModuleType:
    spec = importlib.util.spec_from_file_location("transport_bench", ROOT / "benchmarks" / "transport.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_bare_tls_copy_moves_every_byte_and_reports_time_and_cpu(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    size = 8 << 20
    sender = subprocess.Popen([sys.executable, str(PEER), "send", "stdlib", "127.0.0.1", "0", str(size), str(cert),
                               str(key)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None and sender.stdin is not None
        port = sender.stdout.readline().split()[1]
        out = subprocess.run([sys.executable, str(PEER), "recv", "stdlib", "127.0.0.1", port, str(size), str(cert)],
                             capture_output=True, text=True, timeout=60, check=True)
        sent_cpu = float(sender.stdout.readline())
        sender.stdin.close()
        assert sender.wait(10) == 0
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    seconds, cpu = map(float, out.stdout.split())
    assert seconds > 0 and cpu > 0 and sent_cpu > 0


def test_tls_cost_divides_prfaas_tls_by_the_bare_copy_on_the_same_path() -> None:
    rows = [{"path": "loopback", "tool": "prfaas", "streams": 1, "gbps": 20.0, "cpu_s_per_gb": 0.3},
            {"path": "loopback", "tool": "prfaas tls", "streams": 1, "gbps": 8.0, "cpu_s_per_gb": 0.8},
            {"path": "loopback", "tool": "python tls copy", "streams": 1, "gbps": 10.0, "cpu_s_per_gb": 0.7},
            {"path": "veth-1gbit", "tool": "prfaas", "streams": 1, "gbps": 1.0},
            {"path": "veth-1gbit", "tool": "prfaas tls", "streams": 1, "gbps": 0.9}]
    cost = {c["path"]: c for c in _transport().tls_cost(rows)}
    assert cost["loopback"]["goodput_ratio"] == pytest.approx(0.4)
    assert cost["loopback"]["vs_tls_copy"] == pytest.approx(0.8)
    assert cost["loopback"]["tls_copy_cpu_s_per_gb"] == 0.7
    assert cost["veth-1gbit"]["vs_tls_copy"] is None  # no copy measured there: shown as "–", not invented

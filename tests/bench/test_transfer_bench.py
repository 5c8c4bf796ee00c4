"""`prfaas bench transfer --tls` end to end: its relay's throw-away certificate is made in-process (cryptography),
so the command runs where no `openssl` binary is on the PATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_transfer_over_tls_needs_no_openssl_binary(tmp_path: Path) -> None:
    bare = tmp_path / "bin"  # a PATH with the interpreter only
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bare)}
    done = subprocess.run([sys.executable, "-m", "prfaas", "bench", "transfer", "--size", "4MiB", "--tls",
                           "--repeat", "1", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["tls"] is True and out["gbps"] > 0 and out["bytes"] >= 4 << 20

"""A canary that crashes: `prfaas admin rollout` sees the router's errors rise during a step, puts the weights
back (old pool 100, new 0), drains nothing and exits 1; the old pool keeps serving every later request."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from prfaas.cli import app
from tests.services.deploy import deployment
from tests.services.test_faults import config_file, instances, pid_of
from tests.services.test_upgrade import (
    MODEL,
    PAUSE_S,
    THRESHOLD,
    Load,
    _admin,
    _spawn,
    _stop,
    _wait_registered,
    variant_model,
)


def test_a_failing_canary_is_rolled_back(tmp_path: Path) -> None:
    variant = variant_model(tmp_path / "v2")
    # a dead instance stays "healthy" until its heartbeats are 10 s late: long enough for the step to see it fail
    config = config_file(tmp_path, heartbeat_timeout_ms=10000)
    with deployment(MODEL, "direct", threshold=THRESHOLD, extra=("--config", config)) as (url, _):
        old = httpx.get(f"{url}/admin/pools").json()["pools"][0]["pool"]
        _admin("weight", old, "100", "--router", url)
        _admin("weight", MODEL, "0", "--router", url)
        new = [_spawn(url, "decode", "decode-v2", variant, config, tmp_path / "decode-v2.log")]
        try:
            _wait_registered(url, {"decode-v2"}, new)
            with Load(url, 2, PAUSE_S) as load:
                os.kill(pid_of(url, "decode-v2"), signal.SIGKILL)  # the canary crashes before traffic moves
                new_key = next(p["pool"] for p in httpx.get(f"{url}/admin/pools").json()["pools"] if p["pool"] != old)
                result = CliRunner().invoke(app, ["admin", "rollout", new_key, "--router", url, "--steps", "50,100",
                                                  "--hold", "2s"])
                rolled_back = time.monotonic()
                time.sleep(1.0)
        finally:
            _stop(new)
        assert result.exit_code == 1 and "rolled back" in result.output, result.output
        weights = {p["pool"]: p["weight"] for p in httpx.get(f"{url}/admin/pools").json()["pools"]}
        assert weights == {old: 100, new_key: 0}
        failed = [r for r in load.results if r.status != 200]
        assert failed and all(r.status == 503 and "KV_UNAVAILABLE" in r.error for r in failed)
        later = [r for r in load.results if r.started > rolled_back]
        assert later and all(r.status == 200 and r.extension["pool"] == old for r in later)
        assert {"prefill-0", "decode-0"} <= {i["instance_id"] for i in instances(url)}  # nothing was drained

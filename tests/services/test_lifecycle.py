"""Deployment lifecycle: SIGTERM in the middle of a streaming request leaves no process behind."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from tests.services.deploy import deployment


def test_sigterm_mid_request_leaves_nothing_behind() -> None:
    with deployment("tiny-llama", "relay", threshold=0) as (url, proc):
        started = threading.Event()

        def long_request() -> None:
            body = {"model": "tiny-llama", "prompt": "hello " * 200, "max_tokens": 4000, "stream": True,
                    "temperature": 0}
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                    for _ in reply.iter_lines():
                        started.set()
            except httpx.HTTPError:
                pass
            started.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        assert started.wait(30)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        thread.join(60)
        assert not thread.is_alive()
    # leaving the context asserts that no child of the deployment is still alive


def test_a_busy_port_is_a_clear_error_before_any_role_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "prfaas", "up", "--model", "tiny-llama", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"error: INVALID_REQUEST: the router cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "serve" not in done.stderr  # no role was started

"""The load generators users already run against vLLM, run as docs/api.md's load-generator section shows them against
a real ``prfaas up``: each finds the served model's tokenizer through ``/v1/models`` (``root``) with no
``--tokenizer``, sends a few prompts, and reports TTFT and inter-token latency with no failed request.

``vllm bench serve`` runs from .venv-vllm (``make vllm``), AIPerf and GuideLLM from their own pinned virtualenvs
(``make loadtools``); a tool whose virtualenv is absent is skipped, saying so. Each tool runs in its own session,
bounded in time, and leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.services.deploy import alive, deployment

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-llama"  # SmolLM2's tokenizer, random weights: fast to load
PROMPTS, INPUT_TOKENS, OUTPUT_TOKENS = 4, 32, 8
TOOL_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str]]:
    """The router's URL and the ``root`` that ``/v1/models`` gives for its model."""
    with deployment(MODEL, "direct") as (url, _):
        yield url, httpx.get(f"{url}/v1/models").json()["data"][0]["root"]
        stores = httpx.get(f"{url}/admin/kv").json()
        assert stores and all(report["store"]["blobs"] == 0 for report in stores.values()), stores


def _needs(path: Path, how: str) -> Path:
    if not os.access(path, os.X_OK):
        pytest.skip(f"{path.relative_to(REPO)} is missing ({how})")
    return path


def _run(cmd: list[str], cwd: Path) -> str:
    """Run a tool in its own process group; its output, or the test fails with it. Whatever it started is gone
    when this returns (killed with the group on a timeout)."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TOOL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[0]} ran past {TOOL_TIMEOUT_S} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}"
    assert _group_ends(proc.pid), f"{cmd[0]} left processes behind"
    return out


def _group_ends(pgid: int, within_s: float = 10.0) -> bool:
    """Whether every process of the group is gone within ``within_s`` (a tool's multiprocessing resource tracker
    outlives it by a moment)."""
    deadline = time.monotonic() + within_s
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _group_alive(pgid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and alive(int(entry)):
                return True
    return False


def test_vllm_bench_serve_needs_only_the_url(served: tuple[str, str], tmp_path: Path) -> None:
    url, root = served
    python = _needs(REPO / ".venv-vllm" / "bin" / "python", "make vllm")
    _run([str(python), "-m", "prfaas.vllm.launch", "bench", "serve", "--base-url", url, "--dataset-name",
          "random", "--random-input-len", str(INPUT_TOKENS), "--random-output-len", str(OUTPUT_TOKENS),
          "--num-prompts", str(PROMPTS), "--max-concurrency", "2", "--save-result", "--result-dir", str(tmp_path),
          "--result-filename", "result.json"], tmp_path)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["tokenizer_id"] == root and result["completed"] == PROMPTS and result["failed"] == 0, result
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0


def test_aiperf_takes_the_root_as_its_model(served: tuple[str, str], tmp_path: Path) -> None:
    url, root = served
    aiperf = _needs(REPO / ".venv-aiperf" / "bin" / "aiperf", "make loadtools")
    _run([str(aiperf), "profile", "--model", root, "--url", url, "--endpoint-type", "completions", "--streaming",
          "--request-count", str(PROMPTS), "--concurrency", "2", "--synthetic-input-tokens-mean", str(INPUT_TOKENS),
          "--output-tokens-mean", str(OUTPUT_TOKENS), "--ui-type", "none", "--artifact-dir", str(tmp_path / "out")],
         tmp_path)
    (export,) = (tmp_path / "out").rglob("profile_export_aiperf.json")
    report: dict[str, Any] = json.loads(export.read_text())
    assert report["request_count"]["avg"] == PROMPTS, report.keys()
    assert report.get("error_request_count", {}).get("avg", 0) == 0, report["error_request_count"]
    assert report["time_to_first_token"]["p50"] > 0 and report["inter_token_latency"]["p50"] > 0


def test_guidellm_takes_the_root_as_its_model(served: tuple[str, str], tmp_path: Path) -> None:
    url, root = served
    guidellm = _needs(REPO / ".venv-guidellm" / "bin" / "guidellm", "make loadtools")
    out = tmp_path / "benchmarks.json"
    _run([str(guidellm), "run", "--backend", f"kind=openai_http,target={url},model={root}",
          "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={PROMPTS}",
          "--data", f"kind=synthetic_text,prompt_tokens={INPUT_TOKENS},output_tokens={OUTPUT_TOKENS}",
          "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp_path)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": PROMPTS, "errored": 0, "incomplete": 0, "total": PROMPTS}
    assert metrics["time_to_first_token_ms"]["successful"]["median"] > 0
    assert metrics["inter_token_latency_ms"]["successful"]["median"] > 0

"""The in-process decode loop a benchmark sets beside served rows: a load runs every prompt to its last token, and a
bad request (or line) is answered with an error while the loop goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from prfaas.bench.inprocess import InProcess
from tests.conftest import random_prompt


def test_a_load_runs_every_prompt_to_its_last_token(engines: Any) -> None:
    engine = engines("tiny-llama")
    driver = InProcess(engine, max_batch=4, chunk_tokens=16)
    prompts = [random_prompt(30 + 11 * i, seed=i) for i in range(5)]
    try:
        done = driver.answer(json.dumps({"concurrency": 3, "prompts": prompts, "max_tokens": 6}))
        bad = driver.answer(json.dumps({"concurrency": 0, "prompts": prompts, "max_tokens": 6}))
        outside = driver.answer(json.dumps({"concurrency": 1, "prompts": [[10 ** 9]], "max_tokens": 6}))
        again = driver.answer(json.dumps({"concurrency": 1, "prompts": prompts[:1], "max_tokens": 2}))
    finally:
        driver.close()
    assert done["wall"] > 0 and [run["tokens"] for run in done["runs"]] == [6] * 5
    assert all(run["ttft"] > 0 and run["tpot"] > 0 for run in done["runs"])
    assert "at least 1" in bad["error"] and "token ids" in outside["error"]
    assert [run["tokens"] for run in again["runs"]] == [2]


def test_the_worker_says_ready_answers_each_line_and_ends_with_its_input() -> None:
    lines = [json.dumps({"concurrency": 2, "prompts": [random_prompt(20, seed=1), random_prompt(25, seed=2)],
                         "max_tokens": 3}), "not json"]
    done = subprocess.run([sys.executable, "-m", "prfaas.bench.inprocess", "--model", "tiny-llama", "--dtype",
                           "float32", "--batch", "4"], input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    ready, answer, error = (json.loads(line) for line in done.stdout.splitlines())
    assert ready == {"ready": "float32"}
    assert [run["tokens"] for run in answer["runs"]] == [3, 3]
    assert error["error"].startswith("JSONDecodeError")

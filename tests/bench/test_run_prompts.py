"""``prfaas bench run`` against a model whose vocabulary is smaller than the matrix's token-id range, and the report
of requests the target refuses. Real processes and sockets: ``prfaas up`` with a tiny model directory (random
weights, built from config, 640 tokens), ``prfaas bench run`` as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.deploy import deployment

VOCAB = 640


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-llama's shape with a 640-token vocabulary, beside SmolLM2's tokenizer (prompts are token ids)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prfaas.engine import models

    directory = tmp_path_factory.mktemp("small-vocab")
    config = models.tiny_config("tiny-llama")
    config.vocab_size = VOCAB
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    AutoTokenizer.from_pretrained(models.smollm2_dir()).save_pretrained(directory)
    return directory


def _bench(url: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "prfaas", "bench", "run", "--target", url, "--requests", "2", "--output-len", "2",
           "--concurrency", "1", "--network", "normal", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_prompts_stay_within_the_vocabulary_and_refusals_are_reported_by_status_and_code(
        small_vocab_model: Path, tmp_path: Path) -> None:
    with deployment(str(small_vocab_model), "relay", threshold=16) as (url, _):
        fits = _bench(url, tmp_path / "fits", "--input-len", "24", "--quiet")
        refused = _bench(url, tmp_path / "refused", "--input-len", "9000")  # over the model's 8192-token context
    results = json.loads((tmp_path / "fits" / "results.json").read_text())
    cell = results["cells"][0]
    assert cell["metrics"]["ok"] == 2, cell["metrics"]["failures"]  # ids drawn from [1000, 20000) were all 400s
    assert results["meta"]["prompt_ids"][1] == VOCAB, results["meta"]
    assert fits.returncode == 0 and "acceptance: PASS" in fits.stdout, fits.stdout[-1500:] + fits.stderr[-1500:]

    assert refused.returncode == 1, refused.stderr[-1500:]
    failures = json.loads((tmp_path / "refused" / "results.json").read_text())["cells"][0]["metrics"]["failures"]
    assert [(f["status"], f["count"]) for f in failures] == [(400, 2)], failures
    assert "8192" in failures[0]["message"]
    shown = f"2 × HTTP 400 {failures[0]['code']}"
    assert shown in refused.stdout and shown in refused.stderr  # the table, and the live progress line
    assert shown in (tmp_path / "refused" / "report.md").read_text()

"""Prefill here → blob → decode in another process must equal ``model.generate`` greedy, token for token."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from prfaas.engine import BUILTIN_MODELS
from prfaas.engine.worker import DecodeWorker
from prfaas.kv import encode_state
from tests.conftest import random_prompt

NEW_TOKENS = 12
LENGTHS = {"short": 23, "long": 1100}


@pytest.fixture(scope="module", params=BUILTIN_MODELS)
def pair(request: pytest.FixtureRequest, engines) -> Iterator[tuple]:
    name = request.param
    engine = engines(name)
    with DecodeWorker(name, device=os.environ.get("PRFAAS_TEST_DEVICE", "cpu")) as worker:
        yield engine, worker
    assert worker.proc.returncode == 0  # the worker exited on its own when its stdin closed


@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
def test_disaggregated_equals_monolithic(pair: tuple, length: int) -> None:
    engine, worker = pair
    ids = random_prompt(length, seed=7)
    reference = engine.generate(ids, NEW_TOKENS)
    out = engine.prefill(ids)
    reply = worker.decode(encode_state(out.kv, codec="none"), out.next_token, NEW_TOKENS - 1)
    assert [out.next_token, *reply["tokens"]] == reference[: 1 + len(reply["tokens"])]
    assert len(reply["tokens"]) == NEW_TOKENS - 1 or reply["tokens"][-1] in engine.eos_token_ids


def test_worker_fingerprint_matches_a_second_load(pair: tuple) -> None:
    engine, worker = pair
    assert worker.fingerprint == engine.fingerprint.to_wire()


def test_chat_prompt_answers_sensibly(engines) -> None:
    from prfaas.demo import chat_ids

    engine = engines("smollm2-135m")
    ids = chat_ids(engine, "What is the capital of France? Answer in one sentence.")
    out = engine.prefill(ids)
    tokens = [out.next_token, *engine.decode(out.kv, out.next_token, 15)]
    assert "Paris" in engine.tokenizer.decode(tokens)
    assert tokens == engine.generate(ids, 16)[: len(tokens)]

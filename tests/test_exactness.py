"""The near-tie rule the serving tests apply to texts: the monolithic text passes with no near-tie, a text that
took the runner-up at a near-tie passes with one, and one that took it where the margin is wide fails."""

from __future__ import annotations

import random
from typing import Any

import torch

from tests.conftest import get_engine
from tests.exactness import NEAR_TIE, near_ties_in_text

PROMPT = [random.Random(9).randrange(1000, 40000) for _ in range(8)]  # tiny-llama: a near-tie at step 6
NEW = 12


def _branch(engine: Any, step: int) -> tuple[str, float]:
    """Greedy, but the runner-up at ``step``; returns the text and that step's top-two margin."""
    cache, tokens, margin = engine.new_cache(), list(PROMPT), 0.0
    row = engine._forward(tokens, cache, start=0)
    for i in range(NEW):
        values, ids = torch.topk(row, 2)
        if i == step:
            margin = float(values[0] - values[1])
        tokens.append(int(ids[1] if i == step else ids[0]))
        row = engine._forward(tokens[-1:], cache, start=len(tokens) - 1)
    return engine.tokenizer.decode(tokens[len(PROMPT):], skip_special_tokens=True), margin


def test_near_ties_are_counted_and_real_divergences_fail() -> None:
    engine = get_engine("tiny-llama")
    greedy = engine.tokenizer.decode(engine.generate(PROMPT, NEW), skip_special_tokens=True)
    assert near_ties_in_text(engine, PROMPT, greedy, NEW) == 0
    tie, margin = _branch(engine, 6)
    assert margin < NEAR_TIE and tie != greedy
    assert near_ties_in_text(engine, PROMPT, tie, NEW) == 1
    wide, margin = _branch(engine, 3)
    assert margin > 100 * NEAR_TIE
    assert near_ties_in_text(engine, PROMPT, wide, NEW) is None
    assert near_ties_in_text(engine, PROMPT, greedy[:-2] + "zz", NEW) is None

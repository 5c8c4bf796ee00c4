"""CONTRACTS' exactness rule for tests: greedy tokens under batching equal a monolithic run except at a step where
the monolithic run's top-two logit margin is below 1e-4 (a near-tie); such steps are counted, never hidden."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

NEAR_TIE = 1e-4


def first_divergence_is_a_near_tie(engine: Any, ids: list[int], got: list[int], ref: list[int]) -> bool:
    """True when the first step where ``got`` leaves ``ref`` is one where the monolithic top-two margin is under
    1e-4."""
    step = next(i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
    if step == 0:
        row = engine._forward(ids, engine.new_cache(), start=0)
    else:
        row = engine.continuation_logits(engine.prefill(ids).kv, ref[:step])[-1]
    top2 = torch.topk(row, 2).values
    return float(top2[0] - top2[1]) < NEAR_TIE


def near_ties_in_text(engine: Any, prompt: Sequence[int], text: str, max_tokens: int) -> int | None:
    """For a served greedy ``text`` (only text comes back over the API): walk the monolithic run fed with what was
    served, where each step must be the argmax, or the runner-up at a near-tie. Returns the number of near-ties
    taken, or None when the text is not such a run (a real divergence)."""
    cache, tokens, ties = engine.new_cache(), [int(t) for t in prompt], 0
    row = engine._forward(tokens, cache, start=0)
    for _ in range(max_tokens):
        values, ids = torch.topk(row, 2)
        choices = [int(ids[0])] + ([int(ids[1])] if float(values[0] - values[1]) < NEAR_TIE else [])
        pick = next((c for c in choices if _prefix(engine, [*tokens[len(prompt):], c], text)), None)
        if pick is None:
            return None
        ties += pick != choices[0]
        tokens.append(pick)
        if pick in engine.eos_token_ids:
            break
        row = engine._forward([pick], cache, start=len(tokens) - 1)
    generated = engine.tokenizer.decode(tokens[len(prompt):], skip_special_tokens=True)
    return ties if generated == text else None


def _prefix(engine: Any, generated: list[int], text: str) -> bool:
    """Whether these tokens decode to a start of ``text`` (a token ending mid-character decodes to U+FFFD)."""
    return text.startswith(engine.tokenizer.decode(generated, skip_special_tokens=True).rstrip("\ufffd"))

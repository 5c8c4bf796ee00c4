"""``pick_token``: the next token from a row of logits, greedy or seeded, the same on every host; ``pick_tokens``:
one per row of a batch's logits.

Greedy picks take the argmax of the logits in float32: the conversion is exact, so the index is the same, and
torch's CPU argmax runs several times faster on float32 than on bfloat16."""

from __future__ import annotations

import torch

from prfaas.messages import SamplingParams

GREEDY_BELOW = 1e-6  # a temperature under this is greedy: the scaled logits would be all but one -inf anyway


def pick_token(logits: torch.Tensor, sampling: SamplingParams | None, step: int) -> int:
    """Greedy, or a draw from a generator seeded by (seed, step): the same on every host.

    Numerically safe for any temperature ``SamplingParams`` lets through, and for a caller that bypasses it: the
    logits are scaled in float32 after subtracting their maximum, so the largest is exactly 0 and the rest are
    ≤ 0 (at worst -inf, probability 0) — never inf or NaN; a temperature under ``GREEDY_BELOW`` is greedy."""
    if sampling is None or greedy(sampling):
        return int(torch.argmax(logits.float()))
    logits = logits.float()
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    generator = torch.Generator().manual_seed((sampling.seed * 1_000_003 + step) % (2**63))
    return int(torch.multinomial(probs, 1, generator=generator))


def pick_tokens(logits: torch.Tensor, samplings: list[SamplingParams | None], steps: list[int]) -> list[int]:
    """``pick_token`` of every row of ``[rows, vocab]`` logits, the greedy rows in one argmax."""
    picked = [0] * len(samplings)
    argmax = [i for i, s in enumerate(samplings) if greedy(s)]
    if argmax:
        rows = logits if len(argmax) == len(samplings) else logits[argmax]
        for i, token in zip(argmax, torch.argmax(rows.float(), dim=-1).tolist(), strict=True):
            picked[i] = int(token)
    for i, sampling in enumerate(samplings):
        if not greedy(sampling):
            picked[i] = pick_token(logits[i], sampling, steps[i])
    return picked


def greedy(sampling: SamplingParams | None) -> bool:
    return sampling is None or sampling.temperature < GREEDY_BELOW

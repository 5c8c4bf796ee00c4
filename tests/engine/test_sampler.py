"""The sampler cannot produce inf/NaN whatever temperature reaches it (a caller may bypass ``SamplingParams``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from prfaas.engine.sampling import pick_token, pick_tokens
from prfaas.errors import InvalidRequest
from prfaas.messages import SamplingParams


def unchecked(temperature: float, top_p: float = 1.0) -> SamplingParams:
    params = SamplingParams(temperature=1.0, top_p=top_p, seed=7)
    object.__setattr__(params, "temperature", temperature)  # what a caller skipping the checks would send
    return params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, 1e-6, 1e-3])
def test_tiny_temperatures_pick_the_argmax_without_overflow(dtype: torch.dtype, temperature: float) -> None:
    logits = (torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 20).to(dtype)
    for step in range(5):
        assert pick_token(logits, unchecked(temperature, top_p=0.9), step) == int(torch.argmax(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_picks_what_each_row_picks_alone(dtype: torch.dtype) -> None:
    """Greedy rows share one argmax; sampled rows draw as they would alone; ties go to the first index either way."""
    logits = (torch.randn(6, 4096, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie
    samplings = [None, SamplingParams(temperature=0.8, top_p=0.9, seed=5), None, SamplingParams(), None,
                 SamplingParams(temperature=1.2, seed=9)]
    steps = [0, 3, 1, 4, 2, 7]
    alone = [pick_token(logits[i], samplings[i], steps[i]) for i in range(6)]
    assert pick_tokens(logits, samplings, steps) == alone
    assert alone[2] == 10
    assert pick_tokens(logits[[0, 2, 4]], [None] * 3, [0] * 3) == [alone[0], alone[2], alone[4]]


def test_ordinary_sampling_is_seeded_and_in_range() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3)
    picks = [pick_token(logits, params, step) for step in range(20)]
    assert picks == [pick_token(logits, params, step) for step in range(20)]
    assert all(0 <= p < 100 for p in picks) and len(set(picks)) > 1


@pytest.mark.parametrize("values", [{"temperature": 1e-40}, {"temperature": float("nan")}, {"temperature": 2.5},
                                    {"temperature": True}, {"top_p": 0.0}, {"top_p": float("inf")},
                                    {"seed": 1 << 64}, {"seed": 1.5}])
def test_sampling_params_refuse_what_the_sampler_cannot_serve(values: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        dataclasses.replace(SamplingParams(), **values)  # type: ignore[arg-type]
    assert refused.value.param == next(iter(values))

"""Fields prfaas does not serve are refused by name, except with the value that asks for nothing (the default)."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.errors import InvalidRequest
from prfaas.services import openai_api

BODY = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("extra", [{"best_of": 1}, {"response_format": {"type": "text"}}, {"top_logprobs": 0},
                                   {"logprobs": False}, {"logprobs": None}, {"logit_bias": {}}, {"tools": []}])
def test_a_value_that_asks_for_nothing_passes(extra: dict[str, Any]) -> None:
    assert openai_api.parse({**BODY, **extra}, chat=False).prompt == "hi"


@pytest.mark.parametrize("extra", [{"best_of": 2}, {"response_format": {"type": "json_object"}},
                                   {"top_logprobs": 2}, {"logprobs": 1}, {"echo": True}])
def test_a_value_that_asks_for_something_is_refused_by_name(extra: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as refused:
        openai_api.parse({**BODY, **extra}, chat=False)
    assert refused.value.param == next(iter(extra))

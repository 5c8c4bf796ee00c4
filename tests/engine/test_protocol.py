"""Both engines implement the ``Engine`` protocol the roles use, each with its own constructor: the synthetic one is
no transformers engine in disguise, and both refuse a bad prompt through the same public ``check_prompt``."""

from __future__ import annotations

from typing import Any

import pytest

from prfaas.engine import Engine, EngineBase, TransformersEngine, load_engine
from prfaas.engine.protocol import EngineInfo
from prfaas.engine.synthetic import SyntheticEngine
from prfaas.errors import InvalidRequest

MEMBERS = sorted({name for proto in (EngineInfo, Engine) for name in vars(proto) if not name.startswith("_")})


@pytest.fixture(params=["tiny-llama", "synthetic-kimi-linear-48b"])
def engine(request: pytest.FixtureRequest, engines: Any) -> Any:
    return engines(request.param) if request.param.startswith("tiny") else load_engine(request.param)


def test_the_protocol_names_what_the_roles_use() -> None:
    assert {"prefill", "prefill_batch", "prefill_chunks", "restore", "forward_rows", "tokenizer", "fingerprint",
            "layer_table", "kv_footprint", "check_prompt"} <= set(MEMBERS)


def test_each_engine_has_every_member_of_the_protocol(engine: Any) -> None:
    assert isinstance(engine, EngineBase)
    missing = [name for name in MEMBERS if not hasattr(engine, name)]
    assert not missing
    fixed, per_token = engine.kv_footprint
    assert per_token > 0 and fixed >= 0
    assert len(engine.layer_table) == engine.num_layers


def test_the_synthetic_engine_is_not_a_transformers_engine() -> None:
    assert not issubclass(SyntheticEngine, TransformersEngine)
    engine = load_engine("synthetic-minimax-m2")
    assert not hasattr(engine, "model") and not hasattr(engine, "_cache_cls")  # nothing faked to look like one


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([-1], "token ids must be in"),
                                             ([10**9], "token ids must be in")])
def test_both_engines_refuse_a_bad_prompt_alike(engine: Any, prompt: list[int], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.check_prompt(prompt)
    with pytest.raises(InvalidRequest, match=message):
        engine.prefill_batch([[1, 2], prompt])

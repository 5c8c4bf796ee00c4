from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from prfaas.engine import load_engine
from prfaas.engine.packed import PackedLinear, pack, packable
from tests.conftest import random_prompt

DTYPES = [d for d in ("float32", "bfloat16") if packable(getattr(torch, d))]


def _linears(model: nn.Module, kind: type) -> list[str]:
    return [name for name, module in model.named_modules() if type(module) is kind]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_a_packed_engine_computes_what_the_plain_one_does(name: str, dtype: str) -> None:
    plain, packed = (load_engine(name, dtype=dtype, packed=p) for p in (False, True))
    assert _linears(packed.model, PackedLinear) == _linears(plain.model, nn.Linear)
    assert not _linears(packed.model, nn.Linear)
    assert packed.fingerprint == plain.fingerprint  # hashed over the weights as loaded
    prompt = random_prompt(120, seed=3)
    a, b = plain.prefill(prompt), packed.prefill(prompt)
    if dtype == "bfloat16":  # oneDNN runs plain bfloat16 linears too: the same products, bit for bit
        assert a.next_token == b.next_token
        for x, y in zip(a.kv.layers, b.kv.layers, strict=True):
            assert all(np.array_equal(p, q) for p, q in zip(x.tensors.values(), y.tensors.values(), strict=True))
    else:  # MKL against oneDNN: the last bits of a sum differ
        logits = [e.continuation_logits(a.kv, [a.next_token, 5, 7]) for e in (plain, packed)]
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_packed_linear_reads_and_saves_as_a_plain_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.Sequential(nn.Linear(8, 4, bias=False)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(3, 16)
    expected = model(x)
    assert pack(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    torch.testing.assert_close(model(x), expected)
    assert torch.equal(model[0].weight, before["0.weight"])
    saved = model.state_dict()
    assert saved.keys() == before.keys()
    assert all(torch.equal(saved[k], before[k]) for k in before)
    assert "in_features=16, out_features=8, bias=True" in repr(model[0])


def test_only_what_onednn_runs_natively_is_packed() -> None:
    assert not packable(torch.float16)
    model = nn.Sequential(nn.Linear(4, 4).to(torch.float16))
    assert pack(model) == 0 and type(model[0]) is nn.Linear

from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from prfaas.engine.models import smollm2_dir
from prfaas.services.textstream import TextStream


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(smollm2_dir()))


class WholeDecode:
    """The same tokenizer seen only through ``decode``: the path every other tokenizer takes."""

    def __init__(self, tokenizer: Any) -> None:
        self.inner, self.calls = tokenizer, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return str(self.inner.decode(ids, skip_special_tokens=skip_special_tokens))


def stream(tokenizer: Any, ids: list[int], stop: list[str]) -> tuple[list[str], TextStream]:
    text = TextStream(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(text.feed(token))
        if text.stopped:
            break
    deltas.append(text.flush())
    return deltas, text


def ids_of(tokenizer: Any, seed: int) -> list[int]:
    """Text with multi-byte characters split across tokens, special tokens, and random ids."""
    rng = random.Random(seed)
    words = ["naïve", "café", " 東京", " 🙂🚀", " stop", "STOP", " the end", "\n\n"]
    ids: list[int] = tokenizer.encode("".join(rng.choice(words) for _ in range(40)))
    ids[5:5] = [tokenizer.eos_token_id or 0]
    return ids + [rng.randrange(len(tokenizer)) for _ in range(30)]


@pytest.mark.parametrize("seed", range(4))
def test_the_streamed_text_is_one_decode_of_all_the_ids_without_decoding_them_again(tokenizer: Any,
                                                                                     seed: int) -> None:
    ids = ids_of(tokenizer, seed)
    deltas, text = stream(tokenizer, ids, [])
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert text.ids == []  # decoded a token at a time, not all the ids again
    whole = WholeDecode(tokenizer)
    assert stream(whole, ids, [])[0] == deltas and whole.calls == len(ids)


@pytest.mark.parametrize("stop", [[" stop"], ["STOP", "end"], ["🚀"], ["never there"]])
@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_end_the_text_where_the_whole_decode_would(tokenizer: Any, stop: list[str], seed: int) -> None:
    ids = ids_of(tokenizer, seed)
    deltas, text = stream(tokenizer, ids, stop)
    whole_deltas, whole = stream(WholeDecode(tokenizer), ids, stop)
    assert (deltas, text.stopped, text.text) == (whole_deltas, whole.stopped, whole.text)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    found = [full.find(s) for s in stop if s in full]
    assert "".join(deltas) == (full[:min(found)] if found else full)
    for s in stop:
        assert s not in "".join(deltas)

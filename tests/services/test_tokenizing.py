"""The router's own tokenizer (prfaas/services/tokenizing.py): used only where the decode instance's fingerprint
names the tokenizer files the router can read, equal to that tokenizer's ids, and otherwise the decode instance's
``/tokenize`` as before."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from prfaas.config import from_dict
from prfaas.engine import models
from prfaas.errors import ContextLengthExceeded, InvalidRequest
from prfaas.kv.fingerprint import tokenizer_files_digest, tokenizer_hash
from prfaas.services import tokenizing
from prfaas.services.fake_instances import FINGERPRINT, FakeInstances
from prfaas.services.router import Router

pytestmark = pytest.mark.timeout(120)
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(100, 133))
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three primes."}]


@pytest.fixture(scope="module")
def root() -> Path:
    return models.smollm2_dir()


@pytest.fixture(scope="module")
def reference(root: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def chat_ids(tokenizer: Any) -> list[int]:
    encoded = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_either_digest_of_the_same_tokenizer_loads_it_and_any_other_does_not(root: Path, reference: Any,
                                                                              tmp_path: Path) -> None:
    for digest in (tokenizer_files_digest(root), tokenizer_hash(reference)):  # a vLLM instance's, prfaas's engine's
        loaded = tokenizing.load(root, digest, 2048)
        assert loaded is not None
        loaded.close()
    assert tokenizing.load(root, "0" * 16, 2048) is None  # the instance tokenises with something else
    missing = tmp_path / "elsewhere"  # the instance's directory is not on the router's host
    assert tokenizing.load(missing, tokenizer_files_digest(missing), 2048) is None


def test_its_ids_are_the_tokenizer_s_and_its_refusals_are_the_decode_instance_s(root: Path, reference: Any) -> None:
    loaded = tokenizing.load(root, tokenizer_files_digest(root), 64)
    assert loaded is not None
    try:
        ids = asyncio.run(loaded.tokenize({"prompt": PROMPT[:40]}))
        assert ids == reference.encode(PROMPT[:40], add_special_tokens=False)
        assert asyncio.run(loaded.tokenize({"messages": CHAT})) == chat_ids(reference)
        assert asyncio.run(loaded.tokenize({"prompt": [5, 6, 7]})) == [5, 6, 7]
        with pytest.raises(ContextLengthExceeded):  # more text than 64 tokens can hold: refused before tokenising
            asyncio.run(loaded.tokenize({"prompt": "x" * (loaded.max_prompt_chars + 1)}))
        with pytest.raises(InvalidRequest):
            asyncio.run(loaded.tokenize({"prompt": {"not": "text"}}))
    finally:
        loaded.close()


def deployment(root: Path, digest: str, **config: Any) -> tuple[Router, FakeInstances]:
    fake = FakeInstances()
    router = Router(from_dict({"offload_threshold_tokens": 100000, **config}), "direct", instances=fake)
    fingerprint = dataclasses.replace(FINGERPRINT, tokenizer=digest).to_wire()
    decode = dataclasses.replace(fake.info("decode", "d0"), model_root=str(root), fingerprint=fingerprint)
    router.registry.upsert(decode)
    router.registry.upsert(dataclasses.replace(fake.info("prefill", "p0", datacenter="dc-a"), fingerprint=fingerprint))
    return router, fake


def ask(router: Router, **body: Any) -> dict[str, Any]:
    reply = asyncio.run(router.complete({"model": router.model_name, "max_tokens": 2, **body},
                                        chat="messages" in body))
    assert isinstance(reply, dict)
    return reply


def test_a_router_tokenises_itself_once_it_has_loaded_the_decode_instance_s_tokenizer(root: Path,
                                                                                      reference: Any) -> None:
    router, fake = deployment(root, tokenizer_files_digest(root))
    try:
        ask(router, prompt=PROMPT)  # the first request starts the load and goes through the instance
        assert len(fake.calls_to("tokenize")) == 1
        router.tokenizers.wait()
        assert router.tokenizers.loading() == 0
        reply = ask(router, prompt=PROMPT)
        ask(router, messages=CHAT)
        assert len(fake.calls_to("tokenize")) == 1  # no more round trips to the decode instance
        prompt, chat = (r.token_ids for r in fake.calls_to("generate")[1:])
        assert prompt == reference.encode(PROMPT, add_special_tokens=False) and chat == chat_ids(reference)
        assert reply["usage"]["prompt_tokens"] == len(prompt)
    finally:
        router.tokenizers.close()


@pytest.mark.parametrize("case", ["switched off", "another tokenizer"])
def test_otherwise_the_decode_instance_tokenises(root: Path, case: str) -> None:
    if case == "switched off":
        router, fake = deployment(root, tokenizer_files_digest(root), local_tokenizer=False)
    else:
        router, fake = deployment(root, "0" * 16)
    try:
        for _ in range(2):
            ask(router, prompt=PROMPT)
            router.tokenizers.wait()
        assert len(fake.calls_to("tokenize")) == 2
        assert router.tokenizers.get(router.registry.healthy("decode")[0]) is None
    finally:
        router.tokenizers.close()


def test_a_router_loads_a_bounded_number_of_tokenizers(tmp_path: Path) -> None:
    tokenizers = tokenizing.LocalTokenizers()
    fake = FakeInstances()
    for i in range(tokenizing.MAX_TOKENIZERS + 5):  # registrants naming directories the router does not have
        info = dataclasses.replace(fake.info("decode", f"d{i}"), model_root=str(tmp_path / str(i)))
        assert tokenizers.get(info) is None
    tokenizers.wait()
    assert len(tokenizers._loaders) == tokenizing.MAX_TOKENIZERS and tokenizers.loading() == 0
    tokenizers.close()

"""Hybrid models through vLLM's hybrid KV cache manager (HMA) and ``PrfaasConnector``, in real vLLM processes
(the CPU build in ``.venv-vllm``, fp32), with tiny random-weight models built from a config (nothing downloaded).

Gemma3 (``tests/vllm/hybrid_models.py``: sliding-window layers with a 64-token window and full-attention layers,
three KV cache groups as vLLM splits the sliding layers in two, 32-token blocks): prompts much longer than the
window, so that vLLM holds its null block before the window in the consumer's sliding-window block table, and one
shorter than it. For each, the producer's blob goes to the consumer and the consumer's greedy tokens (and their
logprobs) equal a monolithic run of the same vLLM token for token, with the prompt (all but its last token) counted
as ``external_kv_transfer``; the blob carries a sliding-window group only from the block holding the first token
in the window of the prompt's last one.

GraniteMoeHybrid (three Mamba2 layers, one attention layer; vLLM sets the attention block size to match the Mamba
page): the same prompts and checks; the producer prefills all but the last prompt token (``kv_tokens`` = prompt −
1), so that the Mamba state it sends is the one the consumer continues from, and the blob carries each Mamba
layer's state once.

No blob and no process is left.

Skips only where vLLM's CPU build is not installed (``make vllm``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.services.deploy import free_port
from tests.vllm import hybrid_models
from tests.vllm.servers import (
    NEEDS_VLLM,
    Server,
    complete,
    prompt_sources,
    start,
    stop,
    wait_healthy,
    wait_no_blobs,
)

BLOCK = 32
ARGS = ("--block-size", str(BLOCK))
FLOAT32 = 4
LOGPROB_TOLERANCE = 1e-3  # fp32: the same vLLM computing the last prompt token over loaded instead of its own KV
PROMPTS = {
    "long": " ".join(f"The number {i} is followed by {i + 1}." for i in range(40)),  # about 460 tokens
    "unaligned": " ".join(f"Item {i} costs {3 * i} coins." for i in range(23)),  # about 200 tokens
    "short": "The quick brown fox jumps over the lazy dog, and then it runs away.",  # under the window
}

pytestmark = [
    pytest.mark.slow,
    NEEDS_VLLM,
]


@dataclass
class Pair:
    name: str
    prefill: Server
    decode: Server
    kv_address: str
    config: dict[str, Any]


def _pair(name: str, model_dir: Path, config: dict[str, Any]) -> Iterator[Pair]:
    """A producer (direct mode) and a consumer serving ``model_dir``, started together; on the way out, no blob
    left in the producer's store and no process left."""
    kv_address = f"127.0.0.1:{free_port()}"
    prefill = start(model_dir, "kv_producer", {"kv_address": kv_address}, name=name, args=ARGS)
    decode = start(model_dir, "kv_consumer", {"creation_grace_s": 1, "kv_deadline_s": 20}, name=name, args=ARGS)
    left: list[int] = []
    try:
        started = time.monotonic()
        wait_healthy([prefill, decode])
        print(f"vLLM producer and consumer of {name} healthy in {time.monotonic() - started:.1f} s")
        yield Pair(name, prefill, decode, kv_address, config)
        assert wait_no_blobs(kv_address), "blobs left in the producer's store"
    finally:
        left = stop(prefill) + stop(decode)
    assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model_dir = hybrid_models.build("gemma3_text", hybrid_models.GEMMA3, tmp_path_factory.mktemp("gemma3"))
    yield from _pair("tiny-gemma3", model_dir, hybrid_models.GEMMA3)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model_dir = hybrid_models.build("granitemoehybrid", hybrid_models.GRANITE_HYBRID,
                                    tmp_path_factory.mktemp("granite"))
    yield from _pair("tiny-granite-hybrid", model_dir, hybrid_models.GRANITE_HYBRID)


def _body(pair: Pair, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": pair.name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0, **extra}


def _tokens(completion: dict[str, Any]) -> list[str]:
    return list(completion["choices"][0]["logprobs"]["tokens"])


def _assert_same_logprobs(reply: dict[str, Any], reference: dict[str, Any]) -> None:
    """The chosen tokens' logprobs agree too: a random-weight model repeats tokens, but its logprobs move with
    any change in the context's KV (changing the first 300 tokens of the long prompt moves the top logit by 0.5)."""
    got, want = (c["choices"][0]["logprobs"]["token_logprobs"] for c in (reply, reference))
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < LOGPROB_TOLERANCE, (got, want)


def _remote(pair: Pair, prompt: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """Prefill on the producer, decode on the consumer with its blob: (producer's params, consumer's completion,
    the consumer's prompt tokens by source during it)."""
    first = complete(pair.prefill, _body(pair, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    params = first.get("kv_transfer_params") or {}
    assert params.get("do_remote_prefill") and params.get("kv_id"), first
    before = prompt_sources(pair.decode)
    reply = complete(pair.decode, _body(pair, prompt, kv_transfer_params=params))
    after = prompt_sources(pair.decode)
    return params, reply, {k: after[k] - before.get(k, 0.0) for k in after}


def _carried_blocks(config: dict[str, Any], tokens: int) -> int:
    """Blocks the blob should carry over all layers: every prompt block of a full-attention layer; a sliding one's
    from the block holding the first token in the window of the last prompt token."""
    blocks = math.ceil(tokens / BLOCK)
    window = config["sliding_window"]
    sliding = blocks - max(0, tokens - window) // BLOCK
    return sum(sliding if kind == "sliding_attention" else blocks for kind in config["layer_types"])


def _assert_exact(pair: Pair, prompt: str) -> tuple[dict[str, Any], int]:
    """The consumer's completion with the producer's blob equals a monolithic run (the producer without any
    transfer), and its prompt but the last token came from the blob; returns (the producer's params, the prompt's
    tokens)."""
    reference = complete(pair.prefill, _body(pair, PROMPTS[prompt]))
    params, reply, sources = _remote(pair, PROMPTS[prompt])
    tokens = int(reply["usage"]["prompt_tokens"])
    assert _tokens(reply) == _tokens(reference)
    _assert_same_logprobs(reply, reference)
    assert sources["external_kv_transfer"] == tokens - 1, sources  # vLLM computes the last token for its logits
    assert sources["local_compute"] == 1, sources
    assert wait_no_blobs(pair.kv_address), "the consumer did not release the blob"
    return params, tokens


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_gemma3_remote_prefill_is_exact(gemma3: Pair, prompt: str) -> None:
    params, tokens = _assert_exact(gemma3, prompt)
    config = gemma3.config
    block_bytes = 2 * config["num_key_value_heads"] * BLOCK * config["head_dim"] * FLOAT32
    assert params["kv_bytes"] == _carried_blocks(config, tokens) * block_bytes
    assert params["kv_tokens"] == tokens  # the whole prompt computed: attention KV of its last token is not needed


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_granite_hybrid_remote_prefill_is_exact(granite: Pair, prompt: str) -> None:
    """Mamba2 state and attention KV: the producer prefills all but the last prompt token, so that the consumer
    computes that one from the state after the others."""
    params, tokens = _assert_exact(granite, prompt)
    assert params["kv_tokens"] == tokens - 1
    config = granite.config
    state_bytes = FLOAT32 * ((config["mamba_d_conv"] - 1) * _conv_dim(config)
                             + config["mamba_n_heads"] * config["mamba_d_head"] * config["mamba_d_state"])
    mamba_layers = config["layer_types"].count("mamba")
    attention = params["kv_bytes"] - mamba_layers * state_bytes  # vLLM picks the attention block size
    assert attention > 0 and attention % (2 * config["num_key_value_heads"] * _head_dim(config) * FLOAT32) == 0


def _conv_dim(config: dict[str, Any]) -> int:
    """Mamba2's convolution channels: x, B and C."""
    inner = config["mamba_expand"] * config["hidden_size"]
    return int(inner + 2 * config["mamba_n_groups"] * config["mamba_d_state"])


def _head_dim(config: dict[str, Any]) -> int:
    return int(config["hidden_size"] // config["num_attention_heads"])

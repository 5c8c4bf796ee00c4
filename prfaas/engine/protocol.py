"""``Engine``: what the prefill and decode roles use of a model engine, and ``PrefillOutput``. ``EngineInfo``, its
first half, is what an instance advertises of its engine (identity, context, tokenizer, KV footprint); the rest are
the passes the roles run.

Implementations: ``TransformersEngine`` (``engine.py``, a real model on PyTorch) and ``SyntheticEngine``
(``synthetic.py``, a large model's KV sizes and timings without weights), both on ``EngineBase`` (``base.py``).
An instance backed by vLLM hosts no engine in its process: its child vLLM server is the engine
(``prfaas.vllm.serving``).

Ownership: an engine is not thread-safe; one engine thread (``services/decode_scheduler.py``,
``services/prefill_scheduler.py``) calls it at a time. Failures: ``InvalidRequest`` for a prompt it refuses,
``KVIncompatible`` / ``KVBadFormat`` for a KV state it cannot restore; other exceptions are bugs.
This module imports neither torch nor transformers (types only), so a light role may name the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prfaas.kv import Fingerprint, KVState, LayerState
from prfaas.messages import SamplingParams

if TYPE_CHECKING:
    import torch

LayerCallback = Callable[[LayerState], None]
RowCallback = Callable[[int, LayerState], None]  # (row of the batch, that row's layer state)
ChunkResult = tuple[Any, int, float]  # (live model cache, first token, seconds of compute)
# The tokens of a chunked prefill's next forward pass, asked before each pass with the tokens already in the cache
# (0: the rest in one pass). A scheduler sizes each pass from its queue at that moment (``prefill_scheduler.py``).
ChunkPlan = Callable[[int], int]


def pass_tokens(chunk: int | ChunkPlan, done: int) -> int:
    """The next pass's tokens under ``chunk``: a fixed size (0: the rest) or a ``ChunkPlan``."""
    return chunk if isinstance(chunk, int) else chunk(done)


@dataclass(frozen=True)
class PrefillOutput:
    """``kv`` shares memory with the cache the prefill built (and then dropped); ``next_token`` is greedy."""

    kv: KVState
    next_token: int
    seconds: float


class Riders(Protocol):
    """Decode rows a prefill pass may carry (``DecodeBatch``): their next step's inputs, and their step's end."""

    cache: Any  # the rows' model cache

    def inputs(self) -> tuple[list[int], list[int], torch.Tensor]:
        """Each row's next token and position, and the attention mask over every row's positions."""

    def advance(self, logits: torch.Tensor) -> dict[str, int]:
        """The step's end: a token per row from ``logits`` (float32, a row each), the rows moved on."""


class EngineInfo(Protocol):
    """A loaded model's identity, its tokenizer and the size of its KV: what an instance advertises
    (``Instance.advertise``) and what the decode role needs to bound and tokenise prompts."""

    @property
    def name(self) -> str: ...

    @property
    def root(self) -> str:
        """The directory the tokenizer loads from (load tools read it); "" where there is none."""

    @property
    def fingerprint(self) -> Fingerprint: ...

    @property
    def max_seq_len(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    @property
    def kv_footprint(self) -> tuple[int, int]:
        """(fixed bytes, bytes per token) of one sequence's KV."""

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer, or one with the same ``encode``/``decode``/``apply_chat_template``."""


class Engine(EngineInfo, Protocol):
    """A loaded model and the passes the roles run on it (none mutates the engine; each returns a fresh cache or
    fills the one passed in)."""

    @property
    def keeps_kv(self) -> bool:
        """False: ``restore`` needs only the sizes of the KV it gets, so decode pulls without keeping the bytes."""

    @property
    def device(self) -> torch.device: ...

    @property
    def cache_class(self) -> str:
        """The class name of the model cache (a blob header carries it; a restore checks it)."""

    @property
    def layer_table(self) -> tuple[dict[str, Any], ...]:
        """Kind, growth and window of every layer, known before a prompt runs (a blob header needs it)."""

    def check_prompt(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt as ints, or ``INVALID_REQUEST`` (empty, too long for the context, ids outside the vocab)."""

    def prefill(self, token_ids: Sequence[int], on_layer: LayerCallback | None = None,
                sampling: SamplingParams | None = None) -> PrefillOutput:
        """Run the prompt; ``on_layer`` receives each layer's state as soon as that layer has run."""

    def prefill_chunks(self, token_ids: Sequence[int], chunk: int | ChunkPlan, sampling: SamplingParams | None = None,
                       step: int = 0, on_layer: LayerCallback | None = None) -> Iterator[ChunkResult | None]:
        """``chunk`` tokens per forward pass (or as a ``ChunkPlan`` says), ``None`` between chunks, finally (cache,
        first token, seconds)."""

    def prefill_batch(self, prompts: Sequence[Sequence[int]], on_layer: RowCallback | None = None,
                      samplings: Sequence[SamplingParams | None] | None = None) -> tuple[list[int], float]:
        """Several prompts in one pass: each one's first token, and the seconds."""

    def restore(self, kv: KVState) -> Any:
        """A fresh model cache holding ``kv``; ``KV_INCOMPATIBLE`` / ``KV_BAD_FORMAT`` when it cannot."""

    def forward_rows(self, tokens: list[int], positions: list[int], mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step for a batch: one token per row at its own position; float32 logits [rows, vocab]."""

    @property
    def folds(self) -> bool:
        """Whether a prefill pass can carry decode rows (``carry``)."""

    def carry(self, rows: Riders | None) -> None:
        """The next prefill pass also steps ``rows`` once (it calls ``rows.advance``), where ``folds``; ``None``
        drops rows that no pass took. The decode instance's engine loop sets it around one chunk of a prefill."""

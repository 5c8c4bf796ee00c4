"""Turning a prompt or chat into token ids, off the event loop: a decode instance's ``/tokenize`` on prfaas's own
engine, and the router's own tokenisation where it can read the decode instances' tokenizer (``LocalTokenizers``).

The router tokenises every request before it routes it (the prompt's length decides the route, its blocks the
prefix placement). Through a decode instance that costs a round trip, and on vLLM a second one to vLLM's own
``/tokenize``: 10 ms of every request's TTFT on loopback. Where the router can load the same tokenizer files (one
machine, or the model directory mounted on the router's host), it tokenises itself, as a serving frontend
usually does; the digest of the files it loaded must equal the ``tokenizer`` digest of the decode instance's
fingerprint, else it keeps asking the instance. Chat messages arrive here normalised by ``openai_api`` (roles,
string contents), so the chat template sees what the decode instance's would.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prfaas.errors import ContextLengthExceeded, InvalidRequest
from prfaas.kv.fingerprint import tokenizer_files_digest, tokenizer_hash
from prfaas.messages import InstanceInfo

log = logging.getLogger("prfaas.tokenize")

MAX_TOKENIZERS = 16  # tokenizers a router loads at most (each registrant may name its own directory)
TOKEN_CHARS_UNKNOWN = 64  # characters a token may stand for, when the tokenizer has no vocabulary to measure


class Tokenizing:
    """One tokenizer, used from one thread (calls never overlap; the tokenizer releases the GIL), with prompts
    longer than the context could hold refused before any work."""

    def __init__(self, tokenizer: Any, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.max_prompt_chars = max_seq_len * longest_token_chars(tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    async def tokenize(self, body: dict[str, Any]) -> list[int]:
        """The token ids of ``body`` (a ``TokenizeRequest``'s wire form). ``ContextLengthExceeded`` at once, without
        tokenising, for text longer than the context could hold (``max_prompt_chars``); ``InvalidRequest`` for a
        body that is neither a prompt nor messages, or messages the chat template refuses."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.tokenize_now, body)

    def tokenize_now(self, body: dict[str, Any]) -> list[int]:
        self._bound(body)
        if "messages" in body:
            try:
                encoded = self.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                             tokenize=True)
            except Exception as exc:
                raise InvalidRequest(f"cannot apply the chat template: {exc}") from exc
            ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        elif isinstance(body.get("prompt"), str):
            ids = self.tokenizer.encode(body["prompt"], add_special_tokens=False)
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            ids = body["prompt"]
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids")
        return [int(t) for t in ids]

    def _bound(self, body: dict[str, Any]) -> None:
        field = "messages" if "messages" in body else "prompt"
        chars = text_length(body.get(field))
        if chars > self.max_prompt_chars:
            raise ContextLengthExceeded(f"the {field} has {chars} characters of text, more than this model's "
                                        f"context of {self.max_seq_len} tokens can hold", field)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class LocalTokenizers:
    """The router's own tokenizers, one per decode instance's tokenizer (its ``model_root`` and fingerprint
    digest). The first request that names one starts loading it on a thread and goes through the instance, as
    does every request while it loads or where it cannot be used: the directory is not readable here, or what
    it holds is not what the instance's fingerprint says it tokenises with."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._ready: dict[tuple[str, str], Tokenizing | None] = {}  # None: tried, not usable here
        self._lock = threading.Lock()
        self._loaders: list[threading.Thread] = []

    def get(self, instance: InstanceInfo) -> Tokenizing | None:
        """The router's tokenizer for ``instance``'s, or None: ask the instance (not loaded yet, or not usable)."""
        digest = str(instance.fingerprint.get("tokenizer", ""))
        if not self.enabled or not instance.model_root or not digest:
            return None
        key = (instance.model_root, digest)
        with self._lock:
            if key in self._ready or len(self._ready) >= MAX_TOKENIZERS:
                return self._ready.get(key)
            self._ready[key] = None  # until it has loaded
        loader = threading.Thread(target=self._load, args=(key, instance.max_seq_len), daemon=True,
                                  name="tokenizer-load")
        self._loaders.append(loader)
        loader.start()
        return None

    def _load(self, key: tuple[str, str], max_seq_len: int) -> None:
        root, digest = key
        try:
            tokenizing = load(Path(root), digest, max_seq_len)
        except Exception as exc:  # any failure: the instance goes on tokenising, as before
            log.info("tokenising through the decode instances: cannot load %s here (%s)", root, exc)
            return
        if tokenizing is None:
            log.info("tokenising through the decode instances: %s here is not the tokenizer they use", root)
            return
        with self._lock:
            self._ready[key] = tokenizing
        log.info("tokenising here with %s", root)

    def loading(self) -> int:
        """Tokenizers still loading (``/health`` says it; ``prfaas up`` waits for none, so that a deployment's
        first requests do not share its cores with the load, several seconds of CPU for transformers' import)."""
        return sum(loader.is_alive() for loader in self._loaders)

    def wait(self, timeout_s: float = 60.0) -> None:
        """Until every load begun so far has ended (tests, benchmarks)."""
        for loader in list(self._loaders):
            loader.join(timeout_s)

    def close(self) -> None:
        with self._lock:
            loaded = [t for t in self._ready.values() if t is not None]
            self._ready.clear()
        for tokenizing in loaded:
            tokenizing.close()


def load(root: Path, digest: str, max_seq_len: int) -> Tokenizing | None:
    """``root``'s tokenizer where it is the one ``digest`` names (a vLLM instance's digest of the tokenizer files,
    or prfaas's engine's of the loaded tokenizer), else None."""
    if not root.is_dir():  # (a digest of a directory that is not here is of its name alone)
        return None
    tokenizer = _auto_tokenizer(root)
    return Tokenizing(tokenizer, max_seq_len) if digest in (tokenizer_files_digest(root), tokenizer_hash(tokenizer)) \
        else None


def _auto_tokenizer(root: Path) -> Any:
    from transformers import AutoTokenizer  # heavy: only where a router tokenises

    return AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound of the characters of text one token stands for: the longest vocabulary entry (a byte-level
    entry spells each byte as one character, and a character is at least one byte)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max(map(len, vocab), default=TOKEN_CHARS_UNKNOWN) or TOKEN_CHARS_UNKNOWN


def text_length(value: Any) -> int:
    """Characters in every string of ``value`` (a prompt, or chat messages; ``jsonbody`` bounds their depth)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_length(v) for v in value.values())
    if isinstance(value, list):
        return sum(text_length(v) for v in value if isinstance(v, str | dict | list))
    return 0

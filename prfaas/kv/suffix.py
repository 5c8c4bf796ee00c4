"""Suffix-only KV: what a prefill instance ships when the decode instance already holds a prefix of the prompt.

A suffix state of a prompt of ``n`` tokens extending a prefix of ``p`` tokens (a block boundary) holds, for each
attention and MLA layer, only the positions from ``p`` on (a sliding layer's held positions from ``max(p, n -
window + 1)``), and every other layer (linear attention, SSM, convolution, cache-level state) whole: those are
fixed-size and the state after ``n`` tokens cannot be rebuilt from a checkpoint at ``p``. ``cut`` makes one on the
prefill side, ``join`` puts the decode instance's cached prefix pages back in front of it.

Ground floor: numpy and ``prfaas.kv.state`` only.
"""

from __future__ import annotations

import numpy as np

from prfaas.errors import KVBadFormat
from prfaas.kv.state import ATTENTION_KINDS, POSITIONAL, KVState, LayerState


def cut(layer: LayerState, prefix_tokens: int, seq_len: int) -> LayerState:
    """``layer`` (after ``seq_len`` tokens) without the positions before ``prefix_tokens``; other kinds whole."""
    if layer.kind not in ATTENTION_KINDS:
        return layer
    held_from = seq_len - _positions(layer)
    skip = max(0, prefix_tokens - held_from)
    tensors = {name: array[..., skip:, :] if name in POSITIONAL else array for name, array in layer.tensors.items()}
    return LayerState(index=layer.index, kind=layer.kind, grows=layer.grows, window=layer.window, tensors=tensors,
                      attrs=layer.attrs)


def join(prefix: KVState, suffix: KVState) -> KVState:
    """The whole state: ``prefix`` (after ``suffix.prefix.tokens`` tokens, from a prefix cache; its fixed-state
    layers are not used) followed by the suffix-only ``suffix``. ``KVBadFormat`` when the two do not fit (another
    layer table, or positions that do not add up to what the layer holds after ``suffix.seq_len`` tokens)."""
    if len(prefix.layers) != len(suffix.layers):
        raise KVBadFormat(f"the suffix blob has {len(suffix.layers)} layers; the cached prefix {len(prefix.layers)}")
    layers = [_join_layer(p, s, suffix.seq_len) for p, s in zip(prefix.layers, suffix.layers, strict=True)]
    return KVState(fingerprint=suffix.fingerprint, seq_len=suffix.seq_len, layers=layers, cache=suffix.cache,
                   first_token=suffix.first_token, kv_id=suffix.kv_id, codec=suffix.codec)


def _join_layer(prefix: LayerState, suffix: LayerState, seq_len: int) -> LayerState:
    if suffix.kind not in ATTENTION_KINDS or not suffix.tensors:
        return suffix
    if (prefix.index, prefix.kind, prefix.window) != (suffix.index, suffix.kind, suffix.window):
        raise KVBadFormat(f"layer {suffix.index} of the suffix blob does not match the cached prefix's")
    keep = seq_len if suffix.window is None else min(seq_len, suffix.window - 1)
    tensors = {}
    for name, array in suffix.tensors.items():
        if name not in POSITIONAL:
            tensors[name] = array
            continue
        before = prefix.tensors.get(name)
        whole = array if before is None else np.concatenate([before, array], axis=-2)
        if whole.shape[-2] < keep:
            raise KVBadFormat(f"layer {suffix.index}'s {name} holds {whole.shape[-2]} positions with the cached "
                              f"prefix; {keep} are needed after {seq_len} tokens")
        tensors[name] = whole[..., whole.shape[-2] - keep:, :]
    return LayerState(index=suffix.index, kind=suffix.kind, grows=suffix.grows, window=suffix.window,
                      tensors=tensors, attrs=dict(suffix.attrs))


def _positions(layer: LayerState) -> int:
    return next((a.shape[-2] for n, a in layer.tensors.items() if n in POSITIONAL), 0)

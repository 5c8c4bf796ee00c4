"""A model's decoder layers and forward hooks on them: how a prefill hands each layer over as soon as it has run
(``engine.py`` for one prompt, ``prefill_batch.py`` for a batch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prfaas.errors import InvalidRequest


def decoder_layers(model: Any) -> Any:
    """The decoder's layer modules, in order; ``INVALID_REQUEST`` for a model whose layout is unknown."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise InvalidRequest(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def after_each_layer(model: Any, ran: Callable[[int], None]) -> list[Any]:
    """Call ``ran(index)`` after each decoder layer's forward; the caller removes the returned handles."""
    def hook_for(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            ran(index)
        return hook

    return [layer.register_forward_hook(hook_for(i)) for i, layer in enumerate(decoder_layers(model))]

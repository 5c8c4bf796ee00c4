"""Reading a Hugging Face ``config.json``: the file or its directory, the nested text config, typed fields.

Every missing or ill-typed field is an ``InvalidRequest`` that names the field, never a silent guess.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prfaas.errors import InvalidRequest

# Sub-configs that hold the language model of a multimodal checkpoint.
_NESTED = ("text_config", "llm_config", "language_config", "thinker_config")


def load_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of ``path`` (a ``config.json`` or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise InvalidRequest(f"no model config at {p}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"cannot read model config {p}: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest(f"{p} is not a JSON object")
    return data


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: descends into nested text configs (``text_config`` …); ``model_type`` is kept."""
    for key in _NESTED:
        sub = cfg.get(key)
        if isinstance(sub, dict) and ("num_hidden_layers" in sub or any(k in sub for k in _NESTED)):
            inner = text_config(sub)
            out = dict(inner)
            out.setdefault("model_type", cfg.get("model_type", ""))
            out.setdefault("_outer_model_type", cfg.get("model_type", ""))
            return out
    return cfg


class Fields:
    """Typed access to one (text) config, with field names in every error."""

    def __init__(self, cfg: dict[str, Any], where: str = "config") -> None:
        self.cfg = cfg
        self.where = where

    @property
    def model_type(self) -> str:
        return str(self.cfg.get("model_type") or "")

    def has(self, name: str) -> bool:
        return self.cfg.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.cfg.get(name)
        return default if value is None else value

    def num(self, name: str, default: int | None = None) -> int:
        value = self.cfg.get(name)
        if value is None:
            if default is None:
                raise InvalidRequest(f"{self.where}: field {name!r} is required for this model but missing")
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value or value < 0:
            raise InvalidRequest(f"{self.where}: field {name!r} must be a non-negative integer, "
                                 f"got {value!r}")
        return int(value)

    def first_int(self, names: tuple[str, ...], default: int | None = None) -> int:
        for name in names:
            if self.has(name):
                return self.num(name)
        if default is None:
            raise InvalidRequest(f"{self.where}: one of the fields {list(names)} is required; all missing")
        return default

    def int_list(self, name: str) -> list[int]:
        value = self.cfg.get(name)
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok or not isinstance(value, list):
            raise InvalidRequest(f"{self.where}: field {name!r} must be a list of integers, got {value!r}")
        return list(value)

    def str_list(self, name: str) -> list[str]:
        value = self.cfg.get(name)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidRequest(f"{self.where}: field {name!r} must be a list of strings, got {value!r}")
        return list(value)

    @property
    def num_layers(self) -> int:
        return self.num("num_hidden_layers")

    @property
    def head_dim(self) -> int:
        if self.has("head_dim"):
            return self.num("head_dim")
        heads = self.num("num_attention_heads")
        hidden = self.num("hidden_size")
        if heads == 0 or hidden % heads:
            raise InvalidRequest(f"{self.where}: no 'head_dim' and hidden_size {hidden} is not a multiple of "
                                 f"num_attention_heads {heads}")
        return hidden // heads

    @property
    def kv_heads(self) -> int:
        return self.num("num_key_value_heads", self.num("num_attention_heads"))

    def layer_view(self, index: int) -> Fields:
        """The fields of layer ``index`` with ``per_layer_config`` overrides (heterogeneous configs)."""
        overrides = self.cfg.get("per_layer_config")
        if not isinstance(overrides, dict):
            return self
        patch = overrides.get(str(index), overrides.get(index))
        if not patch:
            return self
        return Fields({**self.cfg, **patch}, f"{self.where} (layer {index})")

"""Inputs shared by the plan commands: a KV curve from a config / model directory / KV or profile file."""

from __future__ import annotations

from prfaas.errors import InvalidRequest
from prfaas.plan.kvcalc import plan_from_path
from prfaas.plan.kvcurve import KVCurve, curve_from_file

DEFAULT_LENGTHS = ["1024", "8192", "32768", "131072"]


def model_path(config: str | None, model: str | None) -> str | None:
    if config and model:
        raise InvalidRequest("give --config or --model, not both")
    return config or model


def kv_curve(kv: str | None, config: str | None, model: str | None, *, dtype: str, codec: str = "none",
             mla_layout: str = "latent", window_mode: str = "held") -> KVCurve:
    path = model_path(config, model)
    if kv and path:
        raise InvalidRequest("give --kv or --config/--model, not both")
    if kv:
        return curve_from_file(kv, codec)
    if path:
        plan = plan_from_path(path, dtype=dtype, mla_layout=mla_layout, window_mode=window_mode)
        return KVCurve.of_plan(plan)
    raise InvalidRequest("say where the KV sizes come from: --kv FILE, --config config.json or --model DIR")

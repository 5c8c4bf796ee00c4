"""Feasibility planning: KV bytes from a model's ``config.json``, link verdicts and PrfaaS capacity.

Light on purpose: nothing here imports torch or transformers (``prfaas measure``, which runs the engine, is
``prfaas.engine.measure``, above this package).
"""

from __future__ import annotations

from prfaas.plan.kvcalc import KVPlan, LayerKV, plan_from_config, plan_from_path

__all__ = ["KVPlan", "LayerKV", "plan_from_config", "plan_from_path"]

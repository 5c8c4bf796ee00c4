"""``prfaas plan kv|link|capacity``; ``--json`` prints one JSON object last. (``prfaas measure``, which runs the
engine, is ``prfaas.engine.cli``.)"""

from __future__ import annotations

import json
from typing import Any

import typer

from prfaas.terminal import console
from prfaas.units import parse_lengths, parse_rate

app = typer.Typer(help="Feasibility: KV bytes per request, link verdicts, PrfaaS capacity.",
                  no_args_is_help=True)

CONFIG = typer.Option(None, "--config", help="a model's config.json")
MODEL = typer.Option(None, "--model", help="a model directory holding config.json")
DTYPE = typer.Option("bfloat16", help="KV dtype: float32 | bfloat16 | float16 | fp8 | int8 | int4")
MLA = typer.Option("latent", help="MLA layout: latent (serving engines) | expanded (per-head K and V)")
WINDOW = typer.Option("held", help="sliding windows: held (window-1 tokens, as decode needs) | full")
JSON = typer.Option(False, "--json", help="print one JSON object on the last line")


def _emit(out: dict[str, Any], as_json: bool, render: Any) -> None:
    if as_json:
        typer.echo(json.dumps(out))
    else:
        render(out, console())


@app.command("kv")
def kv_cmd(
    config: str | None = CONFIG, model: str | None = MODEL, dtype: str = DTYPE,
    state_dtype: str | None = typer.Option(None, help="dtype of recurrent states (default: the KV dtype)"),
    seq_len: list[str] = typer.Option(None, "--seq-len", help="prompt lengths (repeat or 1024,8192)"),
    mla_layout: str = MLA, window_mode: str = WINDOW, as_json: bool = JSON,
) -> None:
    """KV cache per request, layer by layer, from a Hugging Face config."""
    from prfaas.errors import InvalidRequest
    from prfaas.plan.kvcalc import plan_from_path
    from prfaas.plan.options import DEFAULT_LENGTHS, model_path
    from prfaas.plan.render import kv_table

    path = model_path(config, model)
    if path is None:
        raise InvalidRequest("plan kv needs --config config.json or --model DIR")
    plan = plan_from_path(path, dtype=dtype, state_dtype=state_dtype, mla_layout=mla_layout,
                          window_mode=window_mode)
    _emit(plan.to_json(parse_lengths(seq_len or DEFAULT_LENGTHS)), as_json, kv_table)


@app.command("link")
def link_cmd(
    kv: str | None = typer.Option(None, "--kv", help="plan kv / measure / profile JSON"),
    config: str | None = CONFIG, model: str | None = MODEL, dtype: str = DTYPE,
    codec: str = typer.Option("none", help="codec of the measured sizes to use from a --kv file"),
    mla_layout: str = MLA, window_mode: str = WINDOW,
    link: str | None = typer.Option(None, "--link", help="prfaas probe run --json output"),
    bandwidth: str | None = typer.Option(None, help="available bandwidth, e.g. 10gbit"),
    rtt_ms: float | None = typer.Option(None, help="RTT P50 in ms"),
    rtt_p99_ms: float | None = typer.Option(None, help="RTT P99 in ms (default: the P50)"),
    jitter_ms: float = typer.Option(0.0, help="jitter in ms"),
    loss_pct: float = typer.Option(0.0, help="packet loss in percent"),
    mtu: int = typer.Option(1500, help="path MTU in bytes"),
    seq_len: list[str] = typer.Option(None, "--seq-len", help="prompt lengths, equal weights"),
    mix: str | None = typer.Option(None, help="length mix: hist:1024=0.5,8192=0.5 | lognormal:... | trace:F"),
    qps: float = typer.Option(..., help="peak requests per second sent over the link"),
    ttft_budget_ms: float = typer.Option(..., help="TTFT budget in ms"),
    e2e_budget_ms: float | None = typer.Option(None, help="end-to-end budget in ms (default: TTFT budget)"),
    transfer_share: float = typer.Option(0.15, help="share of the end-to-end budget a transfer may take"),
    max_len: int = typer.Option(1 << 21, help="upper bound of the largest-length search"),
    profile: str | None = typer.Option(None, help="speed profile of the prefill instance (`prfaas measure "
                                       "--json`): its prefill and encoding times overlap the predicted transfer"),
    mode: str = typer.Option("relay", help="how decode gets the KV: relay (prefill pushes to a relay beside "
                             "decode) or direct (decode pulls from prefill's store)"),
    as_json: bool = JSON,
) -> None:
    """Verdict for shipping KV over a link: every rule with its margin, largest prompt, settings, and the
    transfer stage and exposed transfer the serving path will show."""
    from prfaas.errors import InvalidRequest
    from prfaas.plan.advice import advise, recommend
    from prfaas.plan.lengths import LengthDist, parse_dist
    from prfaas.plan.link import (
        Budget,
        LinkSpec,
        demand_bps,
        evaluate,
        largest_fitting_length,
        transfer_json,
        verdict_json,
    )
    from prfaas.plan.options import DEFAULT_LENGTHS, kv_curve
    from prfaas.plan.profile import SpeedProfile
    from prfaas.plan.render import link_table
    from prfaas.plan.transfer import MODES

    if mode not in MODES:
        raise InvalidRequest(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not 0.0 < transfer_share <= 1.0:
        raise InvalidRequest(f"--transfer-share must be in (0, 1], got {transfer_share}")
    curve = kv_curve(kv, config, model, dtype=dtype, codec=codec, mla_layout=mla_layout,
                     window_mode=window_mode)
    if link:
        spec = LinkSpec.from_file(link)
    elif bandwidth and rtt_ms is not None:
        spec = LinkSpec(parse_rate(bandwidth), rtt_ms, rtt_p99_ms if rtt_p99_ms is not None else rtt_ms,
                        jitter_ms, loss_pct / 100, mtu)
    else:
        raise InvalidRequest("describe the link: --link LINK.json, or --bandwidth and --rtt-ms")
    if mix and seq_len:
        raise InvalidRequest("give --mix or --seq-len, not both")
    plain = dict.fromkeys(parse_lengths(seq_len or DEFAULT_LENGTHS), 1.0)
    dist = parse_dist(mix) if mix else LengthDist.of(plain)
    budget = Budget(qps, ttft_budget_ms, e2e_budget_ms or ttft_budget_ms, transfer_share)
    checks = evaluate(curve, dist, spec, budget)
    largest = largest_fitting_length(curve, spec, budget, max_len)
    out = verdict_json(checks, largest, recommend(curve, dist, spec, budget),
                       advise(checks, curve, dist, spec, budget, largest))
    speed = SpeedProfile.from_file(profile) if profile else None
    out.update(kv=curve.name, link=spec.__dict__, mix=dist.to_json(), qps=qps,
               transfer=transfer_json(curve, dist, spec, demand_bps(curve, dist, qps),
                                      (lambda n: speed.prefill_seconds(n) * 1e3) if speed else None,
                                      (lambda n: (speed.encode_seconds(n, codec) or 0.0) * 1e3) if speed else None,
                                      mode))
    _emit(out, as_json, link_table)


@app.command("capacity")
def capacity_cmd(
    profile: str = typer.Option(..., help="speed profile of a PrfaaS prefill instance (the last line of "
                                "`prfaas measure --json`)"),
    local_profile: str | None = typer.Option(None, help="profile of a local instance (default: --profile)"),
    kv: str | None = typer.Option(None, "--kv", help="KV sizes file (default: the profile's kv)"),
    config: str | None = CONFIG, model: str | None = MODEL, dtype: str = DTYPE,
    codec: str = typer.Option("none", help="codec of the KV sizes"),
    lengths: str | None = typer.Option(None, help="lognormal:median=..,sigma=.. | hist:.. | trace:F"),
    prfaas: int = typer.Option(1, help="PrfaaS (remote prefill) instances"),
    local: int = typer.Option(2, help="local PD instances, split between prefill and decode"),
    bandwidth: str = typer.Option("100gbit", help="link bandwidth between the clusters"),
    link_share: float = typer.Option(0.7, help="share of the link KV may use"),
    output_len: float = typer.Option(1024, help="mean output tokens per request"),
    decode_batch: int | None = typer.Option(None, help="decode batch (default: largest in the profile)"),
    tpot_ms: float | None = typer.Option(None, help="decode time per output token at --decode-batch"),
    as_json: bool = JSON,
) -> None:
    """PrfaaS throughput model: Φ_kv per length, the best offload threshold and prefill:decode split."""
    from prfaas.plan.capacity_cmd import run_capacity
    from prfaas.plan.render import capacity_table

    out = run_capacity(profile=profile, local_profile=local_profile, kv=kv, config=config, model=model,
                       dtype=dtype, codec=codec, lengths=lengths, prfaas=prfaas, local=local,
                       link_bps=parse_rate(bandwidth), link_share=link_share, output_len=output_len,
                       decode_batch=decode_batch, tpot_ms=tpot_ms)
    _emit(out, as_json, capacity_table)


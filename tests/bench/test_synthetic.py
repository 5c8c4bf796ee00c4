"""The synthetic engines: KV of exactly the size ``prfaas plan kv`` computes from the published configs, carried by
the real blob format, deterministic tokens, and a real deployment serving one (remote and local routes agree)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from prfaas.engine import load_engine
from prfaas.engine.synthetic import SPECS, SyntheticCache, SyntheticEngine, next_token
from prfaas.errors import KVBadFormat, KVIncompatible
from prfaas.kv import BlobReader, decode_state, encode_state
from prfaas.plan.kvcalc import plan_from_path
from tests.services.deploy import deployment

FIXTURES = Path(__file__).parent.parent / "plan" / "fixtures"
CASES = [("synthetic-kimi-linear-48b", "kimi-linear-48b-a3b-instruct.json", 7 * 576 * 2, 20 * (49152 + 524288) * 2),
         ("synthetic-minimax-m2", "minimax-m2.json", 62 * 4096, 0)]


@pytest.fixture(scope="module", params=[c[0] for c in CASES])
def engine(request: pytest.FixtureRequest) -> SyntheticEngine:
    loaded = load_engine(request.param)
    assert isinstance(loaded, SyntheticEngine)
    return loaded


@pytest.mark.parametrize(("name", "fixture", "per_token", "fixed"), CASES)
def test_kv_sizes_match_the_plan_of_the_published_config(name: str, fixture: str, per_token: int, fixed: int) -> None:
    engine = load_engine(name)
    published = plan_from_path(FIXTURES / fixture, dtype="bfloat16")
    assert engine.kv_footprint == (fixed, per_token) == (published.fixed_bytes, published.bytes_per_token)
    for seq_len in (1, 100, 1000):
        kv = engine.prefill(list(range(1000, 1000 + seq_len))).kv
        assert kv.nbytes == published.kv_bytes(seq_len)
        assert [layer.nbytes for layer in kv.layers] == [layer.bytes_at(seq_len) for layer in published.layers]


def test_blob_round_trip_through_the_real_format(engine: SyntheticEngine) -> None:
    prompt = list(range(2000, 2300))
    out = engine.prefill(prompt)
    blob = encode_state(out.kv, kv_id=None, chunk_size=1 << 20)
    assert len(blob) > out.kv.nbytes
    back = decode_state(blob)
    assert back.first_token == out.next_token and back.seq_len == len(prompt)
    assert engine.decode(back, out.next_token, 8) == engine.generate(prompt, 9)[1:]
    assert isinstance(engine.restore(back), SyntheticCache)
    streamed = BlobReader(retain=engine.keeps_kv)  # what decode pulls with: verified and parsed, sizes kept
    streamed.feed(blob)
    assert engine.decode(streamed.state(), out.next_token, 8) == engine.generate(prompt, 9)[1:]


def test_restore_refuses_a_wrong_size_or_another_model(engine: SyntheticEngine) -> None:
    kv = engine.prefill(list(range(1000, 1064))).kv
    grown = next(layer for layer in kv.layers if layer.grows)
    name = next(iter(grown.tensors))
    grown.tensors[name] = grown.tensors[name][:, :-1]
    with pytest.raises(KVBadFormat, match="plans"):
        engine.restore(kv)
    other = load_engine(next(n for n in SPECS if n != engine.name))
    with pytest.raises(KVIncompatible):
        other.restore(engine.prefill([1000, 1001]).kv)


def test_tokens_are_deterministic_and_batch_independent(engine: SyntheticEngine) -> None:
    a, b = list(range(1000, 1200)), list(range(1001, 1201))
    assert engine.generate(a, 6) == engine.generate(a, 6)
    assert engine.generate(a, 6)[0] != engine.generate(b, 6)[0]
    rows = engine.forward_rows([1500, 1600], [200, 300], None, SyntheticCache(0))  # type: ignore[arg-type]
    assert rows.argmax(dim=1).tolist() == [next_token(1500, 200), next_token(1600, 300)]
    assert all(1000 <= t < 2000 for t in engine.generate(a, 20))
    assert engine.tokenizer.decode([1234, 1500]) == " syn1234 syn1500"


def test_the_last_pass_of_a_chunked_prefill_streams_its_layers_on_schedule() -> None:
    """As the transformers engine's last pass does: each layer reaches ``on_layer`` between two layers, not all at
    the end, so the blob's chunks leave while later layers still "compute" (the planner's overlap rests on it), and
    what ``on_layer`` costs adds to the pass's time, as a real engine's hook does."""
    engine = load_engine("synthetic-kimi-linear-48b")
    assert isinstance(engine, SyntheticEngine)
    prompt = [1000 + i % 256 for i in range(16384)]
    first_pass = engine.spec.prefill_seconds(4096)
    last_pass = engine.spec.prefill_seconds(len(prompt), 4096)
    began, arrivals, hook_s = time.perf_counter(), [], 0.002

    def on_layer(_: object) -> None:
        arrivals.append(time.perf_counter() - began)
        time.sleep(hook_s)

    passes = list(engine.prefill_chunks(prompt, lambda done: 4096 if done == 0 else 0, on_layer=on_layer))
    assert passes[0] is None and len(passes) == 2 and len(arrivals) == engine.num_layers
    assert arrivals == sorted(arrivals)
    assert arrivals[0] < first_pass + last_pass / 2 < arrivals[-1]  # the first layer long before the last
    seconds = passes[1][2]  # type: ignore[index]
    assert seconds >= first_pass + last_pass + engine.num_layers * hook_s


def test_compute_model_grows_with_prompt_and_batch() -> None:
    for spec in SPECS.values():
        times = [spec.prefill_seconds(n) for n in (1024, 8192, 32768)]
        assert times == sorted(times) and times[2] > 4 * times[1] > 0  # the attention term is quadratic
        chunked = spec.prefill_seconds(1024) + spec.prefill_seconds(2048, 1024)
        assert chunked == pytest.approx(spec.prefill_seconds(2048))
        plan = load_engine(spec.name).plan
        assert spec.decode_step_seconds(1, 1024, plan) < spec.decode_step_seconds(32, 32 * 1024, plan)


def test_a_deployment_serves_a_synthetic_model_remote_and_local() -> None:
    name = "synthetic-kimi-linear-48b"
    engine = load_engine(name)
    long_prompt, short_prompt = list(range(1100, 1400)), list(range(1100, 1120))
    with deployment(name, "relay", threshold=64) as (url, _):
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == name
        for prompt, route in ((long_prompt, "remote"), (short_prompt, "local")):
            reply = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 6,
                                                               "temperature": 0}, timeout=60).json()
            assert reply["prfaas"]["route"] == route, reply["prfaas"]
            assert reply["prfaas"]["reason_code"] == {"remote": "over_threshold", "local": "below_threshold"}[route]
            assert reply["choices"][0]["text"] == engine.tokenizer.decode(engine.generate(prompt, 6))
            if route == "remote":
                assert reply["prfaas"]["kv_bytes"] >= engine.plan.kv_bytes(len(prompt))
        stores = httpx.get(f"{url}/admin/kv").json()
        assert all(report["store"]["blobs"] == 0 for report in stores.values())

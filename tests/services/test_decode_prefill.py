"""A decode instance's local prefill: chunked while other sequences run (they step between the chunks), one pass
when none does (nothing to interleave, and a chunk after the first attends through an explicit mask, SDPA's slower
path on the CPU). Real engine (tiny-llama), real service; the engine thread is stopped so that this test's thread
owns the batch, as that thread does in service."""

from __future__ import annotations

import time

from prfaas.config import load_config
from prfaas.engine import load_engine
from prfaas.engine.batch import Row
from prfaas.messages import GenerateRequest
from prfaas.services.decode import DecodeService


def test_local_prefill_is_one_pass_unless_sequences_are_running() -> None:
    engine = load_engine("tiny-llama")
    service = DecodeService(engine, load_config(None, prefill_chunk_tokens=8))
    service.scheduler.close()  # this thread owns the batch from here on
    try:
        request = GenerateRequest(request_id="r", token_ids=list(range(1, 41)), max_tokens=4)
        alone = list(service._prefill(request, request.sampling, time.perf_counter()))
        assert alone.count(None) == 0  # one forward pass, no pause
        last = alone[-1]
        assert last is not None
        cache, first, length, _ = last
        service.scheduler.batch.add(Row("running", length, first, None, 1), cache)
        beside = list(service._prefill(request, request.sampling, time.perf_counter()))
        assert beside.count(None) == 4  # 40 tokens in chunks of 8: the running row steps in 4 pauses
        assert beside[-1] is not None and beside[-1][1] == first  # the same first token either way
    finally:
        service.close()

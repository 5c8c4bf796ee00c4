"""What a role's pulls share lives in its ``TransferContext``, not in the process: two roles in one process (the
vLLM connector beside prfaas, two instances in a test) keep their own retry cap, arenas and limits; and no module
of the ground floor, kv, transfer or store (nor the role's TLS settings) keeps process-wide state behind a
``global``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from prfaas.errors import KVBadFormat, PrfaasError
from prfaas.kv import BlobReader
from prfaas.limits import WireLimits
from prfaas.store import BlobStore
from prfaas.transfer import TransferContext, TransferServer, pull
from prfaas.transfer.stats import MIN_RETRIES
from tests.transfer.helpers import Fault, FaultProxy, assert_clean, assert_same, blob_frames, fill, make_state, run

ROOT = Path(__file__).resolve().parents[2] / "prfaas"
STATELESS = ["kv", "transfer", "store", "limits.py", "records.py", "ratelimit.py", "security/runtime.py"]


def _exhaust(context: TransferContext) -> None:
    """Use up the context's retry cap for the next minute, as a bad link would."""
    while context.stats.pull.allow_retry("KV_TRUNCATED"):
        pass


def test_each_role_has_its_own_retry_cap_and_arenas() -> None:
    state = make_state(layers=2, tokens=64)
    kv_id, frames = blob_frames(state, chunk_size=16 << 10)
    spent, fresh = TransferContext(), TransferContext()
    _exhaust(spent)

    async def scenario() -> tuple[BaseException | None, int]:
        store = BlobStore(64 << 20, 120)
        fill(store, kv_id, frames)
        server = TransferServer(store)
        # each pull's first connection is cut part-way: only a retry completes it
        proxy = FaultProxy(await server.start(), lambda n: Fault(cut_after=20_000) if n < 2 else None)
        address = f"127.0.0.1:{await proxy.start()}"
        refused: BaseException | None = None
        try:
            try:
                await pull(address, kv_id, BlobReader(), timeout_s=2.0, retries=2, backoff_s=0.01, context=spent)
            except PrfaasError as exc:
                refused = exc
            got = await pull(address, kv_id, BlobReader(), timeout_s=2.0, retries=2, backoff_s=0.01,
                             context=fresh)
            assert_same(state, got)
            held = fresh.arenas.in_use()
            del got
        finally:
            await proxy.close()
            await server.close()
        store.release(kv_id)
        assert_clean(store)
        return refused, held

    refused, held = run(scenario)
    assert isinstance(refused, PrfaasError) and refused.code == "KV_TRUNCATED"  # its role's cap said no
    assert spent.stats.pull.retries_refused >= 1 and fresh.stats.pull.retries_refused == 0
    assert fresh.stats.pull.health().retries == 1 and spent.stats.pull.health().retries == MIN_RETRIES
    assert held == 1 and fresh.arenas.in_use() == 0  # the pulled state lived in the fresh role's own arena
    assert spent.arenas.arenas <= 1


def test_readers_of_one_process_apply_their_own_limits() -> None:
    _, frames = blob_frames(make_state(layers=4, tokens=64), chunk_size=16 << 10)
    blob = b"".join(frames)
    strict, default = BlobReader(limits=WireLimits(max_layers=2)), BlobReader()
    with pytest.raises(KVBadFormat):
        strict.feed(blob)
    default.feed(blob)  # the same process, another role's limits: unaffected
    assert len(default.state().layers) > 2


@pytest.mark.parametrize("name", STATELESS)
def test_no_module_keeps_process_wide_state(name: str) -> None:
    """No ``global`` statement: state that a role sets lives in an object the role owns."""
    paths = [ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py"))
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in paths
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]
    assert found == []

"""``ConnectorSettings`` (the connector's ``kv_connector_extra_config``): validated once, and a request can only
send its KV to a store the producer was configured with. Plain prfaas, no vLLM needed."""

from __future__ import annotations

import pytest

from prfaas.errors import InvalidRequest
from prfaas.vllm.settings import ConnectorSettings


def test_defaults_and_tls() -> None:
    settings = ConnectorSettings.from_extra({"kv_address": "127.0.0.1:7301", "tls": {"ca": "ca.pem"}})
    assert settings.codec == "none" and settings.chunk_bytes == 1 << 20 and settings.tls.ca == "ca.pem"
    assert settings.destination(None) == "127.0.0.1:7301" and not settings.pushes_to("127.0.0.1:7301")


@pytest.mark.parametrize("extra", [
    {"kv_adress": "127.0.0.1:1"},  # a typo is named, not ignored
    {"kv_address": "localhost"},
    {"relays": ["127.0.0.1:99999"]},
    {"codec": "zip"},
    {"kv_deadline_s": 0},
    {"retries": -1},
    {"tls": "on"},
    {"overlap": "sometimes"},
])
def test_bad_extra_config_is_refused(extra: dict[str, object]) -> None:
    with pytest.raises(InvalidRequest):
        ConnectorSettings.from_extra(extra)


def test_a_request_may_name_only_configured_relays() -> None:
    settings = ConnectorSettings.from_extra({"kv_address": "127.0.0.1:7301", "relays": ["127.0.0.1:7400"]})
    assert settings.destination("127.0.0.1:7400") == "127.0.0.1:7400" and settings.pushes_to("127.0.0.1:7400")
    with pytest.raises(InvalidRequest):
        settings.destination("127.0.0.9:7400")
    relay_only = ConnectorSettings.from_extra({"relay": "127.0.0.1:7400"})
    assert relay_only.destination(None) == "127.0.0.1:7400" and relay_only.pushes_to("127.0.0.1:7400")


def test_relay_from_request_takes_the_relay_the_router_names() -> None:
    """A producer behind its prfaas instance (``--engine vllm``) pushes where the request says, as prfaas's own
    prefill does with ``push_to``; the address must still be one."""
    settings = ConnectorSettings.from_extra({"kv_address": "127.0.0.1:7301", "relay_from_request": True})
    assert settings.destination("127.0.0.9:7400") == "127.0.0.9:7400" and settings.pushes_to("127.0.0.9:7400")
    assert settings.destination(None) == "127.0.0.1:7301"
    with pytest.raises(InvalidRequest):
        settings.destination("nowhere")
    with pytest.raises(InvalidRequest):
        ConnectorSettings.from_extra({"relay_from_request": "yes"})


@pytest.mark.parametrize(("overlap", "device", "holds"), [
    ("auto", "cpu", True),  # the encoder would compete with vLLM's OpenMP threads for the cores
    ("auto", "cuda", False),  # the forward pass is on the GPU: each layer leaves while later ones compute
    ("layers", "cpu", False),
    ("step", "cuda", True),
])
def test_overlap_decides_whether_saved_layers_wait_for_the_steps_end(overlap: str, device: str, holds: bool) -> None:
    assert ConnectorSettings.from_extra({"overlap": overlap}).holds_layers(device) is holds

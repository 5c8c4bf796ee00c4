"""Redaction hooks: the built-in masks identifiers, refusals name kinds not values, hooks load by name."""

from __future__ import annotations

import pytest

from prfaas.errors import InvalidRequest, PromptRefused
from prfaas.tenancy import redact

TEXT = ("Mail jane.doe+x@example.co.uk or call +1 (555) 010-7788 from 10.1.2.3; card 4111 1111 1111 1111, "
        "order 1234567890123 stays.")


def test_mask_identifiers_masks_each_kind_and_keeps_the_rest() -> None:
    out = redact.mask_identifiers(TEXT, "acme")
    for kind in ("[EMAIL]", "[PHONE]", "[IP]", "[CARD]"):
        assert kind in out
    for secret in ("jane.doe", "555", "10.1.2.3", "4111"):
        assert secret not in out
    assert "order" in out and "stays." in out
    assert redact.mask_identifiers("nothing to see", "acme") == "nothing to see"


def test_refusal_names_the_kinds_never_the_values() -> None:
    with pytest.raises(PromptRefused) as err:
        redact.refuse_identifiers(TEXT, "acme")
    assert "EMAIL" in err.value.message and "jane" not in err.value.message
    assert err.value.http_status == 400 and err.value.code == "PROMPT_REFUSED"
    assert redact.refuse_identifiers("plain text", "acme") == "plain text"


def test_apply_covers_prompt_and_every_chat_part() -> None:
    hook = redact.load_hook("mask_identifiers")
    prompt, messages = redact.apply(hook, "acme", "write to a@b.io", [
        {"role": "user", "content": "I am at 192.168.0.1"},
        {"role": "user", "content": [{"type": "text", "text": "mail c@d.io"}, {"type": "image_url"}]}])
    assert prompt == "write to [EMAIL]"
    assert messages[0]["content"] == "I am at [IP]"
    assert messages[1]["content"][0]["text"] == "mail [EMAIL]" and messages[1]["content"][1] == {"type": "image_url"}
    assert redact.apply(hook, "acme", [1, 2, 3], []) == ([1, 2, 3], [])  # token ids: no text to redact


def test_hooks_load_by_module_path_and_bad_ones_are_refused() -> None:
    assert redact.load_hook("prfaas.tenancy.redact:mask_identifiers") is redact.mask_identifiers
    with pytest.raises(InvalidRequest):
        redact.load_hook("prfaas.tenancy.redact:nothing_here")
    with pytest.raises(InvalidRequest):
        redact.load_hook("not_a_hook")
    with pytest.raises(PromptRefused):
        redact.apply(lambda text, tenant: None, "acme", "x", [])  # type: ignore[arg-type,return-value]

"""Redaction hooks: transform or refuse a prompt before it is tokenised.

The hook point is the router, before the prompt is tokenised; it runs for every request of a tenant whose policy
names a hook (``redact:``). It runs on local routes too: the route is chosen after tokenisation (it depends on the
prompt's length), and one tokenisation for both routes keeps their tokens, and so their outputs, identical.

A hook is ``(text: str, tenant: str) -> str``: it returns the text to use, or raises ``PromptRefused`` (HTTP 400,
code ``PROMPT_REFUSED``) with a reason that names no part of the prompt. It is called once per text part (the
prompt, or each chat message's content). Name a built-in (``HOOKS``) or any importable ``module:function``.

Built-in: ``mask_identifiers`` replaces e-mail addresses, IPv4 addresses, card-like digit runs (Luhn-valid, 13-19
digits) and phone numbers with ``[EMAIL]``, ``[IP]``, ``[CARD]``, ``[PHONE]``; ``refuse_identifiers`` refuses a
prompt that holds any of them instead.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from prfaas.errors import InvalidRequest, PromptRefused

Hook = Callable[[str, str], str]

_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_IPV4 = re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")
_CARD = re.compile(r"\b\d(?:[ -]?\d){12,18}\b")
_PHONE = re.compile(r"(?<![\w+])\+?\d[\d ().-]{7,}\d\b")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch) * (2 if i % 2 else 1)
        total += d - 9 if d > 9 else d
    return total % 10 == 0


def _card(match: re.Match[str]) -> str:
    digits = re.sub(r"\D", "", match.group())
    return "[CARD]" if _luhn(digits) else match.group()


def find_identifiers(text: str) -> list[str]:
    """The kinds of identifier in ``text`` (for refusals: kinds, never the values)."""
    masked = mask_identifiers(text, "")
    return sorted({k for k in ("EMAIL", "IP", "CARD", "PHONE") if f"[{k}]" in masked and f"[{k}]" not in text})


def mask_identifiers(text: str, tenant: str) -> str:
    text = _EMAIL.sub("[EMAIL]", text)
    text = _IPV4.sub("[IP]", text)
    text = _CARD.sub(_card, text)
    return _PHONE.sub("[PHONE]", text)


def refuse_identifiers(text: str, tenant: str) -> str:
    kinds = find_identifiers(text)
    if kinds:
        raise PromptRefused(f"tenant {tenant}'s policy refuses prompts holding identifiers ({', '.join(kinds)})")
    return text


HOOKS: dict[str, Hook] = {"mask_identifiers": mask_identifiers, "refuse_identifiers": refuse_identifiers}


def load_hook(name: str) -> Hook:
    """A built-in hook by name, or ``module:function``; ``InvalidRequest`` if it cannot be found."""
    if name in HOOKS:
        return HOOKS[name]
    module, _, attr = name.partition(":")
    try:
        hook = getattr(importlib.import_module(module), attr) if attr else None
    except (ImportError, AttributeError) as exc:
        raise InvalidRequest(f"redaction hook {name!r} cannot be loaded: {exc}") from exc
    if not callable(hook):
        raise InvalidRequest(f"redaction hook {name!r}: name a built-in ({', '.join(HOOKS)}) or module:function")
    return hook


def apply(hook: Hook, tenant: str, prompt: Any, messages: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
    """``(prompt, messages)`` with every text part passed through ``hook``; token-id prompts pass unchanged (the
    client tokenised them: there is no text to redact)."""
    if isinstance(prompt, str):
        prompt = _checked(hook(prompt, tenant))
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": _checked(hook(content, tenant))}
        elif isinstance(content, list):
            message = {**message, "content": [
                {**p, "text": _checked(hook(p["text"], tenant))} if isinstance(p, dict) and isinstance(
                    p.get("text"), str) else p for p in content]}
        out.append(message)
    return prompt, out


def _checked(text: Any) -> str:
    if not isinstance(text, str):
        raise PromptRefused("the redaction hook returned no text")
    return text

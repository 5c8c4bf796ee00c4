"""One exception tree for prfaas; every error carries the wire code of docs/contracts.md.

    PrfaasError                      code            HTTP  retryable
    ├── KVNotFound                   KV_NOT_FOUND     503   yes (re-prefill)
    │   └── KVPrefixMissing          KV_PREFIX_MISSING
    │                                                 503   yes  (a suffix blob's prefix is not held: resend whole)
    ├── KVExpired                    KV_EXPIRED       503   yes (re-prefill)
    ├── KVTimeout                    KV_TIMEOUT       504   yes
    ├── KVCorrupt                    KV_CORRUPT       502   yes (fetch again)
    ├── KVTruncated                  KV_TRUNCATED     502   yes (resume)
    ├── KVBadFormat                  KV_BAD_FORMAT    502   no
    ├── KVIncompatible               KV_INCOMPATIBLE  502   no   (409 at registration)
    ├── KVUnauthorized               KV_UNAUTHORIZED  403   no
    ├── KVTooLarge                   KV_TOO_LARGE     413   no
    ├── KVStoreFull                  KV_STORE_FULL    503   yes (after back-off)
    ├── KVUnavailable                KV_UNAVAILABLE   503   yes (another instance)
    │   └── InstanceUnreachable      KV_UNAVAILABLE   503   yes  (an instance the router called, by id)
    ├── RateLimited                  RATE_LIMITED     429   yes (after Retry-After)
    │   └── PoolQuotaExceeded        POOL_QUOTA_EXCEEDED
    │                                                 429   yes  (a client cluster over its quota in the prefill pool)
    ├── RequestTimeout               REQUEST_TIMEOUT  408   no   (an HTTP request head or body too slow to arrive)
    ├── InvalidRequest               INVALID_REQUEST  400   no   (bad input from a user or a file)
    │   ├── ModelNotFound            model_not_found  404   no   (a model this deployment does not serve)
    │   └── ContextLengthExceeded    context_length_exceeded
    │                                                 400   no   (prompt + max_tokens over the model's context)
    ├── PromptRefused                PROMPT_REFUSED   400   no   (a tenant's redaction hook refused the prompt)
    ├── Unreachable                  UNREACHABLE      503   yes  (a tool cannot connect to the server it was pointed at)
    └── LabUnavailable               LAB_UNAVAILABLE  500   no   (no root, namespaces or tools for prfaas lab)

Conditions the OpenAI API names keep OpenAI's own lowercase code (``model_not_found``,
``context_length_exceeded``; the API-key guard's ``invalid_api_key``), so a client written for OpenAI or vLLM
recognises them; every other code is prfaas's. Every error body carries one (``prfaas.services.http``).

Third-party errors are mapped at the boundary (``raise KVCorrupt(...) from exc``); callers that must decide per
item receive errors as data (``error_from_code``).
"""

from __future__ import annotations

from typing import ClassVar


class PrfaasError(Exception):
    """Base of every prfaas error. ``code`` is the wire code; ``http_status`` what the router answers."""

    code: ClassVar[str] = "PRFAAS_ERROR"
    http_status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class KVNotFound(PrfaasError):
    code = "KV_NOT_FOUND"
    http_status = 503
    retryable = True


class KVPrefixMissing(KVNotFound):
    """A suffix-only blob extends a cached prefix the decode instance no longer holds (evicted, or never
    stored there): the router sends the request once more with a whole blob."""

    code = "KV_PREFIX_MISSING"


class KVExpired(PrfaasError):
    code = "KV_EXPIRED"
    http_status = 503
    retryable = True


class KVTimeout(PrfaasError):
    code = "KV_TIMEOUT"
    http_status = 504
    retryable = True


class KVCorrupt(PrfaasError):
    code = "KV_CORRUPT"
    http_status = 502
    retryable = True


class KVTruncated(PrfaasError):
    code = "KV_TRUNCATED"
    http_status = 502
    retryable = True


class KVBadFormat(PrfaasError):
    code = "KV_BAD_FORMAT"
    http_status = 502


class KVIncompatible(PrfaasError):
    code = "KV_INCOMPATIBLE"
    http_status = 502


class KVUnauthorized(PrfaasError):
    code = "KV_UNAUTHORIZED"
    http_status = 403


class KVTooLarge(PrfaasError):
    code = "KV_TOO_LARGE"
    http_status = 413


class KVStoreFull(PrfaasError):
    code = "KV_STORE_FULL"
    http_status = 503
    retryable = True


class KVUnavailable(PrfaasError):
    code = "KV_UNAVAILABLE"
    http_status = 503
    retryable = True


class InstanceUnreachable(KVUnavailable):
    """An instance the router called could not be reached or dropped the connection mid-stream
    (``prfaas.services.instance_client``); ``instance_id`` says which, so the router knows whom to replace."""

    def __init__(self, message: str, instance_id: str) -> None:
        super().__init__(message)
        self.instance_id = instance_id


class RateLimited(PrfaasError):
    code = "RATE_LIMITED"
    http_status = 429
    retryable = True

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PoolQuotaExceeded(RateLimited):
    """A client cluster is over its quota in a prefill instance (in-flight prompt tokens or tokens/s,
    ``prfaas.tenancy.clusters``): told at once, so its router prefills locally instead of queueing."""

    code = "POOL_QUOTA_EXCEEDED"


class RequestTimeout(PrfaasError):
    """An HTTP request's head or body did not arrive within its read timeout (``prfaas.security.readtimeout``)."""

    code = "REQUEST_TIMEOUT"
    http_status = 408


class InvalidRequest(PrfaasError):
    """``param``: the request field at fault, where one is (the OpenAI error body's ``param``)."""

    code = "INVALID_REQUEST"
    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidRequest):
    """The request's ``model`` is none this deployment serves: 404, as OpenAI and vLLM answer."""

    code = "model_not_found"
    http_status = 404

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt plus ``max_tokens``, does not fit the model's context (OpenAI's code)."""

    code = "context_length_exceeded"


class PromptRefused(PrfaasError):
    """A tenant's redaction hook refused the prompt (``prfaas.tenancy.redact``)."""

    code = "PROMPT_REFUSED"
    http_status = 400


class Unreachable(PrfaasError):
    """A command-line tool (``prfaas probe run``, ``prfaas bench run``) cannot connect to the server it was given;
    a KV peer that cannot be reached is ``KVUnavailable`` instead."""

    code = "UNREACHABLE"
    http_status = 503
    retryable = True


class LabUnavailable(PrfaasError):
    """``prfaas lab`` cannot run here: not root, no network namespaces, or a missing tool (ip, tc, iptables)."""

    code = "LAB_UNAVAILABLE"


_BY_CODE: dict[str, type[PrfaasError]] = {
    cls.code: cls
    for cls in (
        KVNotFound, KVPrefixMissing, KVExpired, KVTimeout, KVCorrupt, KVTruncated, KVBadFormat, KVIncompatible,
        KVUnauthorized, KVTooLarge, KVStoreFull, KVUnavailable, RateLimited, PoolQuotaExceeded, RequestTimeout,
        InvalidRequest, ModelNotFound, ContextLengthExceeded, PromptRefused,
    )
}


def is_known(code: str) -> bool:
    """Whether ``code`` names a class of this tree (a peer's body may carry another vocabulary's code)."""
    return code in _BY_CODE


def error_from_code(code: str, message: str) -> PrfaasError:
    """Rebuild the exception a peer reported on the wire; unknown codes become the base class."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = PrfaasError(f"{code}: {message}")
        return err
    return cls(message)

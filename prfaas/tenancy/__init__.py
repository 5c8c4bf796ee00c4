"""Tenants: who a request belongs to (from its API key), what that tenant's data may do (residency, prompt
crossing, codec and TTL overrides, rate limit, redaction), and what it used (metering).

Light on purpose: nothing here imports torch. The router applies the policy (``prfaas.services.router``); stores
carry each blob's tenant into their records (``prfaas.store``); ``prfaas admin usage`` sums the audit logs.
"""

from prfaas.tenancy.policy import DEFAULT_TENANT, TenantPolicy, Tenants

__all__ = ["DEFAULT_TENANT", "TenantPolicy", "Tenants"]

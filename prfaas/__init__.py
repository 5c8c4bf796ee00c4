"""prfaas: Prefill-as-a-Service.

Prefill runs in one datacenter, decode in another; the KV cache crosses ordinary Ethernet in a versioned,
checksummed blob. Heavy dependencies (torch, transformers) are imported only by ``prfaas.engine``.
"""

__version__ = "0.1.0"

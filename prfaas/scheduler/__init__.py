"""Scheduling policies used by the router: selective offload, placement, circuit breakers, rate limits, link health.

Pure functions and small state machines over instance snapshots: no I/O, so each policy is unit-tested on
synthetic states and the router stays the only place that talks to instances.
"""

from prfaas.ratelimit import TokenBucket
from prfaas.scheduler.breaker import CircuitBreaker
from prfaas.scheduler.link import LinkMonitor
from prfaas.scheduler.placement import pick_decode, pick_prefill
from prfaas.scheduler.policy import Decision, Scheduler
from prfaas.scheduler.speed import PrefillSpeed

__all__ = ["CircuitBreaker", "Decision", "LinkMonitor", "PrefillSpeed", "Scheduler", "TokenBucket", "pick_decode",
           "pick_prefill"]

"""The serving roles, one process each: router (OpenAI API), prefill, decode, relay; and ``prfaas up``."""

"""``prfaas admin``: operator tools against a running deployment (drain, pre-flight check, canary weights,
scaling advice). Everything here talks to the router's HTTP API; nothing needs the engine."""

"""Observability: metrics (one module defines every name) and structured logs."""

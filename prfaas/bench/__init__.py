"""Benchmarks users run: ``prfaas bench transfer`` (the KV data plane), and the acceptance matrix."""

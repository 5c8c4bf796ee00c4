"""prfaas inside vLLM: ``PrfaasConnector`` (a vLLM KV connector that moves a request's KV as a prfaas blob) and
``launch`` (starts vLLM's CLI with the fixes its CPU build needs).

Nothing here is imported by the rest of prfaas: these modules import torch and vLLM, and run only inside the
virtualenv that ``scripts/install-vllm.sh`` makes (``.venv-vllm``). See docs/vllm.md.
"""

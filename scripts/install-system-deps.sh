#!/usr/bin/env bash
# prfaas: install the Debian packages the project needs, only those missing (idempotent; safe to run again).
# Called by the Makefile set-up. Without root or apt-get it says what is missing and exits 0: the parts that
# need these packages (the two-datacenter lab, the Redis store tests) then skip with a clear reason.
set -euo pipefail

# package: what needs it
PACKAGES=(
  iptables   # prfaas lab: random loss (-m statistic), link cut, NFQUEUE delay
  iproute2   # prfaas lab: ip netns, veth, tc (rate)
  redis-server  # prfaas store: the Redis backend's tests start their own redis-server
  iperf3     # benchmarks/transport.py: the wire's ceiling
  libibverbs1  # benchmarks/transport.py: Mooncake's transfer engine will not import without it
  libtcmalloc-minimal4  # benchmarks/engine.py: the tcmalloc preload vLLM's CPU docs recommend for vLLM
  openssl    # prfaas bench transfer --tls, TLS tests: throw-away certificates
  prometheus  # deploy/prometheus: `promtool test rules` on the alert rules (tests/test_alerts.py)
  g++        # prfaas/engine/native.py: builds the engine's CPU decode attention kernel
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-deps: missing ${missing[*]} (needs root and apt-get); the tests that need them will skip" >&2
  exit 0
fi
echo "install-system-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }; then
  echo "install-system-deps: could not install ${missing[*]}; the tests that need them will skip" >&2
fi

"""Running ``ip``, ``tc`` and ``iptables`` (bounded in time), and the check that the lab can exist here.

Every failure becomes ``LabUnavailable`` with the command and its stderr, so the CLI can say what went wrong.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from prfaas.errors import LabUnavailable

TOOLS = ("ip", "tc", "iptables-restore")
COMMAND_TIMEOUT_S = 15.0


def run(args: list[str], ns: str | None = None, stdin: str | None = None, check: bool = True) -> str:
    """Run ``args`` (inside namespace ``ns`` when given); return stdout. ``check=False`` ignores failures."""
    cmd = ["ip", "netns", "exec", ns, *args] if ns else args
    try:
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not check:
            return ""
        raise LabUnavailable(f"{' '.join(cmd)}: {exc}") from exc
    if check and done.returncode != 0:
        raise LabUnavailable(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def missing_support() -> str | None:
    """Why the lab cannot run here (None when it can): root, the tools, network namespaces."""
    if os.geteuid() != 0:
        return "prfaas lab needs root (network namespaces, tc and iptables); run it as root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"prfaas lab needs {', '.join(missing)}; install them with scripts/install-system-deps.sh "
                "(Debian packages iproute2 and iptables)")
    if not os.path.exists("/proc/self/ns/net"):
        return "this kernel has no network namespaces"
    return None


def require_support() -> None:
    """Raise ``LabUnavailable`` with the reason when the lab cannot run here."""
    reason = missing_support()
    if reason:
        raise LabUnavailable(reason)


def namespaces() -> list[str]:
    return sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []

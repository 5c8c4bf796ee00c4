"""``prfaas up``: a whole deployment on this machine, every role its own process on 127.0.0.1.

``--clusters N`` (N > 1): one prefill pool shared by N client clusters (docs/pool.md). Cluster ``i`` is its own
router on ``--port`` + ``i``, its relay (relay mode) and decode instances, labelled datacenter ``dc-b``, ``dc-c``, …
(``_spawn_router`` and ``_spawn_cluster``, where ``--lab`` places them in its own datacenter); every prefill
instance registers with every router. Each cluster gets a name and a key: the first N entries of the config's
``clusters``, else ``cluster-<i>`` with a random key, written with the rest of the config into a private temporary
directory.

Start order: router, relay, prefill, decode (with clusters: every cluster's router, then each cluster's relay and
decode, then the pool).
The router URL is printed once ``/health`` is 200; a role that exits
before that stops the start (a bad config fails at once rather than in a restart loop). From then on a role that
fails is restarted with back-off, each decision one line on stdout (``prfaas.services.supervisor``); the deployment
ends when the router is gone for good. SIGINT/SIGTERM stop the supervision, then the children in reverse order
(SIGINT, which stops an instance without a drain, then SIGKILL after a grace period); children also get SIGTERM
from the kernel if this process dies, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from prfaas.errors import InvalidRequest, PrfaasError
from prfaas.lab.spec import Topology
from prfaas.security import local
from prfaas.services.supervisor import RestartPolicy, Role, Supervisor, die_with_parent

STOP_GRACE_S = 15.0
SUPERVISE_INTERVAL_S = 0.2


@dataclass(frozen=True)
class UpOptions:
    model: str = "smollm2-135m"
    mode: str = "relay"
    host: str = "127.0.0.1"
    port: int = 8000
    prefill: int = 1
    decode: int = 1
    offload_threshold: int | None = None
    config: str | None = None
    dtype: str = "float32"
    engine: str = "prfaas"  # of the prefill and decode instances: prfaas | vllm (prfaas.vllm.serving)
    device: str = "cpu"  # of the embedded engine's instances: cpu | cuda | cuda:N | auto
    startup_timeout_s: float = 600.0
    log_file: str | None = None  # children's output goes here instead of this terminal
    lab: bool = False  # place each role in its datacenter of the lab (`prfaas lab up` first)
    lab_index: int | None = None  # with lab: the numbered lab `Topology.numbered(i)` instead of the default one
    tls: bool = False  # mutual TLS 1.3 on every hop, certificates in a temporary directory (prfaas.security.local)
    max_restarts: int = 10  # failures in a row before a role is given up; 0: never restart (prfaas.services.supervisor)
    clusters: int = 1  # client clusters sharing the prefill pool; 1: one deployment, as without pools



class Deployment:
    def __init__(self, options: UpOptions) -> None:
        if options.mode not in ("relay", "direct"):
            raise InvalidRequest("--mode must be relay or direct")
        if options.engine not in ("prfaas", "vllm"):
            raise InvalidRequest("--engine must be prfaas or vllm")
        if options.prefill < 1 or options.decode < 1 or options.clusters < 1:
            raise InvalidRequest("--prefill, --decode and --clusters must be at least 1")
        self.options = options
        self.roles: list[Role] = []  # start order, router first; the supervisor watches this same list
        self.supervisor = Supervisor(self.roles, RestartPolicy(max_restarts=options.max_restarts), _say)
        self.tls_dir = tempfile.mkdtemp(prefix="prfaas-tls-") if options.tls else None
        self.tls_configs = local.tls_configs(self.tls_dir, options.config) if self.tls_dir else {}
        self.pool_dir = tempfile.mkdtemp(prefix="prfaas-pool-") if options.clusters > 1 else None
        self.cluster_names, self.configs = self._pool_configs() if self.pool_dir else ([], {})

    @property
    def children(self) -> list[subprocess.Popen[bytes]]:
        """Each role's current process, in start order."""
        return [role.process for role in self.roles]

    @property
    def url(self) -> str:
        """The first cluster's router, as a client here reaches it."""
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Each cluster's router, as a client here reaches it."""
        if self.options.lab:
            from prfaas.lab.placement import client_url

            return [client_url(self._port(i), self._lab_topology(), cluster=i) for i in range(self.options.clusters)]
        scheme = "https" if self.tls_dir else "http"
        return [f"{scheme}://{self.options.host}:{self._port(i)}" for i in range(self.options.clusters)]

    def _port(self, cluster: int) -> int:
        return self.options.port + cluster

    def _router_seen_by_instances(self, cluster: int) -> str:
        if self.options.lab:
            from prfaas.lab.placement import router_url

            return router_url(self._port(cluster), self._lab_topology(), cluster=cluster)
        return self.urls[cluster]

    def _lab_topology(self) -> Topology | None:
        """The lab ``--lab`` places roles in: the numbered one of ``lab_index`` (benchmarks run beside the default
        lab), else None, the default lab."""
        index = self.options.lab_index
        return None if index is None else Topology.numbered(index, self.options.clusters)

    def start(self) -> None:
        o = self.options
        if o.lab:
            from prfaas.lab.placement import require_lab

            require_lab(self._lab_topology(), clusters=o.clusters)
        else:
            for i in range(o.clusters):
                _check_free(o.host, self._port(i))
        for i in range(o.clusters):  # every router first: their ports are taken before other roles dial out
            self._spawn_router(i)
        for i in range(o.clusters):
            self._spawn_cluster(i)
        routers = [a for i in range(o.clusters) for a in ("--router", self._router_seen_by_instances(i))]
        for i in range(o.prefill):  # the pool, shared by every cluster
            self._spawn(["prefill", "--instance-id", f"prefill-{i}", "--datacenter", "dc-a", *self._model()],
                        routers)

    def _spawn_router(self, i: int) -> None:
        """Cluster ``i``'s router, in its own datacenter."""
        o = self.options
        router = ["router", "--host", o.host, "--port", str(self._port(i)), "--mode", o.mode]
        self._spawn(router + (["--cluster", self.cluster_names[i]] if o.clusters > 1 else []), cluster=i)

    def _spawn_cluster(self, i: int) -> None:
        """Cluster ``i``'s relay (relay mode) and decode instances, in its own datacenter (beside its router)."""
        o = self.options
        many = o.clusters > 1
        dc, at = (cluster_datacenter(i), ["--router", self._router_seen_by_instances(i)])
        if o.mode == "relay":
            self._spawn(["relay", "--instance-id", f"relay-{i}", "--datacenter", dc], at, cluster=i)
        for j in range(o.decode):
            name = f"decode-{i}-{j}" if many else f"decode-{j}"
            self._spawn(["decode", "--instance-id", name, "--datacenter", dc, *self._model()], at, cluster=i)

    def _model(self) -> list[str]:
        o = self.options
        return ["--model", o.model, "--dtype", o.dtype, "--engine", o.engine, "--device", o.device]

    def _spawn(self, args: list[str], routers: list[str] | None = None, cluster: int = 0) -> None:
        """One role's process (``routers``: its ``--router`` flags; a router has none). ``cluster``: where
        ``--lab`` places a router, relay or decode instance (the prefill pool is in dc-a)."""
        o = self.options
        common = list(routers or [])
        path = self.configs.get(args[0]) or self.tls_configs.get(args[0], o.config or "")
        if path:
            common += ["--config", path]
        if o.offload_threshold is not None:
            common += ["--offload-threshold", str(o.offload_threshold)]
        cmd = [sys.executable, "-m", "prfaas", "serve", *args, *common]
        if o.lab:
            from prfaas.lab.placement import place

            cmd = place(args[0], cmd, self._lab_topology(), cluster=cluster)
        where = f" {cluster}" if o.clusters > 1 and args[0] == "router" else ""
        name = f"router{where}" if args[0] == "router" else f"{args[0]} {args[2]}"  # args[2]: the --instance-id
        self.roles.append(Role(name, lambda: self._popen(cmd), time.monotonic))

    def _pool_configs(self) -> tuple[list[str], dict[str, str]]:
        """The clusters' names, and each role's config file with their entries (in ``pool_dir``, mode 0600: it
        holds the keys)."""
        assert self.pool_dir is not None
        o, out = self.options, {}
        base_of = {role: self.tls_configs.get(role, o.config or "") for role in ("router", "prefill", "decode",
                                                                               "relay")}
        clusters = pool_clusters(_read(o.config), o.clusters)
        for role, base in base_of.items():
            path = Path(self.pool_dir) / f"config-{role}.yaml"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump({**_read(base), "clusters": clusters}, f)
            out[role] = str(path)
        return list(clusters), out

    def _popen(self, cmd: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.options.log_file, "ab") if self.options.log_file else None  # noqa: SIM115 (closed below)
        try:
            return subprocess.Popen(cmd, preexec_fn=die_with_parent, stdout=out, stderr=out,
                                    env=shared_cores_env(os.environ, self.options.engine))
        finally:
            if out:
                out.close()  # the child holds its own descriptor

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            dead = [r for r in self.roles if r.process.poll() is not None]
            if dead:
                raise PrfaasError(f"a role exited during start-up: {dead[0].name} (exit {dead[0].process.returncode})")
            if all(self._healthy(url) for url in self.urls):
                return
            time.sleep(0.25)
        raise PrfaasError(f"the deployment was not healthy within {self.options.startup_timeout_s:.0f} s")

    def _healthy(self, url: str) -> bool:
        """Whether the router at ``url`` serves with every instance started for it registered and healthy (its
        ``/health`` is ready with one of each role; ``prfaas is up`` waits for all of them) and no tokenizer of
        its own still loading."""
        o = self.options
        wanted = {"prefill": o.prefill, "decode": o.decode, **({"relay": 1} if o.mode == "relay" else {})}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            verify = local.ca_client_context(self.tls_configs["ca"]) if self.tls_dir else True
            reply = httpx.get(f"{url}/health", timeout=2.0, verify=verify)
            body = reply.json()
            healthy = dict(body.get("healthy") or {})
            return (reply.status_code == 200 and all(int(healthy.get(r, 0)) >= n for r, n in wanted.items())
                    and not body.get("tokenizers_loading"))
        return False

    def supervise(self, stopping: Callable[[], bool]) -> None:
        """Restart failed roles until ``stopping()`` or the router is gone for good (a clean exit: drained; or
        given up). Returns without starting anything once ``stopping()`` is true."""
        router = self.roles[0]
        while not stopping() and not router.done:
            self.supervisor.check()
            time.sleep(SUPERVISE_INTERVAL_S)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)  # stop now: SIGTERM would drain each instance first
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(timeout=STOP_GRACE_S)
            if child.poll() is None:
                child.kill()
                child.wait()
        self.roles.clear()
        for directory in (self.tls_dir, self.pool_dir):
            if directory:
                shutil.rmtree(directory, ignore_errors=True)


def cluster_datacenter(i: int) -> str:
    """Cluster ``i``'s datacenter label: dc-b, dc-c, … (dc-a holds the prefill pool)."""
    return f"dc-{chr(ord('b') + i)}"


def pool_clusters(config: dict[str, Any], n: int) -> dict[str, Any]:
    """``n`` client clusters: the config's first ``n`` entries of ``clusters`` when it has that many, else
    ``cluster-<i>`` each with a fresh random key and share 1; each labelled with its datacenter."""
    given = dict(config.get("clusters") or {})
    if len(given) >= n:
        names = list(given)[:n]
        return {name: {"datacenter": cluster_datacenter(i), **dict(given[name] or {})} for i, name in enumerate(names)}
    return {f"cluster-{i}": {"key": secrets.token_urlsafe(24), "share": 1, "datacenter": cluster_datacenter(i)}
            for i in range(n)}


SHARED_SPIN = "10000"  # libgomp's spin-wait, in iterations, for engine processes that share the cores


def shared_cores_env(environ: Mapping[str, str], engine: str) -> dict[str, str] | None:
    """The environment of ``prfaas up``'s children: every engine process of the deployment shares this machine's
    cores, so each one's OpenMP workers spin-wait ``SHARED_SPIN`` iterations between two operators, not libgomp's
    default, on which a busy engine's workers spin on cores another busy engine needs (docs/engine.md, Threads).
    None (the environment as it is): vLLM's engines, or a spin policy the caller set."""
    if engine != "prfaas" or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & environ.keys():
        return None
    return {**environ, "GOMP_SPINCOUNT": SHARED_SPIN}


def _read(path: str | None) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text()) if path else None
    return dict(data or {})


def _say(line: str) -> None:
    print(f"prfaas up: {line}", flush=True)


def _check_free(host: str, port: int) -> None:
    """``InvalidRequest`` now, rather than a router that dies after the other roles have started."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise InvalidRequest(f"the router cannot listen on {host}:{port} ({exc.strerror}): choose another --port"
                                 ) from exc


def run_up(options: UpOptions) -> None:
    deployment = Deployment(options)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        deployment.start()
        deployment.wait_ready()
        print(f"prfaas is up: {deployment.url}/v1 (mode {options.mode}, model {options.model}, "
              f"{options.prefill} prefill, {options.decode} decode"
              f"{', mutual TLS, CA ' + deployment.tls_configs['ca'] if options.tls else ''})", flush=True)
        for name, url in zip(deployment.cluster_names, deployment.urls, strict=False):
            own = f"router, {'relay, ' if options.mode == 'relay' else ''}{options.decode} decode"
            print(f"prfaas cluster {name}: {url}/v1 (its {own}; the pool's {options.prefill} prefill shared)",
                  flush=True)
        deployment.supervise(lambda: stop["now"])
    finally:
        restarts = deployment.supervisor.restarts()
        deployment.stop()
        counts = ", ".join(f"{name} {n}" for name, n in restarts.items())
        print(f"prfaas stopped: every process has exited{'; restarts: ' + counts if counts else ''}", flush=True)
    os._exit(0) if stop["now"] else sys.exit(1)

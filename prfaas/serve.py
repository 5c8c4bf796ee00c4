"""``prfaas serve router|prefill|decode|relay`` (one role, for real hosts) and ``prfaas up`` (all, here).

Above ``prfaas.services`` and ``prfaas.vllm``: it picks each instance's engine, the embedded one
(``prfaas.services.roles.build``) or a child vLLM server (``_vllm_role``), so neither package imports the other's
role wiring. Roles import inside the commands, so that ``prfaas --help`` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from prfaas.config import Config, load_config

if TYPE_CHECKING:
    from prfaas.services.instance import InstanceOptions
    from prfaas.services.roles import RoleServer

serve_app = typer.Typer(help="Run one role of a deployment.", no_args_is_help=True)

CONFIG = typer.Option(None, "--config", help="YAML config (default: $PRFAAS_CONFIG)")
THRESHOLD = typer.Option(None, "--offload-threshold", help="prompts longer than this many tokens go to remote prefill "
                         "(default: the config's offload_threshold_tokens, 256 when unset)")
ROUTER = typer.Option(..., "--router", help="the router's URL, e.g. http://10.0.0.1:8000; repeat it to register with "
                      "several routers (a prefill pool serving several client clusters, docs/pool.md)")
HOST = typer.Option("127.0.0.1", "--host", help="address to bind")
MODEL = typer.Option("smollm2-135m", "--model", help="built-in name, HF directory or .gguf file")
DTYPE = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16 | auto (bfloat16 where the CPU or GPU "
                     "computes it natively, else float32); every role of a deployment needs the same")


def check_device(value: str) -> str:
    """``--device`` checked before anything starts: the name only (whether torch sees that GPU, the engine says
    when it loads)."""
    if value in ("cpu", "cuda", "auto") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise typer.BadParameter(f"{value!r}: expected cpu, cuda, cuda:N or auto")


DEVICE = typer.Option("cpu", "--device", callback=check_device, help="where the embedded engine runs: cpu | cuda | "
                      "cuda:N | auto (the GPU where torch sees one); KV moves between a GPU and a CPU instance of "
                      "the same dtype")
ENGINE = typer.Option("prfaas", "--engine", help="prfaas (the embedded engine) | vllm (a vLLM server as this "
                      "instance's engine, from .venv-vllm: `make vllm`; docs/vllm.md)")


def _config(path: str | None, threshold: int | None, datacenter: str | None = None,
            cluster: str | None = None) -> Config:
    from prfaas.security.apikeys import check_config_file

    config = load_config(path, offload_threshold_tokens=threshold, datacenter=datacenter, cluster=cluster)
    check_config_file(path, config)
    return config


@serve_app.command()
def router(host: str = HOST, port: int = typer.Option(8000, "--port", help="the OpenAI API's port"),
           mode: str = typer.Option("relay", "--mode", help="relay | direct"),
           config: str | None = CONFIG, offload_threshold: int | None = THRESHOLD,
           insecure: bool = typer.Option(False, "--insecure", help="serve a non-loopback address without API keys "
                                         "or TLS"),
           cluster: str | None = typer.Option(None, "--cluster", help="this router's client cluster of a shared "
                                              "prefill pool: an entry of the config's clusters (docs/pool.md)")
           ) -> None:
    """The OpenAI-compatible router (datacenter B)."""
    from prfaas.services.router import run_router

    run_router(_config(config, offload_threshold, cluster=cluster), host, port, mode, insecure=insecure)


def _instance(role: str, router_urls: list[str], instance_id: str, datacenter: str, model: str, dtype: str, host: str,
              port: int, kv_port: int, config: str | None, offload_threshold: int | None,
              advertise_kv: str = "", engine: str = "prfaas", device: str = "cpu") -> None:
    from prfaas.services.instance import InstanceOptions
    from prfaas.services.roles import run_role

    options = InstanceOptions(role=role, instance_id=instance_id or f"{role}-{port or 'auto'}",
                              router_url=router_urls[0], routers=tuple(router_urls[1:]), host=host, port=port,
                              kv_port=kv_port, model=model, dtype=dtype, advertise_kv=advertise_kv, engine=engine,
                              device=device)
    run_role(options, _config(config, offload_threshold, datacenter or None), _build)


def _build(options: InstanceOptions, config: Config) -> RoleServer:
    from prfaas.services import roles

    if options.engine == "vllm" and options.role != "relay":
        return _vllm_role(options, config)
    return roles.build(options, config)


def _vllm_role(options: InstanceOptions, config: Config) -> RoleServer:
    """The role on a child vLLM server (``prfaas.vllm.serving``): no store here (the connector's is inside vLLM),
    the same routes."""
    from prfaas.errors import InvalidRequest
    from prfaas.services.instance import Instance
    from prfaas.services.roles import DecodeServer, PrefillServer
    from prfaas.vllm import serving

    if options.role not in ("prefill", "decode"):
        raise ValueError(f"unknown role {options.role!r}")
    if options.device != "cpu":
        raise InvalidRequest(f"--device {options.device} is for the embedded engine; a vLLM instance runs where its "
                             "own build does (.venv-vllm holds vLLM's CPU build)")
    core = Instance(options, config, with_store=False)
    try:
        backend = serving.start(core)
    except BaseException:
        core.close()
        raise
    if isinstance(backend, serving.VllmPrefill):
        return PrefillServer(core, backend)
    return DecodeServer(core, backend)


def _role_command(role: str, default_dc: str, help_text: str) -> None:
    def command(router_url: list[str] = ROUTER,
                instance_id: str = typer.Option("", "--instance-id", help=f"this instance's id in the router's "
                                                f"registry (default: {role}-PORT)"),
                datacenter: str = typer.Option(default_dc, "--datacenter", help="the datacenter label it registers "
                                               "with (placement and data residency)"), model: str = MODEL,
                dtype: str = DTYPE, host: str = HOST,
                port: int = typer.Option(0, "--port", help="HTTP control port (0: any free port)"),
                kv_port: int = typer.Option(0, "--kv-port", help="KV data port (0: any free port)"),
                advertise_kv: str = typer.Option("", "--advertise-kv", help="HOST:PORT other roles dial for the KV "
                                                 "data port, when it is reached through NAT or a load balancer"),
                config: str | None = CONFIG, offload_threshold: int | None = THRESHOLD,
                engine: str = ENGINE, device: str = DEVICE) -> None:
        _instance(role, router_url, instance_id, datacenter, model, dtype, host, port, kv_port, config,
                  offload_threshold, advertise_kv, engine, device)

    command.__doc__ = help_text
    serve_app.command(name=role)(command)


_role_command("prefill", "dc-a", "A prefill instance (datacenter A): prompt → KV blob + first token.")
_role_command("decode", "dc-b", "A decode instance (datacenter B): pulls KV, restores it, streams tokens.")
_role_command("relay", "dc-b", "A relay (datacenter B): holds KV blobs between prefill and decode.")


def up(model: str = MODEL, mode: str = typer.Option("relay", "--mode", help="relay | direct"),
       port: int = typer.Option(8000, "--port", help="the router's port (the other roles take free ports)"),
       prefill: int = typer.Option(1, "--prefill", min=1, help="prefill instances"),
       decode: int = typer.Option(1, "--decode", min=1, help="decode instances"),
       offload_threshold: int | None = THRESHOLD,
       config: str | None = CONFIG, dtype: str = DTYPE, engine: str = ENGINE, device: str = DEVICE,
       lab: bool = typer.Option(False, "--lab", help="prefill in dc-a; router, relay, decode in dc-b "
                                "(`prfaas lab up` first)"),
       lab_index: int | None = typer.Option(None, "--lab-index", min=0, help="with --lab: the numbered lab of "
                                            "`Topology.numbered(N)` (namespaces pfl<N>-*, as benchmarks build) "
                                            "instead of the default one"),
       tls: bool = typer.Option(False, "--tls", help="mutual TLS 1.3 everywhere, with certificates made in a "
                                "temporary directory"),
       max_restarts: int = typer.Option(10, "--max-restarts", min=0, help="a role that fails is restarted with "
                                        "back-off; give up on it after this many failures in a row (0: never "
                                        "restart)"),
       clusters: int = typer.Option(1, "--clusters", min=1, help="client clusters sharing one prefill pool, each "
                                    "its own router (on --port + i), relay and decode (docs/pool.md)")) -> None:
    """Run a whole deployment on this machine (each role its own process on 127.0.0.1) until SIGINT/SIGTERM."""
    from prfaas.services.up import UpOptions, run_up

    load_config(config)  # fail fast on a bad file, before any process starts
    if engine == "vllm" and device != "cpu":
        raise typer.BadParameter(f"--device {device} is for the embedded engine; a vLLM instance runs where its own "
                                 "build does (.venv-vllm holds vLLM's CPU build)")
    run_up(UpOptions(model=model, mode=mode, port=port, prefill=prefill, decode=decode,
                     offload_threshold=offload_threshold, config=config, dtype=dtype, engine=engine,
                     device=device, lab=lab, lab_index=lab_index, tls=tls, max_restarts=max_restarts,
                     clusters=clusters))

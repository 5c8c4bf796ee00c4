"""``prfaas certs init DIR``, ``prfaas certs issue`` and ``prfaas certs revoke DIR NAME``: the private CA, per-role
certificates and the revocation list."""

from __future__ import annotations

import typer

app = typer.Typer(help="Private CA and per-role certificates for mutual TLS.", no_args_is_help=True)


@app.command()
def init(directory: str = typer.Argument(..., help="where to write ca.pem, ca.key and <role>.pem/.key"),
         days: int = typer.Option(365, "--days", help="validity of the role certificates")) -> None:
    """A new CA and one certificate per role (router, prefill, decode, relay); keys are 0600."""
    from prfaas.security import certs

    for name, path in certs.init(directory, days=days).items():
        typer.echo(f"{name}: {path}")


@app.command()
def issue(role: str = typer.Option(..., "--role", help="router | prefill | decode | relay"),
          name: str = typer.Option(..., "--name", help="instance name (the file is NAME.pem / NAME.key)"),
          directory: str = typer.Option(..., "--dir", help="the directory of `prfaas certs init`"),
          host: list[str] = typer.Option([], "--host", help="extra DNS name or IP the instance serves on"),
          days: int = typer.Option(365, "--days", min=1, help="validity of the certificate")) -> None:
    """One more certificate, e.g. for a new prefill host: SAN spiffe://prfaas/ROLE/NAME plus --host names."""
    from prfaas.security import certs

    typer.echo(str(certs.issue(directory, role, name, hosts=host, days=days)))


@app.command()
def revoke(directory: str = typer.Argument(..., help="the directory of `prfaas certs init` (holds ca.key)"),
           name: str = typer.Argument(..., help="the certificate to revoke: NAME.pem in DIR"),
           days: int = typer.Option(30, "--days", help="validity of the list; re-run `revoke` before it lapses")
           ) -> None:
    """Add NAME's certificate to DIR/crl.pem (signed by the CA). Copy crl.pem to every host whose tls.crl names
    it: each process re-reads the list within 5 s and refuses that certificate at its next handshake (no
    restart; connections already open stay up)."""
    from prfaas.security import certs

    path = certs.revoke(directory, name, days=days)
    typer.echo(f"{path}: {len(certs.revoked_list(directory))} revoked")

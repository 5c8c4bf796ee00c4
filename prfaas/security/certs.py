"""``prfaas certs``: a private CA and per-role certificates, made with ``cryptography``.

Every certificate names its role in a SAN URI ``spiffe://prfaas/<role>/<name>`` (``prfaas.security.identity``
reads it back), is valid for client and server use, and covers ``localhost``/``127.0.0.1`` plus the ``hosts``
given. Private keys are written with mode 0600 (created so, never widened); files are PEM. ``revoke`` keeps the
CA's certificate revocation list (``crl.pem``, signed by the CA). Failures: an unknown role, a missing CA or
certificate raise ``InvalidRequest``; file errors surface as ``OSError``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from prfaas.errors import InvalidRequest

ROLES = ("router", "prefill", "decode", "relay")
CA_CERT, CA_KEY, CRL = "ca.pem", "ca.key", "crl.pem"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


def spiffe_uri(role: str, name: str) -> str:
    return f"spiffe://prfaas/{role}/{name}"


def init(directory: str | os.PathLike[str], days: int = 365) -> dict[str, Path]:
    """A new CA in ``directory`` and one certificate per role (``<role>.pem``/``<role>.key``); returns the paths
    by name (``ca`` and each role). Refuses to overwrite an existing CA (``InvalidRequest``)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if (root / CA_KEY).exists():
        raise InvalidRequest(f"{root / CA_KEY} exists; use `prfaas certs issue` to add certificates")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prfaas CA")])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days * 5))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_key(root / CA_KEY, key)
    (root / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths = {"ca": root / CA_CERT}
    for role in ROLES:
        paths[role] = issue(root, role, role, days=days)
    return paths


def issue(directory: str | os.PathLike[str], role: str, name: str, *, hosts: Sequence[str] = (),
          days: int = 365, not_before: dt.datetime | None = None) -> Path:
    """A certificate for instance ``name`` of ``role``, signed by the CA in ``directory``; writes ``<name>.pem``
    and ``<name>.key`` (0600) there and returns the certificate's path. ``not_before``/``days`` set validity (tests
    make expired certificates with them)."""
    if role not in ROLES:
        raise InvalidRequest(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    root = Path(directory)
    if not (root / CA_KEY).exists():
        raise InvalidRequest(f"no CA in {root}; run `prfaas certs init {root}` first")
    ca_key = serialization.load_pem_private_key((root / CA_KEY).read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((root / CA_CERT).read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - dt.timedelta(minutes=5)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(_names(role, name, hosts)), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(_issuer_id(ca_key), critical=False)  # peers pick the right CA even if two share a name
            .sign(ca_key, hashes.SHA256()))
    _write_key(root / f"{name}.key", key)
    path = root / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def revoke(directory: str | os.PathLike[str], name: str, days: int = 30) -> Path:
    """Add certificate ``<name>.pem`` to the CA's revocation list ``crl.pem`` (created or re-signed with the CA
    key, valid for ``days``: re-run before it lapses, since an expired list fails every handshake). Returns its
    path, written whole (a new file renamed over the old). Peers configured with ``tls.crl`` re-read the list
    within ``tls.CRL_CHECK_S`` seconds of a change and refuse the certificate at their next handshake."""
    root = Path(directory)
    if not (root / CA_KEY).exists():
        raise InvalidRequest(f"no CA in {root}; revoke where `prfaas certs init` ran")
    if not (root / f"{name}.pem").exists():
        raise InvalidRequest(f"no certificate {root / f'{name}.pem'} to revoke")
    ca_key = serialization.load_pem_private_key((root / CA_KEY).read_bytes(), password=None)
    ca = x509.load_pem_x509_certificate((root / CA_CERT).read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    serial = x509.load_pem_x509_certificate((root / f"{name}.pem").read_bytes()).serial_number
    now = _crl_time(root)
    entries, number = revoked_list(root), _crl_number(root) + 1
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject).last_update(now)
               .next_update(now + dt.timedelta(days=days)).add_extension(x509.CRLNumber(number), critical=False)
               .add_extension(_issuer_id(ca_key), critical=False))
    if all(entry.serial_number != serial for entry in entries):  # revoking twice keeps the first date
        entries.append(x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    for entry in entries:
        builder = builder.add_revoked_certificate(entry)
    path, part = root / CRL, root / f".{CRL}.part"
    part.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    os.replace(part, path)  # a process re-reading the list never sees half of it
    return path


def revoked_list(directory: str | os.PathLike[str]) -> list[x509.RevokedCertificate]:
    """The entries of ``crl.pem`` in ``directory`` (none if there is no list yet)."""
    path = Path(directory) / CRL
    return list(x509.load_pem_x509_crl(path.read_bytes())) if path.exists() else []


def _crl_time(root: Path) -> dt.datetime:
    """A ``lastUpdate`` for a new list: a second past the current list's (a peer holding both lists checks against
    the one updated last), and a whole second in the past (OpenSSL compares at second resolution and takes a list
    dated this very second as not valid yet, so the old list would stay in force meanwhile). Waits up to two
    seconds."""
    stamp = _now().replace(microsecond=0) - dt.timedelta(seconds=1)
    if (root / CRL).exists():
        after = x509.load_pem_x509_crl((root / CRL).read_bytes()).last_update_utc + dt.timedelta(seconds=1)
        if stamp < after:
            time.sleep(max(0.0, (after + dt.timedelta(seconds=1) - _now()).total_seconds()))
            stamp = after
    return stamp


def _crl_number(root: Path) -> int:
    if not (root / CRL).exists():
        return 0
    crl = x509.load_pem_x509_crl((root / CRL).read_bytes())
    try:
        return int(crl.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


def _issuer_id(ca_key: ec.EllipticCurvePrivateKey) -> x509.AuthorityKeyIdentifier:
    return x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())


def _names(role: str, name: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_uri(role, name))]
    for host in dict.fromkeys([*DEFAULT_HOSTS, *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Created with mode 0600 (the umask can only narrow it); an existing file is narrowed before writing."""
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)

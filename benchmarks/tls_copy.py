"""The most a Python program can move through TLS 1.3 on a path: a bare copy, no protocol, no checksums.

    tls_copy.py send LIB HOST PORT SIZE CERT KEY   serves one connection; prints "listening PORT", then its CPU seconds
    tls_copy.py recv LIB HOST PORT SIZE CA         prints "SECONDS CPU_SECONDS" for SIZE bytes received

``LIB`` is ``stdlib`` (Python's ``ssl`` module on the system's OpenSSL, what prfaas uses) or ``pyopenssl``
(pyOpenSSL on the newer OpenSSL that ships inside ``cryptography``'s wheels; run with the interpreter of the
benchmark's own pyOpenSSL virtualenv). The sender hands 4 MiB slices of one buffer to ``sendall``; the receiver
reads straight into one preallocated buffer, page-touched before the clock starts: ``recv_into`` with ``stdlib``,
and with ``pyopenssl`` ``SSL_read`` itself through pyOpenSSL's cffi binding (its ``recv_into`` copies every record
through a temporary buffer), and pyOpenSSL's sender writes each slice with one ``SSL_write`` (no partial writes),
so both are the fastest each library allows. Blocking sockets with ``TCP_NODELAY`` (as prfaas), one stream,
AES-256-GCM (OpenSSL's first TLS 1.3 choice). ``benchmarks/transport.py`` runs it beside iperf3 and prfaas.
"""

from __future__ import annotations

import resource
import socket
import ssl
import sys
import time
from typing import Any

SLICE = 4 << 20


def cpu_seconds() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def stdlib_conn(sock: socket.socket, server: bool, cert: str, key: str) -> Any:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as prfaas: no Nagle wait on a record's tail
    if server:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
    else:
        ctx = ssl.create_default_context(cafile=cert)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx.wrap_socket(sock, server_side=server, server_hostname=None if server else sock.getpeername()[0])


def pyopenssl_conn(sock: socket.socket, server: bool, cert: str, key: str) -> Any:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    from OpenSSL import SSL
    from OpenSSL._util import lib

    ctx = SSL.Context(SSL.TLS_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_3_VERSION)
    ctx.clear_mode(lib.SSL_MODE_ENABLE_PARTIAL_WRITE)  # one SSL_write per slice, as Python's ssl module does
    if server:
        ctx.use_certificate_file(cert)
        ctx.use_privatekey_file(key)
    else:
        ctx.load_verify_locations(cert)
        ctx.set_verify(SSL.VERIFY_PEER)
    conn = SSL.Connection(ctx, sock)
    if server:
        conn.set_accept_state()
    else:
        conn.set_connect_state()
    conn.do_handshake()
    return conn


def pyopenssl_reader(conn: Any) -> Any:
    from OpenSSL._util import ffi, lib

    def read(view: memoryview) -> int:
        n = lib.SSL_read(conn._ssl, ffi.from_buffer(view), len(view))
        if n <= 0:
            raise SystemExit(f"SSL_read failed: {lib.SSL_get_error(conn._ssl, n)}")
        return int(n)
    return read


def send(lib: str, host: str, port: int, size: int, cert: str, key: str) -> None:
    srv = socket.create_server((host, port))
    print("listening", srv.getsockname()[1], flush=True)
    raw, _ = srv.accept()
    conn = (stdlib_conn if lib == "stdlib" else pyopenssl_conn)(raw, True, cert, key)
    view, left, start = memoryview(bytearray(SLICE)), size, cpu_seconds()
    while left:
        n = min(left, SLICE)
        conn.sendall(view[:n])
        left -= n
    print(cpu_seconds() - start, flush=True)
    sys.stdin.read()  # the receiver has counted every byte when the benchmark closes our stdin
    raw.close()


def recv(lib: str, host: str, port: int, size: int, ca: str) -> None:
    raw = socket.create_connection((host, port))
    conn = (stdlib_conn if lib == "stdlib" else pyopenssl_conn)(raw, False, ca, "")
    read = conn.recv_into if lib == "stdlib" else pyopenssl_reader(conn)
    buf = memoryview(bytearray(size))
    for i in range(0, size, 4096):
        buf[i] = 0
    start, cpu, got = time.perf_counter(), cpu_seconds(), 0
    while got < size:
        n = read(buf[got:got + SLICE])
        if not n:
            raise SystemExit("sender closed early")
        got += n
    print(time.perf_counter() - start, cpu_seconds() - cpu)


if __name__ == "__main__":
    role, which, addr, port_s, size_s = sys.argv[1:6]
    if role == "send":
        send(which, addr, int(port_s), int(size_s), sys.argv[6], sys.argv[7])
    else:
        recv(which, addr, int(port_s), int(size_s), sys.argv[6])

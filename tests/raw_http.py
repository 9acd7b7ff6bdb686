"""Bytes sent to a server as they are (no client would send them malformed), its answer read whole."""

from __future__ import annotations

import socket
import ssl


def exchange(port: int, request: bytes, tls: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    """Send `request` to 127.0.0.1:`port` (through `tls` where given) and read until the server closes:
    the answer's status, headers and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        connection = plain if tls is None else tls.wrap_socket(plain, server_hostname="localhost")
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), dict(line.split(": ", 1) for line in lines[1:]), body

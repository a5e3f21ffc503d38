"""Free TCP ports for the rendezvous stores and servers megarl starts."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on every address of `host`'s family (another process may still take it before it
    is used). The kernel picks it for the wildcard address: a c10d TCPStore listens on all addresses, so a port that
    is free on `host` alone may already be taken on loopback by another process (EADDRINUSE at rendezvous)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind(("::" if family == socket.AF_INET6 else "", 0))
        return sock.getsockname()[1]

"""A fake network for media-fetch tests: made-up host names resolve to chosen addresses, and the
one "public" address is served by a local HTTP server. Nothing leaves the loopback interface:
every other connection attempt is recorded and refused."""

from __future__ import annotations

import ipaddress
import socket
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from glmflash.multimodal import fetch

PUBLIC_HOST, PUBLIC_ADDRESS = "media.example", "93.184.216.34"
HOSTS = {PUBLIC_HOST: PUBLIC_ADDRESS, "intranet.example": "10.0.0.7",
         "metadata.example": "169.254.169.254", "rebind.example": "::ffff:127.0.0.1",
         "shared.example": "100.64.1.2"}


class _Redirector(BaseHTTPRequestHandler):
    """GET /to?<url> answers a 302 to <url>; GET /tiny.png answers a 1x1 PNG."""

    png = b""

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook
        if self.path.startswith("/to?"):
            self.send_response(302)
            self.send_header("Location", self.path[4:])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args) -> None:
        pass


class FakeNet:
    def __init__(self, port: int) -> None:
        self.port = port
        self.refused: list[tuple] = []

    def getaddrinfo(self, real, host, port, *args, **kwargs):
        if host in HOSTS:
            address = HOSTS[host]
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sockaddr = (address, port, 0, 0) if family == socket.AF_INET6 else (address, port)
            return [(family, socket.SOCK_STREAM, 6, "", sockaddr)]
        if host == "localhost" or _is_literal(host):
            return real(host, port, *args, **kwargs)
        # No DNS query ever leaves the machine.
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    def create_connection(self, real, address, *args, **kwargs):
        if address[0] == PUBLIC_ADDRESS:
            return real(("127.0.0.1", self.port), *args, **kwargs)
        if address[0] in ("127.0.0.1", "::1", "localhost"):
            return real(address, *args, **kwargs)
        self.refused.append(address)
        raise ConnectionRefusedError("the fake network reaches no other address")


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@pytest.fixture
def fake_net(monkeypatch, tmp_path):
    from tests.multimodal.conftest import random_image

    image = tmp_path / "tiny.png"
    random_image(0, 16, 16).save(image)
    handler = type("Handler", (_Redirector,), {"png": image.read_bytes()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    net = FakeNet(httpd.server_address[1])
    real_resolve, real_connect = socket.getaddrinfo, socket.create_connection
    monkeypatch.setattr(fetch.socket, "getaddrinfo", partial(net.getaddrinfo, real_resolve))
    monkeypatch.setattr(fetch.socket, "create_connection",
                        partial(net.create_connection, real_connect))
    yield net
    httpd.shutdown()
    httpd.server_close()

"""http(s) media fetching that cannot be turned against the server's own network.

Every hop (the URL and each redirect) is checked before any connection: the scheme is http or
https, the host is in `allowed_domains` when that is set, and every address the host resolves to
is public (not loopback, private, link-local - cloud metadata at 169.254.169.254 included -,
shared, multicast, reserved or unspecified; IPv4 inside IPv6 is unwrapped) unless
`allow_private` is set. The connection then goes to the checked address itself, so a second DNS
answer cannot swap it (DNS rebinding); TLS still verifies the certificate against the host name.
Failures reach the client as a short message without the internal details (logged instead).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 5
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchError(ValueError):
    """A media URL that is refused or cannot be fetched; the message is safe to show a client."""


@dataclass(frozen=True)
class UrlPolicy:
    allowed_domains: frozenset[str] | None = None
    """Host names media may come from (exact, case-insensitive); None: any public host."""
    allow_private: bool = False
    """Let hosts resolve to loopback, private and link-local addresses (trusted networks only)."""

    @classmethod
    def create(cls, allowed_domains: list[str] | tuple[str, ...] | None = None,
               allow_private: bool = False) -> UrlPolicy:
        if isinstance(allowed_domains, str):  # one host, not its characters
            allowed_domains = [allowed_domains]
        domains = None if allowed_domains is None else \
            frozenset(d.strip().lower().rstrip(".") for d in allowed_domains)
        return cls(domains, allow_private)


def is_public(address: IpAddress) -> bool:
    """Globally routable unicast (IPv4 mapped, 6to4 and NAT64 addresses judged by their IPv4)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or \
            (ipaddress.IPv4Address(int(address) & 0xFFFFFFFF) if address in _NAT64 else None)
        if embedded is not None:
            return is_public(embedded)
    return address.is_global and not (address.is_multicast or address.is_reserved)


def checked_address(url: str, policy: UrlPolicy) -> tuple[urllib.parse.SplitResult, str]:
    """The URL's parts and the address to connect to, or FetchError if policy refuses it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"media URLs must be http(s) with a host, got {_short(url)}")
    host = parts.hostname.lower().rstrip(".")
    if policy.allowed_domains is not None and host not in policy.allowed_domains:
        raise FetchError(f"media host {host!r} is not in this server's allowed media domains")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError, UnicodeError) as exc:
        logger.info("media host %r does not resolve: %s", host, exc)
        raise FetchError(f"media host {host!r} could not be resolved") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not policy.allow_private and not all(is_public(a) for a in addresses):
        logger.warning("refused media URL %s: %s resolves to %s", _short(url), host,
                       ", ".join(map(str, addresses)))
        raise FetchError(f"media host {host!r} is not a public address; this server does not "
                         "fetch from private networks")
    return parts, str(addresses[0])


def http_get(url: str, *, max_bytes: int, timeout_s: float, policy: UrlPolicy) -> bytes:
    """The body of `url`, following at most MAX_REDIRECTS redirects, each one checked."""
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        parts, address = checked_address(url, policy)
        status, location, body = _request(parts, address, max_bytes, deadline, timeout_s)
        if status not in _REDIRECTS:
            if status != 200:
                raise FetchError(f"media URL {_short(url)} answered HTTP {status}")
            return body
        if not location:
            raise FetchError(f"media URL {_short(url)} redirected without a location")
        url = urllib.parse.urljoin(url, location)
    raise FetchError(f"media URL {_short(url)} redirected more than {MAX_REDIRECTS} times")


def _request(parts: urllib.parse.SplitResult, address: str, max_bytes: int, deadline: float,
             timeout_s: float) -> tuple[int, str | None, bytes]:
    connection = _connection(parts, address, deadline)
    path = parts.path or "/"
    try:
        connection.request("GET", f"{path}?{parts.query}" if parts.query else path,
                           headers={"User-Agent": "glmflash", "Accept-Encoding": "identity"})
        response = connection.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        return 200, None, _read_body(response, parts, max_bytes, deadline)
    except TimeoutError:
        raise FetchError(f"media URL {_short(parts.geturl())} timed out after "
                         f"{timeout_s:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        logger.info("media fetch from %s (%s) failed: %r", parts.hostname, address, exc)
        raise FetchError(f"media URL {_short(parts.geturl())} could not be fetched") from None
    finally:
        connection.close()


def _connection(parts: urllib.parse.SplitResult, address: str,
                deadline: float) -> http.client.HTTPConnection:
    """A connection to `address` that still speaks to (and verifies TLS for) the URL's host."""
    timeout = max(0.1, deadline - time.monotonic())
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(parts.hostname, port, timeout=timeout,
                                                 context=ssl.create_default_context())
    else:
        connection = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)

    def connect_to_checked(_address, timeout=None, source_address=None):
        return socket.create_connection((address, port), timeout, source_address)
    connection._create_connection = connect_to_checked
    return connection


def _read_body(response: http.client.HTTPResponse, parts: urllib.parse.SplitResult,
               max_bytes: int, deadline: float) -> bytes:
    length = response.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise FetchError(f"media URL {_short(parts.geturl())}: {length} bytes, over the "
                         f"{max_bytes}-byte limit")
    body = bytearray()
    while chunk := response.read(_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise FetchError(f"media URL {_short(parts.geturl())}: more than the {max_bytes}-byte "
                             "limit")
        if time.monotonic() > deadline:
            raise TimeoutError
    return bytes(body)


def _short(url: str, limit: int = 120) -> str:
    return url if len(url) <= limit else url[:limit] + "..."

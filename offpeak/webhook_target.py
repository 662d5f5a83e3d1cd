"""Where a webhook may go, and one attempt to send it there.

A tenant chooses the URL, so a webhook is a request the server makes on a stranger's behalf: it
must not reach an address inside the network (loopback, private ranges, cloud metadata, the
transition forms of IPv6 that embed one), nor tell the tenant what it found there. The host is
resolved once per attempt, every address is checked, and the connection goes to the checked
address (the name stays in ``Host`` and in TLS's server name), so a name that resolves elsewhere
a moment later (DNS rebinding) changes nothing. An attempt has one deadline for everything and
reads at most ``MAX_READ_BYTES`` of the answer.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx

#: Bytes of a receiver's answer read at most (the status line and headers are apart from it).
MAX_READ_BYTES = 4096
#: Characters of an answer's body kept in the delivery log, for the tenant to see why it failed.
MAX_LOGGED_BODY = 500

#: Every entry of IANA's IPv4 and IPv6 Special-Purpose Address Registries, globally reachable
#: or not (https://www.iana.org/assignments/iana-ipv4-special-registry,
#: .../iana-ipv6-special-registry), plus multicast and the IPv4 ranges reserved for future use.
SPECIAL_PURPOSE = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.31.196.0/24",
        "192.52.193.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "192.175.48.0/24",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        "::/96",
        "::ffff:0:0/96",
        "::ffff:0:0:0/96",
        "64:ff9b::/96",
        "64:ff9b:1::/48",
        "100::/64",
        "2001::/23",
        "2001:db8::/32",
        "2002::/16",
        "2620:4f:8000::/48",
        "3fff::/20",
        "5f00::/16",
        "fc00::/7",
        "fe80::/10",
        "ff00::/8",
    )
)
#: IPv6 prefixes whose last 32 bits are an IPv4 address: IPv4-compatible, IPv4-mapped, SIIT's
#: IPv4-translated and NAT64's well-known prefix.
_EMBEDDING_PREFIXES = (bytes(12), bytes(10) + b"\xff\xff", bytes(8) + b"\xff\xff\0\0")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class TargetRefused(ValueError):
    """An endpoint URL this server will not call; the message says why, never which address a
    name resolved to."""


Resolver = Callable[[str, int], Iterable[str]]


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    found: list[ipaddress.IPv4Address] = []
    if ip.sixtofour is not None:
        found.append(ip.sixtofour)
    if ip.teredo is not None:
        found.extend(ip.teredo)
    if ip.packed[:12] in _EMBEDDING_PREFIXES or ip in _NAT64:
        found.append(ipaddress.IPv4Address(ip.packed[12:]))
    return found


def is_public(address: str) -> bool:
    """Whether ``address`` (IPv4 or IPv6, an optional ``%zone``) is outside every special-purpose
    range, and so is any IPv4 address it embeds."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if any(ip.version == net.version and ip in net for net in SPECIAL_PURPOSE):
        return False
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        return all(is_public(str(inner)) for inner in _embedded_ipv4(ip))
    return True


def check_url(url: str, *, allow_http: bool, allow_private: bool) -> None:
    """The scheme and form of an endpoint URL, without a network look-up (create, update).

    Raises ``TargetRefused``: not ``https://`` (``http://`` too with ``allow_http``), no host,
    credentials in the URL, or a literal non-public address without ``allow_private``.
    """
    parts = urlsplit(url)
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        raise TargetRefused(f"The URL must start with {' or '.join(s + '://' for s in schemes)}.")
    if not parts.hostname:
        raise TargetRefused("The URL has no host.")
    if parts.username or parts.password:
        raise TargetRefused("The URL must not carry a user name or password.")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return
    if not allow_private and not is_public(str(literal)):
        raise TargetRefused(f"{parts.hostname} is not a public address.")


def check_target(
    url: str, *, allow_http: bool, allow_private: bool, resolve: Resolver = _resolve
) -> str:
    """``check_url``, then resolve the host; refuse it when any of its addresses is not public
    (``is_public``), unless ``allow_private``. Returns the address to connect to.

    Raises ``TargetRefused`` (also when the host does not resolve).
    """
    check_url(url, allow_http=allow_http, allow_private=allow_private)
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        addresses = list(resolve(host, parts.port or (443 if parts.scheme == "https" else 80)))
    except (OSError, UnicodeError):
        raise TargetRefused(f"{host} does not resolve.") from None
    if not addresses:
        raise TargetRefused(f"{host} does not resolve.")
    if not allow_private and not all(is_public(a) for a in addresses):
        raise TargetRefused(f"{host} resolves to a non-public address.")
    return addresses[0]


@dataclass(frozen=True)
class Attempt:
    """One delivery attempt: the receiver's status code (``None`` when no answer came), the
    seconds it took and, when it failed, why (``error``, a line of text)."""

    status_code: int | None
    latency_seconds: float
    error: str | None = None

    @property
    def delivered(self) -> bool:
        """A 2xx answer (Standard Webhooks: any other answer, redirects included, is a failure)."""
        return self.status_code is not None and 200 <= self.status_code < 300


def _pinned(url: str, address: str) -> str:
    """``url`` with its host replaced by ``address`` (the port kept)."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))


def send(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout: float,
    allow_http: bool,
    allow_private: bool,
    resolve: Resolver = _resolve,
) -> Attempt:
    """Check ``url`` (``check_target``) and POST ``body`` to the address it resolved to, once,
    without following redirects, within ``timeout`` seconds in all (connect, send, answer);
    reads at most ``MAX_READ_BYTES`` of the answer. Never raises: a refused target, a network
    failure or the deadline is an ``Attempt`` with ``status_code=None``."""
    started = time.perf_counter()
    try:
        address = check_target(
            url, allow_http=allow_http, allow_private=allow_private, resolve=resolve
        )
    except TargetRefused as refused:
        return Attempt(None, 0.0, f"target refused: {refused}")
    host = urlsplit(url).hostname or ""
    port = urlsplit(url).port
    client = httpx.Client(timeout=timeout, follow_redirects=False)
    # The per-operation timeouts cannot bound a receiver that drips bytes: closing the client
    # from a timer ends whatever the attempt is waiting on.
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        client.close()

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        request = client.build_request(
            "POST",
            _pinned(url, address),
            content=body,
            headers={**headers, "host": f"{host}:{port}" if port else host},
            extensions={"sni_hostname": host},
        )
        response = client.send(request, stream=True)
        try:
            kept = b""
            if not 200 <= response.status_code < 300:
                for chunk in response.iter_raw():
                    kept += chunk
                    if len(kept) >= MAX_READ_BYTES:
                        break
        finally:
            response.close()
    except (httpx.HTTPError, OSError, RuntimeError) as exc:
        latency = time.perf_counter() - started
        if expired.is_set():
            return Attempt(None, latency, f"no complete answer within {timeout:g} s")
        return Attempt(None, latency, f"{type(exc).__name__}: {exc}"[:MAX_LOGGED_BODY])
    finally:
        timer.cancel()
        client.close()
    latency = time.perf_counter() - started
    if 200 <= response.status_code < 300:
        return Attempt(response.status_code, latency)
    text = kept[:MAX_READ_BYTES].decode("utf-8", "replace")[:MAX_LOGGED_BODY]
    return Attempt(response.status_code, latency, text or None)

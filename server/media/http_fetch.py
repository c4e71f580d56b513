"""http(s) media URLs fetched without reaching inside the network (vLLM's flags, after
CVE-2025-6242).

* every hop's host must be one of ``--allowed-media-domains`` (exact, case-insensitive)
  when that flag is given;
* every address a host resolves to must be public: a private, loopback, link-local,
  multicast, unspecified or reserved address (IPv4 inside IPv6 unwrapped; any encoding of
  the host, since the check is on what it resolves to) refuses the host, unless
  ``--allow-private-media-urls``. The connection goes to the checked address (a network
  backend under httpcore: no second lookup, so DNS rebinding cannot switch it; TLS still
  checks the name);
* redirects are followed here, at most :data:`MAX_REDIRECTS`, each hop checked as the first;
* the whole fetch (resolution, connects, redirects, body) ends at ``--media-fetch-timeout``;
* no proxy from the environment, at most ``max_bytes`` of body, a 2xx of the right type.

Any failure is a :class:`FetchFailed` whose reason is for the log only: the client's error
must not tell what is behind a URL (status, content type, connect error, timing).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore
import httpx

#: Redirect hops followed after the first request
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: A host as httpx leaves it: a name (IDNA already ASCII) or an IP literal
_HOST = re.compile(rb"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")

#: ``(host, port)`` → the addresses to connect to, already checked (the seam tests replace)
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchFailed(Exception):
    """The fetch failed; ``str(exc)`` says why, for the server's log only."""


class HostNotAllowed(Exception):
    """The URL's host is not in ``--allowed-media-domains`` (the client may be told)."""


@dataclass(frozen=True)
class FetchPolicy:
    """What one fetch may do: the allow-list (``None``: any host), private addresses,
    the total deadline, the body cap, the MIME types taken, the resolver (``None``: DNS,
    then :func:`is_public` on every answer unless ``allow_private``)."""

    allowed_domains: frozenset[str] | None
    allow_private: bool
    timeout_s: float
    max_bytes: int
    mimes: tuple[str, ...]
    resolve: Resolver | None = None


def is_public(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a public unicast address; IPv4 carried in
    IPv6 (mapped, 6to4, Teredo) must be public too."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    inner: list[ipaddress.IPv4Address] = []
    if isinstance(ip, ipaddress.IPv6Address):
        inner = [a for a in (ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())) if a is not None]
    return all(_public(a) for a in (ip, *inner))


def _public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    special = (
        ip.is_private,
        ip.is_loopback,
        ip.is_link_local,
        ip.is_multicast,
        ip.is_unspecified,
        ip.is_reserved,
    )
    return ip.is_global and not any(special)


async def vetted_addresses(host: str, port: int, allow_private: bool) -> list[str]:
    """``host``'s addresses (DNS, or the literal), all public unless ``allow_private``."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise FetchFailed(f"cannot resolve the host ({type(exc).__name__})") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise FetchFailed("the host has no address")
    if not allow_private and not all(is_public(a) for a in addresses):
        raise FetchFailed("the host resolves to a non-public address")
    return addresses


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to the addresses ``resolve`` vetted."""

    def __init__(self, resolve: Resolver) -> None:
        self._resolve = resolve
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        error: Exception = FetchFailed("no address to connect to")
        for address in await self._resolve(host, port):
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.AsyncNetworkStream:
        raise FetchFailed("unix sockets are not fetched")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def checked_url(url: str, allowed_domains: frozenset[str] | None) -> httpx.URL:
    """``url`` parsed; ``ValueError`` when it is not a valid http(s) URL, and
    :class:`HostNotAllowed` when an allow-list is given and its host is not on it."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, UnicodeError) as exc:
        raise ValueError("not a valid URL") from exc
    if parsed.scheme not in ("http", "https") or not _HOST.fullmatch(parsed.raw_host):
        raise ValueError("not a valid http(s) URL")
    if allowed_domains is not None and parsed.host.lower().rstrip(".") not in allowed_domains:
        raise HostNotAllowed(parsed.host)
    return parsed


async def fetch_url(url: str, policy: FetchPolicy) -> tuple[bytes, str]:
    """``url``'s body and its MIME type (``""`` when it declares none) under ``policy``.

    ``ValueError`` (not an http(s) URL), :class:`HostNotAllowed` (a hop off the
    allow-list) or :class:`FetchFailed` (anything else)."""
    resolve = policy.resolve or _default_resolver(policy.allow_private)
    pool = httpcore.AsyncConnectionPool(
        ssl_context=ssl.create_default_context(),
        network_backend=_CheckedBackend(resolve),
        retries=0,
    )
    try:
        async with asyncio.timeout(policy.timeout_s), pool:
            return await _follow(pool, url, policy)
    except TimeoutError as exc:
        raise FetchFailed(f"past the {policy.timeout_s} s deadline") from exc
    except httpcore.TimeoutException as exc:
        raise FetchFailed(f"past the {policy.timeout_s} s deadline") from exc
    except (httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError, OSError) as exc:
        raise FetchFailed(f"{type(exc).__name__}: {exc}") from exc


def _default_resolver(allow_private: bool) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        return await vetted_addresses(host, port, allow_private)

    return resolve


async def _follow(
    pool: httpcore.AsyncConnectionPool, url: str, policy: FetchPolicy
) -> tuple[bytes, str]:
    """GET ``url``, following at most :data:`MAX_REDIRECTS` redirects, each hop checked."""
    timeouts = dict.fromkeys(("connect", "read", "write", "pool"), policy.timeout_s)
    for hop in range(MAX_REDIRECTS + 1):
        target = _hop(url, policy.allowed_domains, hop)
        port = target.port or (443 if target.scheme == "https" else 80)
        request_url = httpcore.URL(
            scheme=target.raw_scheme, host=target.raw_host, port=port, target=target.raw_path
        )
        headers = [(b"Host", target.netloc), (b"Accept", b"*/*"), (b"User-Agent", b"shardserve")]
        async with pool.stream(
            "GET", request_url, headers=headers, extensions={"timeout": timeouts}
        ) as response:
            if response.status in _REDIRECTS:
                location = _header(response, b"location")
                if not location:
                    raise FetchFailed(f"HTTP {response.status} without a Location")
                try:
                    url = str(target.join(location))
                except (httpx.InvalidURL, ValueError, UnicodeError) as exc:
                    raise FetchFailed("a redirect to an invalid URL") from exc
                continue
            if not 200 <= response.status < 300:
                raise FetchFailed(f"HTTP {response.status}")
            mime = _header(response, b"content-type").split(";")[0].strip().lower()
            if mime and mime not in policy.mimes and mime != "application/octet-stream":
                raise FetchFailed(f"served {mime!r}")
            return await _body(response, policy.max_bytes), mime
    raise FetchFailed(f"more than {MAX_REDIRECTS} redirects")


def _hop(url: str, allowed_domains: frozenset[str] | None, hop: int) -> httpx.URL:
    """The first URL's errors are the client's to see; a redirect's are the log's only."""
    if hop == 0:
        return checked_url(url, allowed_domains)
    try:
        return checked_url(url, allowed_domains)
    except HostNotAllowed as exc:
        raise FetchFailed(f"a redirect to {exc}, not in --allowed-media-domains") from exc
    except ValueError as exc:
        raise FetchFailed(f"a redirect to an invalid or non-http(s) URL ({exc})") from exc


def _header(response: httpcore.Response, name: bytes) -> str:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


async def _body(response: httpcore.Response, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_stream():
        size += len(chunk)
        if size > max_bytes:
            raise FetchFailed(f"the body is larger than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)

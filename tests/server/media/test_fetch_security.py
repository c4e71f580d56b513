"""http(s) media URLs cannot reach inside the network (issue #41, after vLLM's CVE-2025-6242):
loopback in every spelling refused before any byte is sent, redirects checked hop by hop,
one generic error whatever is behind a URL, a total deadline, ``--allowed-media-domains``,
``--allow-private-media-urls``; and ``file://`` URLs that are not paths are 400s.

Every request goes to an origin this module starts on 127.0.0.1 (:mod:`.origin`); the
name ``media.test`` stands for a public host through an injected resolver."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import pytest

from model_shards.launch.replicas import free_port
from server.http.errors import APIError
from server.media.fetch import MediaOptions, fetch_media
from server.media.http_fetch import is_public, vetted_addresses
from tests.server.media.origin import PNG_1X1, Origin, running_origin

pytestmark = pytest.mark.timeout(60)

GENERIC = "'p': could not fetch the image URL"


@pytest.fixture(scope="module")
def origin() -> Iterator[Origin]:
    with running_origin() as running:
        yield running


@pytest.fixture(autouse=True)
def _fresh_log(origin: Origin) -> None:
    origin.paths.clear()


async def _public_test_name(host: str, port: int) -> list[str]:
    """DNS where ``media.test`` is a public host that happens to be our origin."""
    if host == "media.test":
        return ["127.0.0.1"]
    return await vetted_addresses(host, port, allow_private=False)


PUBLIC = MediaOptions(resolve=_public_test_name, fetch_timeout_s=5.0)
PRIVATE_OK = MediaOptions(allow_private_media_urls=True, fetch_timeout_s=5.0)
DEFAULT = MediaOptions()


async def _refusal(url: str, options: MediaOptions = DEFAULT) -> str:
    with pytest.raises(APIError) as caught:
        await fetch_media(url, "p", options)
    assert caught.value.status_code == 400
    return caught.value.info.message


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "2130706433",  # 127.0.0.1 as a decimal integer
        "0x7f000001",  # and in hex
        "[::1]",
        "[::ffff:127.0.0.1]",
        "0.0.0.0",
        "[::]",
    ],
)
async def test_loopback_in_any_spelling_is_refused_unsent(origin: Origin, host: str) -> None:
    url = f"http://{host}:{origin.port}/secret"
    assert await _refusal(url) == GENERIC
    assert await _refusal(url, PUBLIC) == GENERIC  # the real check past the injected name
    assert origin.paths == []


async def test_octal_host_is_not_a_url(origin: Origin) -> None:
    message = await _refusal(f"http://0177.0.0.1:{origin.port}/secret")
    assert "not a valid URL" in message and origin.paths == []


async def test_a_public_host_is_fetched_and_its_redirects_followed(origin: Origin) -> None:
    """The control for the refusals: the injected public name is fetched, redirects too."""
    good = f"http://media.test:{origin.port}/good.png"
    assert await fetch_media(good, "p", PUBLIC) == (PNG_1X1, "image/png")
    hop = f"http://media.test:{origin.port}/redirect?to={quote(good)}"
    assert await fetch_media(hop, "p", PUBLIC) == (PNG_1X1, "image/png")
    assert [p.split("?")[0] for p in origin.paths] == ["/good.png", "/redirect", "/good.png"]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "[::1]"])
async def test_a_redirect_to_loopback_is_refused(origin: Origin, host: str) -> None:
    target = f"http://{host}:{origin.port}/secret"
    url = f"http://media.test:{origin.port}/redirect?to={quote(target)}"
    assert await _refusal(url, PUBLIC) == GENERIC
    assert [p.split("?")[0] for p in origin.paths] == ["/redirect"]  # never /secret


async def test_redirects_are_bounded(origin: Origin) -> None:
    assert await _refusal(f"http://media.test:{origin.port}/loop", PUBLIC) == GENERIC
    assert 1 < len(origin.paths) <= 6


async def test_errors_do_not_tell_what_is_behind_a_url(origin: Origin) -> None:
    """A 404, an HTML page, a closed port and a plain-text page read the same."""
    closed = f"http://127.0.0.1:{_closed_port()}/x.png"
    for path in ("/missing.png", "/page.html", "/secret"):
        assert await _refusal(origin.url + path, PRIVATE_OK) == GENERIC
    assert await _refusal(closed, PRIVATE_OK) == GENERIC


async def test_the_timeout_bounds_the_whole_fetch(origin: Origin) -> None:
    """An origin that sends a byte every 50 ms (no read ever waits a second) is cut at
    the 1 s deadline, not after its 30 s."""
    started = time.monotonic()
    options = replace(PRIVATE_OK, fetch_timeout_s=1.0)
    assert await _refusal(f"{origin.url}/slow.png", options) == GENERIC
    assert time.monotonic() - started < 10


async def test_allowed_media_domains_applies_to_every_hop(origin: Origin) -> None:
    options = replace(PRIVATE_OK, allowed_media_domains=frozenset({"localhost"}))
    good = f"http://localhost:{origin.port}/good.png"
    assert await fetch_media(good, "p", options) == (PNG_1X1, "image/png")
    message = await _refusal(f"{origin.url}/good.png", options)
    assert "not in --allowed-media-domains" in message
    bounce = f"http://localhost:{origin.port}/redirect?to={quote(origin.url + '/secret')}"
    assert await _refusal(bounce, options) == GENERIC
    assert [p.split("?")[0] for p in origin.paths] == ["/good.png", "/redirect"]


async def test_allow_private_media_urls_opts_in(origin: Origin) -> None:
    assert await fetch_media(f"{origin.url}/good.png", "p", PRIVATE_OK) == (PNG_1X1, "image/png")


@pytest.mark.parametrize(
    "address",
    ["10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "224.0.0.1",
     "255.255.255.255", "240.0.0.1", "fe80::1", "fc00::1", "ff02::1", "::", "::ffff:10.0.0.1",
     "2002:7f00:1::", "not an address"],
)  # fmt: skip
def test_non_public_addresses(address: str) -> None:
    assert not is_public(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses(address: str) -> None:
    assert is_public(address)


@pytest.mark.parametrize(
    ("path", "says"),
    [("a%00b.png", "null byte"), ("%ff%fe.png", "not valid"), ("a\x00b.png", "null byte")],
)
async def test_file_urls_that_are_not_paths_are_400s(tmp_path: Path, path: str, says: str) -> None:
    options = MediaOptions(allowed_local_media_path=tmp_path)
    assert says in await _refusal(f"file://{tmp_path}/{path}", options)


async def test_http_urls_that_do_not_parse_are_400s() -> None:
    for url in ("http://exa\x00mple.com/a.png", "http://[::1/a.png", "http://%ff/x"):
        assert "not a valid" in await _refusal(url)


def _closed_port() -> int:
    return free_port()

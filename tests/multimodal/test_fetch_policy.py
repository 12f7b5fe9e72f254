"""Media URLs cannot reach inside the network: loopback, private, link-local (metadata) and other
non-public addresses are refused after DNS and on every redirect, before any connection."""

from __future__ import annotations

import ipaddress

import pytest

from glmflash.multimodal import FetchConfig, MediaError, load_image
from glmflash.multimodal.fetch import UrlPolicy, is_public
from tests.multimodal.fake_net import HOSTS

PUBLIC = "http://media.example/tiny.png"


@pytest.mark.parametrize("address,public", [
    ("93.184.216.34", True), ("2606:2800:220:1::248", True), ("127.0.0.1", False),
    ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("0.0.0.0", False), ("::1", False),
    ("fe80::1", False), ("fd00:ec2::254", False), ("::ffff:10.0.0.1", False),
    ("::ffff:8.8.8.8", True), ("64:ff9b::a00:1", False), ("2002:a00:1::", False),
    ("224.0.0.1", False), ("240.0.0.1", False),
])
def test_is_public(address, public):
    assert is_public(ipaddress.ip_address(address)) is public


def test_a_public_host_is_fetched(fake_net):
    assert load_image(PUBLIC, FetchConfig()).size == (16, 16)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/x.png", "http://localhost/x.png", "http://[::1]/x.png",
    "http://10.0.0.7/x.png", "http://169.254.169.254/latest/meta-data/", "http://0.0.0.0/",
    "http://intranet.example/x.png", "http://metadata.example/latest/meta-data/",
    "http://rebind.example/x.png", "http://shared.example/x.png",
    "https://intranet.example:8443/x.png",
])
def test_private_addresses_are_refused_before_connecting(fake_net, url):
    with pytest.raises(MediaError, match="not a public address") as info:
        load_image(url, FetchConfig())
    assert fake_net.refused == []
    # The client learns nothing of the network: no resolved address, no socket error.
    assert not any(a in str(info.value) for a in HOSTS.values() if a not in url)


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/",
                                    "http://10.0.0.7/admin", "http://intranet.example/",
                                    "http://127.0.0.1:{port}/tiny.png"])
def test_redirects_into_the_network_are_refused(fake_net, target):
    url = f"http://media.example/to?{target.format(port=fake_net.port)}"
    with pytest.raises(MediaError, match="not a public address"):
        load_image(url, FetchConfig())
    assert fake_net.refused == []


def test_allowed_media_domains_narrow_fetching(fake_net):
    assert load_image(PUBLIC, FetchConfig(url_policy=UrlPolicy.create(["Media.Example."])))
    # One host given as a string (the library's option): that host, not its characters.
    assert load_image(PUBLIC, FetchConfig(url_policy=UrlPolicy.create("media.example")))
    narrow = FetchConfig(url_policy=UrlPolicy.create(["cdn.example"]))
    with pytest.raises(MediaError, match="not in this server's allowed media domains"):
        load_image(PUBLIC, narrow)
    hop = "http://media.example/to?http://other.example/tiny.png"
    with pytest.raises(MediaError, match="'other.example' is not in this server's allowed"):
        load_image(hop, FetchConfig(url_policy=UrlPolicy.create(["media.example"])))


def test_fetch_errors_do_not_echo_connection_details(fake_net, monkeypatch):
    monkeypatch.setitem(HOSTS, "down.example", "93.184.216.35")
    with pytest.raises(MediaError) as info:
        load_image("http://down.example/x.png", FetchConfig())
    message = str(info.value)
    assert "could not be fetched" in message
    assert "93.184" not in message and "Errno" not in message and "refused" not in message
    with pytest.raises(MediaError, match="could not be resolved"):
        load_image("http://no-such-host.invalid/x.png", FetchConfig())

"""``TRAINYARD_HOST``: what this machine's servers (the lighthouse, the heal transport) bind and advertise."""

from __future__ import annotations

import pytest

from trainyard import servers


@pytest.mark.parametrize("host", ["", "127.0.0.1", "localhost", "LOCALHOST", "127.0.0.2", "::1", "[::1]"])
def test_a_loopback_host_binds_loopback_alone(monkeypatch, host):
    # a loopback name reaches no other machine: opening every interface for it (unauthenticated ports) was wrong
    monkeypatch.setenv(servers.HOST_ENV, host)
    assert (servers.advertised_host(), servers.bind_host()) == ("127.0.0.1", "127.0.0.1")


@pytest.mark.parametrize(("host", "in_url"), [("10.0.3.7", "10.0.3.7"), ("node-7.cluster", "node-7.cluster"),
                                              ("fd00::7", "[fd00::7]")])  # fmt: skip
def test_a_reachable_host_binds_every_interface_and_is_written_as_urls_take_it(monkeypatch, host, in_url):
    monkeypatch.setenv(servers.HOST_ENV, host)
    assert (servers.advertised_host(), servers.bind_host()) == (host, "0.0.0.0")
    assert servers.url_host(servers.advertised_host()) == in_url

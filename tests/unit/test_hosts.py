"""``TRAINYARD_HOST``: what this machine's servers (the lighthouse, the heal transport) bind and advertise."""

from __future__ import annotations

import pytest

from trainyard import servers
from trainyard.errors import TrainingError


@pytest.mark.parametrize("host", ["", "127.0.0.1", "localhost", "LOCALHOST", "127.0.0.2", "::1", "[::1]"])
def test_a_loopback_host_binds_loopback_alone(monkeypatch, host):
    # a loopback name reaches no other machine: opening every interface for it (unauthenticated ports) was wrong
    monkeypatch.setenv(servers.HOST_ENV, host)
    assert (servers.advertised_host(), servers.bind_host()) == ("127.0.0.1", "127.0.0.1")


@pytest.mark.parametrize("host", ["10.0.3.7", "node-7.cluster"])
def test_a_reachable_host_binds_every_interface(monkeypatch, host):
    monkeypatch.setenv(servers.HOST_ENV, host)
    assert (servers.advertised_host(), servers.bind_host()) == (host, "0.0.0.0")


def test_an_ipv6_host_is_refused_naming_the_fix(monkeypatch):
    # the servers listen on IPv4: groups dialling an IPv6 address would find nothing there
    monkeypatch.setenv(servers.HOST_ENV, "fd00::7")
    with pytest.raises(TrainingError, match=r"TRAINYARD_HOST='fd00::7': an IPv6 address.*give its IPv4 address"):
        servers.advertised_host()

"""``TRAINYARD_HOST``: what this machine's servers (the lighthouse, the heal transport) bind and advertise; and
that a server Trainyard starts is taken as started only when it answers on its own socket."""

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


def test_the_any_address_is_refused_as_the_address_groups_dial(monkeypatch):
    # "listen everywhere", but advertised: a group on another node dialled its own machine for the lighthouse
    monkeypatch.setenv(servers.HOST_ENV, "0.0.0.0")
    with pytest.raises(TrainingError, match=r"TRAINYARD_HOST='0.0.0.0': an address to listen on, not one other"):
        servers.advertised_host()


def test_a_server_is_started_when_it_answers_itself_not_when_another_holds_its_port():
    """Two jobs: the free port one was given was taken by the other's server first. That server answered, so
    the lighthouse (or the local S3) was taken as started while it failed to bind and exited."""
    import http.server
    import subprocess
    import sys
    import threading

    other = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)  # another job's
    port = other.server_address[1]
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        bind_late = f"import socket, time; time.sleep(1); socket.socket().bind(('127.0.0.1', {port}))"
        ours = subprocess.Popen([sys.executable, "-c", bind_late], stderr=subprocess.DEVNULL)
        assert servers.wait_until_answering(f"http://127.0.0.1:{port}/", ours, 20) == "exited at start (code 1)"
    finally:
        other.shutdown()
        other.server_close()
    serve = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(servers.free_port())]
    ours = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert servers.wait_until_answering(f"http://127.0.0.1:{serve[-1]}/", ours, 20) is None
    finally:
        servers.stop_process(ours)

"""A replica group's torchft servers listen on 127.0.0.1 unless TRAINYARD_HOST is set, and a healing group
loads a peer's state as tensors and plain values only (torchft 0.2 binds every interface and unpickles)."""

from __future__ import annotations

import http.server
import io
import json
import socket
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch
from torchft.checkpointing._serialization import _streaming_save

from tests.unit.jobs import make_job, run
from trainyard.training.heal_transport import HealTransport
from trainyard.training.plan import request_stop


class Payload:
    """What a rogue peer could send: unpickled, it would run code."""

    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['RAN']).touch()",))


def serve_once(body: bytes) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/checkpoint/3/full"


def saved(state) -> bytes:
    buffer = io.BytesIO()
    _streaming_save(state, buffer)
    return buffer.getvalue()


def test_a_peers_state_is_loaded_as_tensors_and_plain_values_only(tmp_path, monkeypatch):
    monkeypatch.setenv("RAN", str(tmp_path / "ran"))
    state = {"model": {"w": torch.arange(4.0)}, "cursor": {"epoch": 2}, "history": {"best": None, "stop": "x"}}
    server, url = serve_once(saved(state))
    try:
        loaded = HealTransport._load_from_address(url, timedelta(seconds=10))
    finally:
        server.shutdown()
    assert loaded["cursor"] == {"epoch": 2} and torch.equal(loaded["model"]["w"], torch.arange(4.0))
    server, url = serve_once(saved({"model": Payload()}))
    try:
        with pytest.raises(Exception, match="exec was not an allowed global"):
            HealTransport._load_from_address(url, timedelta(seconds=10))
    finally:
        server.shutdown()
    assert not (tmp_path / "ran").exists()


def test_a_groups_servers_listen_on_loopback_only(trainyard_home, monkeypatch):
    monkeypatch.delenv("TRAINYARD_HOST", raising=False)
    job, job_id, folder, plan = make_job(
        trainyard_home,
        algorithm={"entrypoint": "tests.unit.jobs:slow_build"},
        hyperparameters={"epochs": 400, "batch_size": 64, "learning_rate": 0.01},
        resources={"replicas": 1},
        stopping={"max_runtime_seconds": 60},
    )
    seen: list[str] = []

    def look() -> None:  # once the group trains: its manager, checkpoint server and store are all up
        beat = folder / "replicas/0/attempt-0/heartbeat.json"
        while not beat.exists() or json.loads(beat.read_text() or "{}").get("step", 0) < 5:
            time.sleep(0.05)
        pid = int((folder / "replicas/0/attempt-0/pid").read_text())
        seen.extend(c.laddr.ip for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN)
        request_stop(folder, "Stopped", "the test has seen what it came for")

    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    outcome, _ = run(job, job_id, folder, plan)
    looker.join(5)
    assert outcome.stop_reason == "Stopped"
    assert len(seen) >= 3 and set(seen) == {"127.0.0.1"}, seen  # manager, checkpoint server, store


def test_with_trainyard_host_set_the_groups_store_is_reached_at_that_address(monkeypatch):
    # torchft sets up the process group between a quorum's groups through its primary's store, at the address the
    # group gave: it listened on 127.0.0.1 and was given as 127.0.0.1, which a group on another machine cannot dial
    from trainyard.training.heal_transport import group_store

    address = _eth_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address but loopback")
    monkeypatch.setenv("TRAINYARD_HOST", address)
    store = group_store()
    with socket.create_connection((address, store.port), timeout=5):
        pass


def _eth_address() -> str | None:
    """An IPv4 address of this machine other than loopback (the one it reaches others from), if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # (UDP: nothing is sent; the route alone picks the address)
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address

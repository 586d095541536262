"""``TRAINYARD_HOST=ecs-task``: an ECS task advertises its own private IP, read from the task metadata endpoint v4
(``trainyard/ecs_metadata.py``), here served on 127.0.0.1 as ECS's container agent serves it; and the settings it
refuses, each naming the fix."""

from __future__ import annotations

import copy
import http.server
import json
import socket
import threading

import pytest

from trainyard import ecs_metadata, servers
from trainyard.errors import TrainingError

# A container's own document (GET $ECS_CONTAINER_METADATA_URI_V4) in an awsvpc task, as AWS's documentation shows it
AWSVPC = {
    "DockerId": "ea32192c8553fbff06c9340478a2ff089b2bb5646fb718b4ee206641c9086d66",
    "Name": "prefect",
    "DockerName": "ecs-trainyard-gpu-24-prefect-cca48e8dcadd97805600",
    "Image": "111122223333.dkr.ecr.us-west-2.amazonaws.com/trainyard-worker:1",
    "Labels": {
        "com.amazonaws.ecs.cluster": "default",
        "com.amazonaws.ecs.container-name": "prefect",
        "com.amazonaws.ecs.task-arn": "arn:aws:ecs:us-west-2:111122223333:task/default/8f03e41243824aea923aca126495",
    },
    "DesiredStatus": "RUNNING",
    "KnownStatus": "RUNNING",
    "Limits": {"CPU": 4096, "Memory": 32768},
    "Type": "NORMAL",
    "Networks": [
        {
            "NetworkMode": "awsvpc",
            "IPv4Addresses": ["10.0.2.100"],
            "AttachmentIndex": 0,
            "MACAddress": "0e:9e:32:c7:48:85",
            "IPv4SubnetCIDRBlock": "10.0.2.0/24",
            "PrivateDNSName": "ip-10-0-2-100.us-west-2.compute.internal",
            "SubnetGatewayIpv4Address": "10.0.2.1/24",
        }
    ],
}


def _with_network(**network) -> dict:
    document = copy.deepcopy(AWSVPC)
    document["Networks"] = [network]
    return document


class _Agent:
    """ECS's container agent, as far as a container sees it: one JSON document at the endpoint's URL."""

    def __init__(self) -> None:
        self.document: dict | None = AWSVPC
        self.status = 200
        self.paths: list[str] = []
        agent = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                agent.paths.append(self.path)
                body = json.dumps(agent.document).encode()
                self.send_response(agent.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}/v4/8f03e41243824aea923aca126495f665-3591415763"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def agent(monkeypatch):
    """The endpoint served, and this process set as a task of an ECS pool (the template's default)."""
    agent = _Agent()
    monkeypatch.setenv(ecs_metadata.METADATA_ENV, agent.uri)
    monkeypatch.setenv(servers.HOST_ENV, "ecs-task")
    monkeypatch.setattr(ecs_metadata, "RETRY_PAUSE_SECONDS", 0.01)
    ecs_metadata.forget()
    yield agent
    ecs_metadata.forget()
    agent.server.shutdown()
    agent.server.server_close()


@pytest.mark.parametrize("keyword", ["ecs-task", " ECS-Task "])
def test_an_ecs_task_advertises_its_own_ip_and_listens_on_every_interface(agent, monkeypatch, keyword):
    # unset, each group advertised 127.0.0.1 (and on bridge, a Docker address): a group on another instance dialled
    # its own machine for its peers' store and checkpoint server
    monkeypatch.setenv(servers.HOST_ENV, keyword)
    assert (servers.advertised_host(), servers.bind_host()) == ("10.0.2.100", "0.0.0.0")
    assert [servers.advertised_host() for _ in range(5)] == ["10.0.2.100"] * 5
    assert agent.paths == ["/v4/8f03e41243824aea923aca126495f665-3591415763"]  # read once a process


def test_a_proxy_set_for_the_images_downloads_is_not_asked(agent):
    # the endpoint is the agent on the instance's link-local address: a proxy cannot reach it. A process of its
    # own, whose environment has the proxy from its start (urllib reads it once)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env |= {"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}  # (nothing listens there)
    code = "from trainyard import servers; print(servers.advertised_host())"
    said = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert said.stdout.strip() == "10.0.2.100", said.stderr


def test_the_keyword_outside_ecs_is_refused_naming_the_fix(agent, monkeypatch):
    monkeypatch.delenv(ecs_metadata.METADATA_ENV)
    with pytest.raises(TrainingError, match=r"TRAINYARD_HOST='ecs-task': ECS_CONTAINER_METADATA_URI_V4 is unset.*ECS"):
        servers.advertised_host()
    assert agent.paths == []


@pytest.mark.parametrize(("mode", "addresses"), [("bridge", ["172.17.0.2"]), ("host", [""]), (None, ["10.0.2.100"])])
def test_a_task_without_an_address_other_hosts_reach_is_refused(agent, mode, addresses):
    # bridge: the container's address is on its instance's Docker bridge, which no other instance reaches
    network = {"IPv4Addresses": addresses} | ({"NetworkMode": mode} if mode else {})
    agent.document = _with_network(**network)
    said = f"network mode '{mode}'" if mode else "no network mode"
    with pytest.raises(TrainingError, match=rf"names {said}, where.*set networkMode awsvpc in its task definition"):
        servers.advertised_host()


def test_an_awsvpc_task_without_an_ipv4_address_is_refused(agent):
    agent.document = _with_network(NetworkMode="awsvpc", IPv4Addresses=[], IPv6Addresses=["2600:1f14::17"])
    with pytest.raises(TrainingError, match=r"names no IPv4 address for its awsvpc network.*own IPv4 address"):
        servers.advertised_host()


def test_an_endpoint_that_does_not_answer_is_refused_after_a_few_short_tries(agent, monkeypatch):
    # a listening socket that never answers (an agent hung), then none at all: each said, neither waited out long
    monkeypatch.setattr(ecs_metadata, "TIMEOUT_SECONDS", 0.2)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv(ecs_metadata.METADATA_ENV, f"http://127.0.0.1:{silent.getsockname()[1]}/v4/x")
        with pytest.raises(TrainingError, match=r"metadata endpoint \(.*\) did not answer \(.*timed out.*3 tries"):
            servers.advertised_host()
        port = silent.getsockname()[1]
    monkeypatch.setenv(ecs_metadata.METADATA_ENV, f"http://127.0.0.1:{port}/v4/x")  # closed: refused
    with pytest.raises(TrainingError, match=r"TRAINYARD_HOST='ecs-task': ECS's task metadata endpoint .* did not"):
        servers.advertised_host()


def test_a_refusal_is_not_kept_the_next_call_reads_again(agent):
    agent.status = 500
    with pytest.raises(TrainingError, match=r"answered HTTP 500, 3 tries"):
        servers.advertised_host()
    agent.status = 200
    assert servers.advertised_host() == "10.0.2.100"
    assert len(agent.paths) == 4

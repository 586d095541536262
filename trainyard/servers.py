"""Helper processes Trainyard starts on 127.0.0.1 (the local S3 endpoint, the torchft lighthouse):
a free port, waiting until one answers HTTP, and stopping it; and the address this machine gives peers
on other machines (``TRAINYARD_HOST``)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable

from trainyard import ecs_metadata
from trainyard.errors import TrainingError

# Where other machines reach this one (an IP or a resolvable name). Unset, the embedded default: the
# lighthouse binds 127.0.0.1 and a group advertises 127.0.0.1 to its peers, so every group must run on the
# lighthouse's machine. Set it where groups run on other nodes (a pod's IP, by the downward API): the
# lighthouse then listens on every interface and each group advertises it for peers to heal from.
HOST_ENV = "TRAINYARD_HOST"
# TRAINYARD_HOST's value in an ECS task: its address is the task's own network interface's, given at start, so the
# pool's template cannot write it down (as Kubernetes' downward API does a pod's IP); the task reads it itself.
ECS_TASK = "ecs-task"


def advertised_host() -> str:
    """The address this machine's servers give their peers: ``TRAINYARD_HOST``, else 127.0.0.1. A loopback one
    (``localhost``, ``127.0.0.2``, ``::1``) is 127.0.0.1: it names this machine alone, as the default does.
    ``ecs-task``: this ECS task's private IPv4 address, from its metadata endpoint (``ecs_metadata``), read once."""
    host = os.environ.get(HOST_ENV, "").strip()
    if host.lower() == ECS_TASK:
        host = ecs_metadata.task_address(f"{HOST_ENV}={host!r}")
    if not host or _loopback(host):
        return "127.0.0.1"
    if _unspecified(host):
        # "listen everywhere" to the one who sets it, but handed to the groups as the address: a group on another
        # node then dialled its own machine, and waited out the lighthouse's minute for nothing
        raise TrainingError(
            f"{HOST_ENV}={host!r}: an address to listen on, not one other machines can reach; give this machine's "
            "IPv4 address or a name that resolves to it (the servers then listen on every interface)"
        )
    if ":" in host:  # the lighthouse, torchft's servers and the heal transport listen on IPv4 (0.0.0.0)
        raise TrainingError(
            f"{HOST_ENV}={host!r}: an IPv6 address, where this machine's servers listen on IPv4; give its IPv4 "
            "address, or a name that resolves to one"
        )
    return host


def bind_host() -> str:
    """Where a server other machines must reach listens: every interface only once ``TRAINYARD_HOST`` names an
    address other machines can reach (a loopback one would open every interface for nothing)."""
    return "127.0.0.1" if advertised_host() == "127.0.0.1" else "0.0.0.0"  # noqa: S104 - asked for by setting it


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address; None for a name (other machines resolve it)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _unspecified(host: str) -> bool:
    return (address := _address(host)) is not None and address.is_unspecified


def _loopback(host: str) -> bool:
    return host.lower() == "localhost" or ((address := _address(host)) is not None and address.is_loopback)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_answering(url: str, proc: subprocess.Popen, timeout_seconds: float) -> str | None:
    """Poll ``url`` until the server ``proc`` started answers (any HTTP status counts); ``None`` when it
    does, else what went wrong: the process exited, or it did not answer in time. An answer counts only
    once ``proc`` (or a child of it) listens on the URL's port: the free port it was given can be taken
    by another job's server first, which then answered for it (two jobs' lighthouses, two demos' S3)
    while ``proc`` failed to bind and exited."""
    deadline = time.monotonic() + timeout_seconds
    port = urllib.parse.urlsplit(url).port
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited at start (code {proc.returncode})"
        try:
            urllib.request.urlopen(url, timeout=1).close()
            answered = True
        except urllib.error.HTTPError:
            answered = True  # refused (an unsigned request, an unknown path), but answering
        except OSError:
            answered = False
        if answered and (port is None or listens_on(proc.pid, port) is not False):
            return None
        time.sleep(0.05)
    return f"did not answer on {url} within {timeout_seconds} s"


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` or one of its children holds a listening TCP socket on ``port``; None where
    that cannot be seen (no such process, or not allowed to look)."""
    import psutil

    try:
        process = psutil.Process(pid)
        family = [process, *process.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    for each in family:
        try:
            sockets = each.net_connections()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue  # a child gone meanwhile holds nothing
        except psutil.AccessDenied:
            return None
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in sockets):
            return True
    return False


def stop_process(proc: subprocess.Popen | None, timeout_seconds: float = 10.0) -> None:
    """Terminate a process, and kill it if it has not gone within ``timeout_seconds``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _find_prctl():
    """libc's ``prctl``, looked up once in the parent: nothing is loaded between fork and exec."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()


def die_with_parent(parent: int | None = None) -> Callable[[], None]:
    """A ``Popen(preexec_fn=...)``: on Linux, the child gets SIGTERM when the process that started it
    dies, however it dies (a SIGTERM that Prefect turns into an exit skips the ``finally`` that would stop
    it). Elsewhere nothing. Call ``Popen`` from the thread that lives as long as the server should: the
    signal follows the starting thread's death.

    A parent that dies between the fork and the ``prctl`` sends no signal (the child is already
    another's): the child then ends at once. ``parent``: the pid it must still have (this process's).
    """
    expected = os.getpid() if parent is None else parent

    def hook() -> None:
        if _PRCTL is None:
            return
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != expected:  # orphaned before the line above: no signal will ever come
            os._exit(128 + signal.SIGTERM)

    return hook

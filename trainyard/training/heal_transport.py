"""Where a replica group's torchft servers listen, and what a healing group accepts from a peer.

torchft (0.2) binds a group's manager server (``[::]``) and its checkpoint server (``""``) on every
interface, and loads a peer's state with ``weights_only=False``: anyone who could reach a worker could
fetch a group's model and optimizer state, call the manager's Kill, or (by joining the quorum) have a
restarting group unpickle what it sends. Here, as the lighthouse does (``servers.bind_host``), they
listen on 127.0.0.1 unless ``TRAINYARD_HOST`` is set (groups on other machines), the group's own
TCPStore (its one rank's) always on 127.0.0.1, and a peer's state is loaded as tensors and plain values
only. With ``TRAINYARD_HOST`` set the servers are reachable from the network, unauthenticated: keep the
nodes on a private network (infra/README.md).
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any

import torchft.manager
from torch.distributed import TCPStore
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport

from trainyard.servers import advertised_host, bind_host


class HealTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, listening on ``bind_host()``, advertised at
    ``advertised_host()``, and loading a peer's state with ``weights_only=True``."""

    _server: ThreadingHTTPServer
    _thread: threading.Thread

    def __init__(self, timeout: timedelta, num_chunks: int = 0) -> None:
        super().__init__(timeout=timeout, num_chunks=num_chunks)
        handler = self._server.RequestHandlerClass  # torchft's, serving this transport's state
        self._server.shutdown()  # the one torchft started on every interface
        self._server.server_close()
        self._thread.join()
        self._server = _Server((bind_host(), 0), handler)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def address(self) -> str:
        return f"http://{advertised_host()}:{self._server.socket.getsockname()[1]}/checkpoint/"

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        # torchft loads with weights_only=False (a scheduler's state may hold other objects); a group's
        # state here is tensors, numbers, strings and containers of them (trainer.state_dict).
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # as torchft's: every peer may ask at once
    daemon_threads = True


def group_store() -> TCPStore:
    """The group's TCPStore, on ``bind_host()`` (127.0.0.1 unless ``TRAINYARD_HOST`` is set; torch's listens on
    every interface unless handed a socket). Not only its one rank's rendezvous: torchft sets up the process group
    between the groups of a quorum through its primary's store, at the address the group gave (``store_addr``,
    ``advertised_host()``), so groups on other machines dial it too."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((bind_host(), 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # detached: the store's server owns the socket now (closing the Python object would close it under it)
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach())


def confine_manager_server() -> None:
    """Make torchft's Manager bind its manager server on ``bind_host()``, not every interface: torchft
    0.2 writes ``[::]:port`` and takes no other; the port it chose is kept."""
    made = torchft.manager.ManagerServer
    if getattr(made, "confined", False):
        return

    def bound(*args: Any, **kwargs: Any):
        if isinstance(kwargs.get("bind"), str):
            kwargs["bind"] = f"{bind_host()}:{kwargs['bind'].rsplit(':', 1)[1]}"
        return made(*args, **kwargs)

    bound.confined = True  # type: ignore[attr-defined]
    torchft.manager.ManagerServer = bound

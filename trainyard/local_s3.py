"""The embedded S3: moto's server mode on 127.0.0.1, started and stopped by Trainyard.

Used by ``trainyard demo`` and the tests when no real S3 is configured. It is a separate process
speaking the S3 API over real HTTP, so the code under test is the same boto3 path as on AWS.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from trainyard.errors import StorageError
from trainyard.servers import die_with_parent, free_port, stop_process, wait_until_answering

# The credentials moto accepts; they are not secrets and never leave this machine.
LOCAL_ENV = {
    "AWS_ACCESS_KEY_ID": "trainyard-local",
    "AWS_SECRET_ACCESS_KEY": "trainyard-local-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class LocalS3:
    """A moto S3 server process on 127.0.0.1; ``env`` holds the variables that point boto3 at it."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.env = {**LOCAL_ENV, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_seconds: float = 30.0) -> LocalS3:
        """Start the server and wait until it answers."""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(),  # gone with the process that started it, even one killed outright
        )
        problem = wait_until_answering(f"{self.endpoint_url}/moto-api/", self._proc, timeout_seconds)
        if problem:
            self.stop()
            raise StorageError(f"the local S3 endpoint {problem}")
        return self

    def stop(self) -> None:
        """Stop the server (its data is in memory and goes with it)."""
        stop_process(self._proc)
        self._proc = None


@contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration, then restore what was there."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def local_s3_env() -> Iterator[LocalS3]:
    """Run a local S3 endpoint and point this process's AWS variables at it for the duration."""
    server = LocalS3().start()
    try:
        with environment(server.env):
            yield server
    finally:
        server.stop()

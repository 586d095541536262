"""``trainyard infra apply`` against an API that answers but refuses: said with what to check, exit 1, no traceback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from trainyard.cli import app


class _Refusing(BaseHTTPRequestHandler):
    status = 401

    def _answer(self):
        body = json.dumps({"detail": "refused"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PATCH = do_PUT = _answer

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass


@pytest.mark.parametrize(("status", "check"), [(401, "PREFECT_API_KEY"), (404, "ends in /api"), (500, "try again")])
def test_an_api_that_refuses_is_named_with_what_to_check(status, check):
    handler = type("Refusing", (_Refusing,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/api"
        result = CliRunner().invoke(app, ["infra", "apply", "--api-url", url, "--dry-run"])
    finally:
        server.shutdown()
        server.server_close()
    assert result.exit_code == 1, result.output
    assert f"the Prefect API at {url} answered {status}" in result.output and check in result.output
    assert "Traceback" not in result.output

"""A real MLflow server that wants credentials: `mlflow server` on sqlite in its own process, behind
`BasicAuthGate`, an HTTP proxy that passes only requests carrying the expected basic auth (as an
authenticating proxy in front of MLflow would; MLflow's own auth app needs packages we do not install)."""

import base64
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

MLFLOW_SETTINGS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on sqlite in its own process; it is slow to start, so it starts first and the test
    waits for it (`wait_ready`) only when it needs it."""
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {name: value for name, value in os.environ.items() if name not in MLFLOW_SETTINGS}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner and its consumer processes
    with open(folder / "server.log", "wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
             "--artifacts-destination", str(folder / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(timeout_s: float = 300.0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert process.poll() is None, (folder / "server.log").read_text()[-3000:]
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok:
                    return port
            except requests.RequestException:  # not listening yet, or still starting up
                pass
            time.sleep(0.5)
        raise TimeoutError(f"mlflow server did not start in {timeout_s:.0f}s")

    yield wait_ready
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


class BasicAuthGate:
    """An HTTP proxy to `upstream_port` that passes only requests carrying `user:password` as basic auth;
    it counts those it passed and lists the paths of those it refused."""

    def __init__(self, upstream_port: int, user: str, password: str):
        expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.passed, self.refused = 0, []
        gate, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                    return self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = b""  # requests sends an empty file chunked
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return body

            def forward(self):
                body = self.read_body()
                if self.headers.get("Authorization") != expected:
                    with lock:
                        gate.refused.append(self.path)
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with lock:
                    gate.passed += 1
                skip = {"authorization", "host", "connection", "content-length", "transfer-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                upstream.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = forward

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()

"""Fixtures for the artifact-store tests: a real S3 API (moto's server on 127.0.0.1) and a
``store_target`` that runs each store test against ``file://`` and against ``s3://``.

No S3 or fsspec call is mocked: the store talks HTTP to moto exactly as it would to AWS. The
fixtures reach behind the store only to inspect or damage stored bytes (``raw_keys``,
``flip_byte``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import requests
from moto.server import ThreadedMotoServer

BUCKET = "dmd2-artifacts"
REGION = "us-east-1"


class MotoServer:
    """moto's S3 API in a thread, restartable on the same port.

    moto keeps its state in module globals, not in the server thread, so buckets and objects
    survive a stop/start of the HTTP server (the restart test checks this).
    """

    def __init__(self) -> None:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop serving: connections to the port are refused until ``start``."""
        self._server.stop()

    def start(self) -> None:
        """Serve again on the same port."""
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def start_after(self, delay_s: float) -> threading.Thread:
        """Start serving again after ``delay_s`` seconds, from a background thread."""
        thread = threading.Thread(target=lambda: (time.sleep(delay_s), self.start()), daemon=True)
        thread.start()
        return thread

    def reset(self) -> None:
        """Forget every bucket and object (moto's reset API)."""
        requests.post(f"{self.endpoint}/moto-api/reset", timeout=10).raise_for_status()

    def require_credentials(self, required: bool) -> None:
        """Make moto check credentials against its IAM (it accepts any by default).

        ``reset-auth`` sets INITIAL_NO_AUTH_ACTION_COUNT (moto/core/authorization.py): 0 means
        authenticate every request from now on, ``inf`` means never.
        """
        count = b"0" if required else b"inf"
        response = requests.post(f"{self.endpoint}/moto-api/reset-auth", data=count, timeout=10)
        response.raise_for_status()


@pytest.fixture(scope="session")
def moto_server():
    """One moto server for the session; tests reset its state through ``s3_env``."""
    server = MotoServer()
    yield server
    server.stop()


def aws_test_settings(endpoint: str, home: Path) -> dict[str, str]:
    """Standard AWS settings pointing at moto; the developer's own ~/.aws files must not leak in."""
    return {
        "AWS_CONFIG_FILE": str(home / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
    }


@pytest.fixture
def s3_env(moto_server, monkeypatch, tmp_path):
    """A fresh moto with bucket BUCKET, and AWS settings pointing at it (standard env vars only)."""
    moto_server.reset()
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in aws_test_settings(moto_server.endpoint, tmp_path).items():
        monkeypatch.setenv(name, value)
    s3_client().create_bucket(Bucket=BUCKET)
    yield moto_server
    moto_server.require_credentials(False)


def s3_client():
    """A boto3 client for the test's own look behind the store (settings from the environment)."""
    return boto3.client("s3", region_name=REGION)


@dataclass
class StoreTarget:
    """Where a parametrized store test stores: ``root_uri`` plus raw access to the bytes."""

    scheme: str
    root_uri: str
    local_root: Path | None = None
    prefix: str = ""

    def raw_keys(self) -> list[str]:
        """Every stored object's path below the root, hidden staging names included."""
        if self.local_root is not None:
            return sorted(
                p.relative_to(self.local_root).as_posix()
                for p in self.local_root.rglob("*")
                if p.is_file()
            )
        pages = s3_client().get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=self.prefix + "/"
        )
        keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
        return sorted(key[len(self.prefix) + 1 :] for key in keys)

    def read_raw(self, key: str) -> bytes:
        """The stored bytes of ``key``, read behind the store's back."""
        if self.local_root is not None:
            return (self.local_root / key).read_bytes()
        return s3_client().get_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}")["Body"].read()

    def flip_byte(self, key: str, offset: int) -> None:
        """Corrupt one stored byte in place, as bit rot or a bad disk would."""
        data = bytearray(self.read_raw(key))
        data[offset] ^= 0x01
        if self.local_root is not None:
            with open(self.local_root / key, "r+b") as file:  # in place, as a bad disk does
                file.seek(offset)
                file.write(data[offset : offset + 1])
            return
        s3_client().put_object(Bucket=BUCKET, Key=f"{self.prefix}/{key}", Body=bytes(data))


@pytest.fixture(params=["file", "s3"])
def store_target(request, tmp_path) -> StoreTarget:
    """Each store test runs once on a local folder and once on moto's S3."""
    if request.param == "file":
        root = tmp_path / "store"
        return StoreTarget("file", f"file://{root}", local_root=root)
    request.getfixturevalue("s3_env")
    return StoreTarget("s3", f"s3://{BUCKET}/artifacts", prefix="artifacts")


@pytest.fixture
def s3_target(s3_env) -> StoreTarget:
    """The S3 target alone, for tests of S3-only behaviour."""
    return StoreTarget("s3", f"s3://{BUCKET}/artifacts", prefix="artifacts")


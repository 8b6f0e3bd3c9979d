"""Real object-store servers on free loopback ports (moto, gcp-storage-emulator, Azurite), one per session.

Each test gets a fresh bucket behind its own fault-injecting proxy, and the
environment variables that point spotguard (and worker subprocesses) at it.
S3 (moto) is a test dependency: if its server cannot start, the S3 tests fail. A missing GCS
emulator or Azurite skips that backend's tests with the command that installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from ._faultproxy import AZURE_BUSY, GCS_503, S3_SLOWDOWN, FaultProxy

REPO = Path(__file__).resolve().parents[2]
AZURITE = REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
INSTALL = "make storage-tools"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout}s")


@dataclass
class Server:
    kind: str
    port: int
    proc: subprocess.Popen[bytes]


def _start(kind: str, tmp: Path) -> Server:
    port = _free_port()
    log = open(tmp / f"{kind}.log", "wb")
    if kind == "s3":
        try:
            import moto.server  # noqa: F401
        except ImportError as exc:  # never a skip: the storage faults must always run
            pytest.fail(f"moto[server] is a test dependency and is not installed ({exc}): {INSTALL}")
        cmd = [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)]
    elif kind == "gs":
        pytest.importorskip("gcp_storage_emulator", reason=f"gcp-storage-emulator not installed: {INSTALL}")
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
               "--in-memory"]
    else:
        if not AZURITE.exists() or shutil.which("node") is None:
            pytest.skip(f"Azurite not installed in .tools/: {INSTALL}")
        cmd = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
    _wait_port(port, proc, kind)
    return Server(kind, port, proc)


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    started: dict[str, Server] = {}
    yield started
    for s in started.values():
        s.proc.terminate()
        try:
            s.proc.wait(5)
        except subprocess.TimeoutExpired:
            s.proc.kill()


def server_for(kind: str, servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory) -> Server:
    if kind not in servers:
        servers[kind] = _start(kind, tmp_path_factory.mktemp(f"{kind}-server"))
    return servers[kind]


@dataclass
class Store:
    """One test's bucket, reached through ``proxy``; ``env`` points spotguard (and subprocesses) at it."""

    kind: str
    bucket: str
    uri: str
    env: dict[str, str]
    proxy: FaultProxy
    fault_status: int
    fault_body: bytes
    fault_headers: dict[str, str]

    def open(self):  # -> ObjectStorage
        from spotguard.storage import open_storage

        return open_storage(self.uri)

    def slowdown(self, count: int, method: str | None = "PUT", path_re: str | None = None) -> None:
        self.proxy.add(method=method, path_re=path_re, status=self.fault_status, body=self.fault_body,
                       headers=self.fault_headers, count=count)

    def subprocess_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        return env


def _env(kind: str, port: int) -> dict[str, str]:
    url = f"http://127.0.0.1:{port}"
    if kind == "s3":
        return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1", "SPOTGUARD_PART_SIZE": "5MiB"}
    if kind == "gs":
        return {"STORAGE_EMULATOR_HOST": url, "SPOTGUARD_PART_SIZE": "1MiB"}
    return {"AZURE_STORAGE_CONNECTION_STRING":
            f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURE_KEY};"
            f"BlobEndpoint={url}/devstoreaccount1;", "SPOTGUARD_PART_SIZE": "1MiB"}


@pytest.fixture
def store(request: pytest.FixtureRequest, servers: dict[str, Server], tmp_path_factory: pytest.TempPathFactory,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    kind: str = request.cls.kind  # set by each backend's test class
    server = server_for(kind, servers, tmp_path_factory)
    bucket = f"sg-{uuid.uuid4().hex[:10]}"
    with FaultProxy("127.0.0.1", server.port) as proxy:
        env = _env(kind, proxy.port)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("SPOTGUARD_MAX_ATTEMPTS", "8")
        status, body, headers = {
            "s3": (503, S3_SLOWDOWN, {"Content-Type": "application/xml"}),
            "gs": (503, GCS_503, {"Content-Type": "application/json"}),
            "az": (503, AZURE_BUSY, {"Content-Type": "application/xml", "x-ms-error-code": "ServerBusy"}),
        }[kind]
        st = Store(kind, bucket, f"{kind}://{bucket}/run", env, proxy, status, body, headers)
        _create_bucket(st)
        yield st


def _create_bucket(st: Store) -> None:
    s = st.open()
    if st.kind == "s3":
        s.client.create_bucket(Bucket=st.bucket)
    elif st.kind == "gs":
        r = s.session.post(f"{s.base}/storage/v1/b", json={"name": st.bucket}, timeout=10)
        assert r.status_code == 200, r.text
    else:
        s.container.create_container()

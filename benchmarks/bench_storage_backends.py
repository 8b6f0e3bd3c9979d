"""Client CPU per GiB of a checkpoint save to each object-store emulator, zero-copy on vs off.

Why: the emulators (gcp-storage-emulator, Azurite, moto) are far slower than the
uploader, so their wall time says little about spotguard; the client's own CPU
per GiB does — it is what a save costs the VM's cores. Each backend gets a
single-process ``dcp.save`` of 128 MiB (8 tensors of 16 MiB) through its
``dcp_writer``, alternating ``SPOTGUARD_ZERO_COPY=1`` and ``=0`` three times
each; every save is loaded back and compared. Servers are the ones ``make
test`` installs (``make storage-tools``); a missing one is reported, not fatal.

    python -m benchmarks bench_storage_backends
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._util import cpu_seconds, free_port

REPO = Path(__file__).resolve().parents[1]
AZURITE = REPO / ".tools" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's fixed, public development key (not a secret)
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BUCKET = "bench"
MiB = 1024 * 1024


def _server(kind: str, tmp: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "s3":
        cmd = [sys.executable, "-c", "from moto.server import main; main()", "-H", "127.0.0.1", "-p", str(port)]
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "b", "AWS_SECRET_ACCESS_KEY": "b",
               "AWS_DEFAULT_REGION": "us-east-1", "SPOTGUARD_S3_SIGN_PAYLOAD": "0"}
    elif kind == "gs":
        cmd = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1", "--port", str(port),
               "--in-memory"]
        env = {"STORAGE_EMULATOR_HOST": url}
    else:
        if not AZURITE.exists() or shutil.which("node") is None:
            raise RuntimeError("Azurite not installed in .tools/ (make storage-tools)")
        cmd = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
               "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
        env = {"AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
                                                  f"AccountKey={AZURE_KEY};BlobEndpoint={url}/devstoreaccount1;"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{kind} server did not start") from None
            time.sleep(0.1)
    return proc, env


def _create_bucket(kind: str, env: dict[str, str]) -> None:
    if kind == "s3":
        import boto3
        from botocore.config import Config

        boto3.client("s3", config=Config(s3={"addressing_style": "path"})).create_bucket(Bucket=BUCKET)
    elif kind == "gs":
        import requests

        requests.post(f"{env['STORAGE_EMULATOR_HOST']}/storage/v1/b", params={"project": "bench"},
                      json={"name": BUCKET}, timeout=10).raise_for_status()
    else:
        from azure.storage.blob import BlobServiceClient

        BlobServiceClient.from_connection_string(env["AZURE_STORAGE_CONNECTION_STRING"]).create_container(BUCKET)


def _measure(kind: str, rounds: int) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    from spotguard.storage import open_storage

    state = {f"t{i}": torch.empty(16 * MiB // 4).fill_(float(i)) for i in range(8)}
    nbytes = sum(t.nbytes for t in state.values())
    out: dict[str, list[float]] = {"on": [], "off": []}
    wall: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * rounds):
        mode = "on" if i % 2 == 0 else "off"
        os.environ["SPOTGUARD_ZERO_COPY"] = "1" if mode == "on" else "0"
        storage = open_storage(f"{kind}://{BUCKET}/run{i}")
        gc.collect()
        c0, t0 = cpu_seconds(), time.monotonic()
        dcp.save(state, storage_writer=storage.dcp_writer("ck"), no_dist=True)
        wall[mode].append(time.monotonic() - t0)
        out[mode].append((cpu_seconds() - c0) / (nbytes / 1024 ** 3))
        sent_zero_copy = storage.zero_copy_bytes  # type: ignore[attr-defined]
        if (mode == "on") != (sent_zero_copy >= nbytes):
            raise RuntimeError(f"{kind}: zero-copy {mode} but {sent_zero_copy} of {nbytes} bytes sent zero-copy")
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, storage_reader=storage.dcp_reader("ck"), no_dist=True)
        if not all(torch.equal(back[k], state[k]) for k in state):
            raise RuntimeError(f"{kind}: checkpoint read back differs")
        storage.close()
    os.environ.pop("SPOTGUARD_ZERO_COPY", None)
    med = {m: sorted(v)[len(v) // 2] for m, v in out.items()}
    return {"cpu_s_per_gib_zero_copy": round(med["on"], 3), "cpu_s_per_gib_copied": round(med["off"], 3),
            "cpu_saved": round(1 - med["on"] / med["off"], 3),
            "wall_s_zero_copy": [round(x, 2) for x in wall["on"]], "wall_s_copied": [round(x, 2) for x in wall["off"]],
            "state_bytes": nbytes}


def run() -> dict[str, Any]:
    rounds = 3
    result: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_before": [round(x, 2) for x in os.getloadavg()]}
    saved = dict(os.environ)
    for kind in ("gs", "az", "s3"):
        tmp = tempfile.mkdtemp(prefix="sg-bench-")
        proc = None
        try:
            proc, env = _server(kind, tmp)
            os.environ.update(env)
            _create_bucket(kind, env)
            result[kind] = _measure(kind, rounds)
        except Exception as exc:  # noqa: BLE001 - one missing server must not hide the others
            result[kind] = {"error": f"{type(exc).__name__}: {exc}"[-600:]}
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(10)
            os.environ.clear()
            os.environ.update(saved)
            shutil.rmtree(tmp, ignore_errors=True)
        print(kind, result[kind], flush=True)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))

"""The CRC placement question again, through the real upload path: one process saves 0.5 GiB with DCP to
``s3sink`` over loopback (spotguard's ``S3Storage``, zero-copy parts), and the CRC32C is computed

- ``crc``: as spotguard does, in the producer, one pass per 4 MiB block before a part is sent;
- ``fused``: on each slice the HTTP client is about to send (``SegmentReader`` read size = the slice);
- ``none``: not at all (the same save with spotguard's checksums switched off).

``none`` and ``fused`` run at each slice size, since the read size changes the sending cost too. The
``fused`` CRC values are computed and dropped: this measures only what the placement costs. Process CPU
and wall seconds, medians of ``$N`` (default 9) interleaved saves after one warm-up.

    python -m benchmarks.crc_fusion_http [SLICE_KIB ...]   # default 256 512 1024 4096
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def main(slices: list[int]) -> dict[str, Any]:
    from benchmarks._util import free_port
    from benchmarks.s3sink import spawn

    port = free_port()
    sink = spawn(port, str(REPO))
    try:
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_REQUEST_CHECKSUM_CALCULATION="when_required",
                          AWS_RESPONSE_CHECKSUM_VALIDATION="when_required", SPOTGUARD_S3_SIGN_PAYLOAD="0")
        import boto3
        import crc32c
        import torch.distributed.checkpoint as dcp
        from botocore.config import Config

        from benchmarks.bench_storage import _no_checksums, _state
        from spotguard.storage import objstore, open_storage

        boto3.client("s3", config=Config(s3={"addressing_style": "path"})).create_bucket(Bucket="bench")
        state = _state(512 << 20)
        store = open_storage("s3://bench/crc-placement")
        plain_next, default_chunk = objstore.SegmentReader._next, objstore.SegmentReader.READ_CHUNK

        def fused_next(self: Any, limit: int) -> Any:
            out = plain_next(self, limit)
            if len(out):
                crc32c.crc32c(out)
            return out

        modes = ["crc@4096"] + [f"{k}@{n}" for n in slices for k in ("none", "fused")]
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        i = 0
        for rep in range(int(os.environ.get("N", "9")) + 1):
            for m in modes[rep % len(modes):] + modes[:rep % len(modes)]:
                kind, kib = m.split("@")
                objstore.SegmentReader.READ_CHUNK = int(kib) << 10
                objstore.SegmentReader._next = fused_next if kind == "fused" else plain_next  # type: ignore
                gc.collect()
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                with _no_checksums() if kind in ("none", "fused") else contextlib.nullcontext():
                    dcp.save(state, storage_writer=store.dcp_writer(f"s{i}"))
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                i += 1
                if rep:  # the first pass warms every path up
                    runs[m].append((time.perf_counter() - t0,
                                    (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)))
        objstore.SegmentReader._next, objstore.SegmentReader.READ_CHUNK = plain_next, default_chunk  # type: ignore
        return {"bytes": 512 << 20, "loadavg": [round(x, 2) for x in os.getloadavg()],
                **{m: {"wall_s_median": round(statistics.median(x[0] for x in v), 3),
                       "cpu_s_median": round(statistics.median(x[1] for x in v), 3),
                       "wall_s": [round(x[0], 3) for x in v], "cpu_s": [round(x[1], 3) for x in v]}
                   for m, v in runs.items()}}
    finally:
        sink.terminate()
        sink.wait(10)


if __name__ == "__main__":
    print(json.dumps(main([int(a) for a in sys.argv[1:]] or [256, 512, 1024, 4096]), indent=1))

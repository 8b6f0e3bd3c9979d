"""Would computing the CRC32C inside the send loop (on bytes the send brings into cache) make it cheaper?

One process, loopback: send 1 GiB from memory in ``slice``-byte ``sendall``s to a draining thread, with
the CRC32C computed ``before`` (a separate pass over the buffer, as spotguard's stream does), ``fused``
(each slice right before its ``sendall``), ``after`` (each slice right after it) or not at all (``none``).
Wall and CPU seconds (the process, and split: the sending thread, the draining thread), medians of 7, the
modes interleaved. The split matters: on loopback the slice size changes the receiver's work too.

    python benchmarks/crc_fusion_check.py [SLICE_BYTES ...]   # default 4 MiB; docs/performance.md quotes it
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import threading
import time

import crc32c

MODES = ("none", "before", "fused", "after")


def _drain(srv: socket.socket, size: int, cpu: list[float]) -> None:
    conn, _ = srv.accept()
    view = memoryview(bytearray(size))
    t0 = time.thread_time()
    while conn.recv_into(view):
        pass
    cpu.append(time.thread_time() - t0)
    conn.close()


def run(buf: bytearray, mode: str, size: int) -> tuple[float, float, float, float]:
    """(wall, process CPU, sender CPU, drain CPU) seconds to send ``buf`` with the CRC32C computed as
    ``mode`` says."""
    mv = memoryview(buf)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    drained: list[float] = []
    t = threading.Thread(target=_drain, args=(srv, size, drained))
    t.start()
    s = socket.create_connection(srv.getsockname())
    r0, w0, s0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter(), time.thread_time()
    crc = 0
    if mode == "before":
        for a in range(0, len(buf), size):
            crc = crc32c.crc32c(mv[a:a + size], crc)
    for a in range(0, len(buf), size):
        if mode == "fused":
            crc = crc32c.crc32c(mv[a:a + size], crc)
        s.sendall(mv[a:a + size])
        if mode == "after":
            crc = crc32c.crc32c(mv[a:a + size], crc)
    sender = time.thread_time() - s0
    s.close()
    t.join()
    srv.close()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return (time.perf_counter() - w0, (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime), sender,
            drained[0])


def measure(size: int, reps: int = 7) -> dict[str, object]:
    buf = bytearray(os.urandom(1 << 20)) * 1024
    res: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in MODES}
    for _ in range(reps):
        for m in MODES:
            res[m].append(run(buf, m, size))
    out: dict[str, object] = {m: {"wall_s_median": round(statistics.median(x[0] for x in v), 3),
                                  "cpu_s_median": round(statistics.median(x[1] for x in v), 3),
                                  "sender_cpu_s_median": round(statistics.median(x[2] for x in v), 3),
                                  "drain_cpu_s_median": round(statistics.median(x[3] for x in v), 3),
                                  "wall_s": [round(x[0], 3) for x in v], "cpu_s": [round(x[1], 3) for x in v]}
                              for m, v in res.items()}
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return out


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [4 << 20]
    print(json.dumps({f"slice_{n}": measure(n) for n in sizes}, indent=1))

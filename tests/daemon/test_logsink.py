"""The daemon's log sink: a log line never blocks the event loop and never raises, whatever the stream does."""

from __future__ import annotations

import os
import time

import pytest

from spotguard.daemon.logsink import LogSink


@pytest.mark.serial
def test_a_stalled_reader_never_blocks_a_write() -> None:
    """A pipe nobody reads fills at 64 KiB; the writer thread blocks there, the caller never does."""
    r, w = os.pipe()
    sink = LogSink(w, max_queued=100)
    try:
        line = "x" * 1000 + "\n"
        t0 = time.monotonic()
        for _ in range(5000):  # 5 MB: far beyond the pipe's buffer
            sink.write(line)
        assert time.monotonic() - t0 < 2.0
        assert sink.dropped > 0  # the queue stayed bounded
    finally:
        os.close(r)  # unblocks the writer thread (EPIPE from here on)
        sink.close(timeout=2.0)
        os.close(w)


def test_write_errors_are_counted_by_errno_and_dropped() -> None:
    fd = os.open("/dev/full", os.O_WRONLY)
    sink = LogSink(fd)
    for _ in range(3):
        sink.write('{"event": "x"}\n')
    sink.close(timeout=2.0)
    os.close(fd)
    assert sink.write_errors == {"ENOSPC": 3}


def test_no_stream_at_all_drops_quietly() -> None:
    sink = LogSink(None)
    assert sink.write("line\n") == 0 and sink.dropped == 1
    sink.flush()
    sink.close()


def test_lines_arrive_whole_and_in_order() -> None:
    r, w = os.pipe()
    sink = LogSink(w)
    lines = [f"line {i}\n" for i in range(200)]
    for ln in lines:
        sink.write(ln)
    sink.close(timeout=5.0)
    os.close(w)
    with os.fdopen(r, "r") as f:
        assert f.read() == "".join(lines)

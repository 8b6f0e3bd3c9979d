"""``spotguard report --html``: one self-contained file; rendered in a real headless browser where one exists."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest

from spotguard.history.record import event_key
from spotguard.report.figures import compute
from spotguard.report.html import COLORS, render_html
from spotguard.storage import open_storage

from .test_figures import chain

EXTERNAL = re.compile(r"(?i)(https?:|ftp:|//[a-z0-9]|\bsrc\s*=|\bhref\s*=|@import|url\(|<link|<script|<iframe)")


def test_html_is_self_contained_and_escapes_what_the_history_says() -> None:
    page = render_html(compute(chain()), "/ckpt")
    assert EXTERNAL.search(page) is None, EXTERNAL.search(page)
    assert "<svg" in page and "n0 rank 0" in page and "n1 rank 1" in page
    assert "Goodput" in page and "Steps recomputed" in page
    assert page.count(COLORS["train"]) >= 3  # one training bar per attempt
    evs = chain()
    evs[3].fields["source"] = '<script src="https://evil.example/x.js"></script>'
    hostile = render_html(compute(evs), "/ckpt")
    assert "<script" not in hostile and "&lt;script src=&quot;https://evil.example" in hostile


def _png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB/RGBA PNG: enough to count colours."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, rows, prev = zlib.decompress(idat), [], bytearray(width * bpp)
    stride = width * bpp + 1
    for y in range(height):
        f, line = raw[y * stride], bytearray(raw[y * stride + 1:(y + 1) * stride])
        for i in range(len(line)):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(b"".join(bytes(line[k:k + 3]) for k in range(0, len(line), bpp)))
        prev = line
    return width, height, rows


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install chromium)")
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    store = open_storage(str(tmp_path / "ckpt"))
    for i, e in enumerate(chain()):
        store.write_bytes(event_key(e.time, e.run, e.rank, i + 1), e.to_json())
    page, png = tmp_path / "report.html", tmp_path / "report.png"
    out = subprocess.run([sys.executable, "-m", "spotguard", "report", str(tmp_path / "ckpt"), "--html", str(page)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    shot = subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1200,900", f"--screenshot={png}", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert png.exists(), shot.stderr[-2000:]
    width, height, rows = _png_pixels(png.read_bytes())
    assert (width, height) == (1200, 900)
    counts: Counter[bytes] = Counter()
    for r in rows:
        counts.update(r[k:k + 3] for k in range(0, len(r), 3))
    train = bytes.fromhex(COLORS["train"][1:])
    save = bytes.fromhex(COLORS["load"][1:])
    assert counts[train] > 2000, counts.most_common(5)  # the training bars were drawn
    assert counts[save] > 50 and len(counts) > 20  # other bars, and text: not a blank page

"""A minimal S3-compatible sink for benchmarks: accepts uploads and discards the bodies.

Why: local S3 emulators (moto ~0.07 GiB/s) measure the emulator, not the
uploader. This server speaks just enough S3 (path-style) for boto3, s3fs and
spotguard — PutObject, multipart (create/upload part/complete/abort/list),
HEAD, GET, ListObjectsV2 (with delimiter), DeleteObject(s), CopyObject — and
keeps only small objects (< 1 MiB, e.g. ``.metadata``, ``COMMIT.json``) in
memory; larger ones are counted and thrown away (GET returns zeros).
One thread per connection; bodies are drained with ``recv_into`` one shared
scratch buffer (releases the GIL), so it costs about as much CPU as the raw-socket
reference it is compared with (``--ack-port``: a plain TCP discard server where
each connection announces its length and gets a one-byte acknowledgement once
every byte arrived, as an upload does).

``--gbit G`` makes the sink a node's network link: every body byte any connection
receives (uploads and the acked reference alike) passes one token bucket of G
Gbit/s, so TCP flow control holds the senders back as a NIC would. Without it the
"network" is the loopback copy, and the save is bound by the CPU (docs/performance.md).

    python -m benchmarks.s3sink --port 9000 [--ack-port 9002] [--gbit 25]
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import socketserver
import threading
import time
import urllib.parse
import uuid
from email.utils import formatdate
from xml.sax.saxutils import escape

KEEP = 1024 * 1024
CHUNK = 4 * 1024 * 1024


class State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.objects: dict[tuple[str, str], tuple[int, bytes | None, float]] = {}
        self.uploads: dict[str, tuple[str, str, dict[int, tuple[int, bytes | None]]]] = {}
        self.bytes_in = 0


STATE = State()
# One scratch buffer for every connection: the bytes are discarded, so concurrent writes into it
# are harmless, and it stays in the CPU caches. (One 4 MiB buffer per thread cost the sink ~60 %
# more CPU per byte at 16 connections than at 2 — it measured the sink, not the uploader.)
_SCRATCH = memoryview(bytearray(CHUNK))


def _buf() -> memoryview:
    return _SCRATCH


class Link:
    """One node's network link, shared by every connection: a body byte counts as delivered only
    once a ``gbit`` Gbit/s wire would have carried it (the receiving thread sleeps until then, its
    socket buffer fills, and TCP flow control makes the sender wait). No burst credit: an idle link
    does not bank time."""

    STEP = 1024 * 1024  # bytes per paced receive: ~0.3 ms at 25 Gbit/s

    def __init__(self, gbit: float) -> None:
        self.rate = gbit * 1e9 / 8
        self._lock = threading.Lock()
        self._free_at = 0.0

    def carried(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + n / self.rate
            wait = self._free_at - now
        if wait > 0:
            time.sleep(wait)


LINK: Link | None = None  # set by --gbit


class Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pending = b""

    def read_head(self) -> bytes | None:
        data = self.pending
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        self.pending = rest
        return head

    def read_exact(self, n: int, keep: bool) -> bytes | None:
        """Read n body bytes; return them only if keep (else drain them into the shared scratch buffer)."""
        take = min(n, len(self.pending))
        head = self.pending[:take]
        self.pending = self.pending[take:]
        n -= take
        if keep:  # received into its own buffer: the scratch one is shared by every connection
            out = bytearray(n)
            view, got_total = memoryview(out), 0
            while got_total < n:
                got = self.sock.recv_into(view[got_total:], min(n - got_total, Link.STEP if LINK else n))
                if not got:
                    raise ConnectionError("client went away")
                got_total += got
                if LINK is not None:
                    LINK.carried(got)
            return head + bytes(out)
        buf = _buf()
        step = Link.STEP if LINK is not None else CHUNK
        while n > 0:
            got = self.sock.recv_into(buf, min(n, step))
            if not got:
                raise ConnectionError("client went away")
            n -= got
            if LINK is not None:
                LINK.carried(got)
        return None

    def readline(self) -> bytes:
        while b"\r\n" not in self.pending:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("client went away")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\r\n")
        return line

    def read_body(self, headers: dict[str, str]) -> tuple[int, bytes | None]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            total, parts = 0, []
            while True:
                size = int(self.readline().split(b";")[0], 16)
                if size == 0:
                    while self.readline():
                        pass
                    break
                data = self.read_exact(size, keep=True)
                parts.append(data or b"")
                total += size
                self.readline()
            body = b"".join(parts)
            return total, (body if total < KEEP else None)
        n = int(headers.get("content-length", "0") or 0)
        return n, self.read_exact(n, keep=n < KEEP)

    def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False) -> None:
        reason = {200: "OK", 204: "No Content", 206: "Partial Content", 404: "Not Found", 400: "Bad Request"}.get(
            status, "OK")
        h = {"Content-Length": str(len(body)), "Date": formatdate(usegmt=True), "x-amz-request-id": "sink"}
        h.update(headers or {})
        out = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
        self.sock.sendall(out.encode() + (b"" if head else body))


def _xml(tag: str, inner: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<{tag} xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"{inner}</{tag}>").encode()


def _not_found(c: Conn, code: str = "NoSuchKey", head: bool = False) -> None:
    c.send(404, _xml("Error", f"<Code>{code}</Code><Message>not found</Message>"),
           {"Content-Type": "application/xml"}, head=head)


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))


def handle(c: Conn, method: str, target: str, headers: dict[str, str]) -> None:
    url = urllib.parse.urlsplit(target)
    q = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    path = urllib.parse.unquote(url.path).lstrip("/")
    bucket, _, key = path.partition("/")
    size, body = c.read_body(headers)
    with STATE.lock:
        STATE.bytes_in += size
    st = STATE
    if not key:
        if method == "GET" and "uploads" in q:
            c.send(200, _xml("ListMultipartUploadsResult", f"<Bucket>{bucket}</Bucket><IsTruncated>false</IsTruncated>"))
        elif method == "GET":
            prefix = q.get("prefix", [""])[0]
            delim = q.get("delimiter", [""])[0]
            with st.lock:
                items = sorted((k, v) for (b, k), v in st.objects.items() if b == bucket and k.startswith(prefix))
            contents, prefixes = [], set()
            for k, (sz, _data, mt) in items:
                rest = k[len(prefix):]
                if delim and delim in rest:
                    prefixes.add(prefix + rest.split(delim)[0] + delim)
                    continue
                contents.append(f"<Contents><Key>{escape(k)}</Key><LastModified>{_iso(mt)}</LastModified>"
                                f"<ETag>\"x\"</ETag><Size>{sz}</Size><StorageClass>STANDARD</StorageClass></Contents>")
            cp = "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in sorted(prefixes))
            c.send(200, _xml("ListBucketResult", f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix>"
                                                  f"<KeyCount>{len(contents)}</KeyCount><MaxKeys>1000</MaxKeys>"
                                                  f"<IsTruncated>false</IsTruncated>{''.join(contents)}{cp}"),
                   {"Content-Type": "application/xml"})
        elif method == "POST" and "delete" in q:
            import re

            with st.lock:
                for k in re.findall(rb"<Key>(.*?)</Key>", body or b""):
                    st.objects.pop((bucket, k.decode()), None)
            c.send(200, _xml("DeleteResult", ""))
        else:  # create bucket, HEAD bucket, ...
            c.send(200, b"", head=method == "HEAD")
        return
    okey = (bucket, key)
    if method == "POST" and "uploads" in q:
        uid = uuid.uuid4().hex
        with st.lock:
            st.uploads[uid] = (bucket, key, {})
        c.send(200, _xml("InitiateMultipartUploadResult",
                         f"<Bucket>{bucket}</Bucket><Key>{escape(key)}</Key><UploadId>{uid}</UploadId>"))
    elif method == "PUT" and "partNumber" in q:
        uid = q["uploadId"][0]
        with st.lock:
            st.uploads[uid][2][int(q["partNumber"][0])] = (size, body)
        c.send(200, b"", {"ETag": f'"{int(q["partNumber"][0]):032x}"'})
    elif method == "POST" and "uploadId" in q:
        uid = q["uploadId"][0]
        with st.lock:
            up = st.uploads.pop(uid, None)
        if up is None:
            return _not_found(c, "NoSuchUpload")
        parts = [up[2][n] for n in sorted(up[2])]
        total = sum(p[0] for p in parts)
        data = b"".join(p[1] or b"" for p in parts) if total < KEEP else None
        with st.lock:
            st.objects[okey] = (total, data, time.time())
        c.send(200, _xml("CompleteMultipartUploadResult",
                         f"<Bucket>{bucket}</Bucket><Key>{escape(key)}</Key><ETag>\"x-{len(parts)}\"</ETag>"))
    elif method == "DELETE" and "uploadId" in q:
        with st.lock:
            st.uploads.pop(q["uploadId"][0], None)
        c.send(204)
    elif method == "PUT":
        src = headers.get("x-amz-copy-source")
        if src:
            sb, _, sk = urllib.parse.unquote(src).lstrip("/").partition("/")
            with st.lock:
                obj = st.objects.get((sb, sk))
            if obj is None:
                return _not_found(c)
            with st.lock:
                st.objects[okey] = (obj[0], obj[1], time.time())
            return c.send(200, _xml("CopyObjectResult", f"<ETag>\"x\"</ETag><LastModified>{_iso(time.time())}"
                                                         f"</LastModified>"))
        with st.lock:
            st.objects[okey] = (size, body, time.time())
        md5 = hashlib.md5(body).hexdigest() if body is not None else "0" * 32
        c.send(200, b"", {"ETag": f'"{md5}"'})
    elif method in ("GET", "HEAD"):
        with st.lock:
            obj = st.objects.get(okey)
        if obj is None:
            return _not_found(c, head=method == "HEAD")
        sz, data, mt = obj
        payload = data if data is not None else bytes(sz)
        hdr = {"Last-Modified": formatdate(mt, usegmt=True), "ETag": '"x"', "Content-Type": "binary/octet-stream",
               "Accept-Ranges": "bytes"}
        rng = headers.get("range")
        if rng and method == "GET":
            a, _, b = rng.split("=")[1].partition("-")
            lo, hi = int(a), min(sz - 1, int(b) if b else sz - 1)
            hdr["Content-Range"] = f"bytes {lo}-{hi}/{sz}"
            return c.send(206, payload[lo:hi + 1], hdr)
        if method == "HEAD":
            hdr["Content-Length"] = str(sz)
            out = f"HTTP/1.1 200 OK\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdr.items()) + "\r\n"
            c.sock.sendall(out.encode())
            return
        c.send(200, payload, hdr)
    elif method == "DELETE":
        with st.lock:
            st.objects.pop(okey, None)
        c.send(204)
    else:
        c.send(400, _xml("Error", "<Code>NotImplemented</Code>"))


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = Conn(sock)
        try:
            while True:
                head = c.read_head()
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                if headers.get("expect", "").lower() == "100-continue":
                    sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                handle(c, method, target, headers)
        except (ConnectionError, OSError):
            return


class AckedDiscard(socketserver.BaseRequestHandler):
    """The fair reference: like an upload, a sender's bytes count once the receiver has them all.

    Protocol: 8-byte big-endian length, then that many bytes (drained with
    recv_into, discarded), then the server answers one byte ``k``.
    """

    def handle(self) -> None:
        sock: socket.socket = self.request
        c = Conn(sock)
        head = b""
        while len(head) < 8:
            chunk = sock.recv(8 - len(head))
            if not chunk:
                return
            head += chunk
        try:
            c.read_exact(int.from_bytes(head, "big"), keep=False)
        except (ConnectionError, OSError):
            return
        sock.sendall(b"k")


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def spawn(port: int, cwd: str, env: "dict[str, str] | None" = None) -> "subprocess.Popen[str]":
    """Start the sink as a child on ``port`` and return once it listens (its first stdout line)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.s3sink", "--port", str(port)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if "s3sink listening" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"s3sink did not start: {line!r}")
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--ack-port", type=int, default=0)
    ap.add_argument("--gbit", type=float, default=0.0,
                    help="pace every body byte through one link of this many Gbit/s (0: no limit)")
    a = ap.parse_args()
    global LINK
    if a.gbit < 0:
        ap.error("--gbit: a rate in Gbit/s, or 0 for no limit")
    LINK = Link(a.gbit) if a.gbit else None
    if a.ack_port:
        acked = Server((a.host, a.ack_port), AckedDiscard)
        threading.Thread(target=acked.serve_forever, daemon=True).start()
    with Server((a.host, a.port), Handler) as srv:
        print(f"s3sink listening on http://{a.host}:{a.port}", flush=True)
        srv.serve_forever()


if __name__ == "__main__":
    main()

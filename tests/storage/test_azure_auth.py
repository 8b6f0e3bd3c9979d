"""Azure AD (token credential) uploads: azure-core's 401-challenge resend must carry the whole block.

No local server speaks Azure AD, so ``responses`` answers as Blob Storage does
to a bearer token it will not take: 401 with a ``WWW-Authenticate: Bearer
authorization_uri=... resource_id=https://storage.azure.com`` challenge, after
which azure-core's bearer-token policy fetches a new token and sends the same
request again. A zero-copy block body is a stream; this checks every send of
every block carried all of its bytes.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

responses = pytest.importorskip("responses")
pytest.importorskip("azure.storage.blob")

from azure.core.credentials import AccessToken  # noqa: E402

from spotguard.storage.azure import AzureStorage  # noqa: E402

ACCOUNT = "https://acct.blob.core.windows.net"
MiB = 1024 * 1024
CHALLENGE = ("Bearer authorization_uri=https://login.microsoftonline.com/72f988bf-86f1-41af-91ab-2d7cd011db47/"
             "oauth2/authorize resource_id=https://storage.azure.com")


class Cred:
    """A token credential (azure-core protocol): a new token per call."""

    def __init__(self) -> None:
        self.issued = 0

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        self.issued += 1
        return AccessToken(f"tok{self.issued}", int(time.time()) + 3600)


def test_block_resent_after_a_401_challenge_carries_every_byte() -> None:
    cred = Cred()
    sends: list[tuple[str, int, int]] = []  # (block id or "commit", Content-Length, body bytes received)
    blocks: dict[str, bytes] = {}
    committed: list[bytes] = []

    def put(request: Any) -> Any:
        body = request.body
        data = bytes(body.read()) if hasattr(body, "read") else (body or b"")
        if isinstance(data, str):
            data = data.encode()
        length = int(request.headers.get("Content-Length", "0"))
        if "comp=blocklist" in request.url:
            sends.append(("commit", length, len(data)))
            committed.append(data)
            return 201, {}, ""
        bid = re.search(r"blockid=([^&]+)", request.url).group(1)  # type: ignore[union-attr]
        sends.append((bid, length, len(data)))
        if len(sends) == 1:  # the first block meets a token the service will not take
            return 401, {"WWW-Authenticate": CHALLENGE}, ""
        if len(data) != length:  # what a short body turns into: the service never gets the rest
            return 400, {"x-ms-error-code": "InvalidHeaderValue"}, ""
        blocks[bid] = data
        return 201, {}, ""

    with responses.RequestsMock(assert_all_requests_are_fired=False) as rsps:
        rsps.add_callback("PUT", re.compile(re.escape(ACCOUNT) + r"/.*"), callback=put)
        store = AzureStorage("az://ckpts/run", credential=cred, account_url=ACCOUNT, part_size=1 * MiB,
                             concurrency=1, backoff=0.01)
        data = bytes(range(256)) * (3 * MiB // 256)
        src = memoryview(bytearray(data))

        class Src:  # the tensor-memory source the DCP writer passes
            def view_of(self, mv: memoryview) -> memoryview | None:
                return src

        up = store.open_upload("obj")
        with up.zero_copy(Src()):  # type: ignore[arg-type]
            up.write(src)
        up.close()
    assert store.zero_copy_bytes == len(data)
    block_sends = [s for s in sends if s[0] != "commit"]
    assert len(block_sends) == 4  # 3 blocks, the first sent twice (challenge)
    assert all(length == got == MiB for _, length, got in block_sends), sends
    assert b"".join(blocks[b] for b in sorted(blocks)) == data and len(committed) == 1
    assert cred.issued >= 2  # a new token after the challenge

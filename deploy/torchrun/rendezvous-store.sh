#!/usr/bin/env bash
# The c10d rendezvous store for deploy/torchrun/launch.sh. Run it on ONE stable
# machine (on-demand VM, a login node, a small CPU instance): spot nodes come
# and go, the store must not. Needs Python with torch; listens on RDZV_PORT.
#
#   RDZV_PORT=29400 deploy/torchrun/rendezvous-store.sh
set -euo pipefail
RDZV_PORT="${RDZV_PORT:-29400}"
PYTHON="${PYTHON:-python3}"
export RDZV_PORT
exec "${PYTHON}" - << 'PY'
import os
import signal
from datetime import timedelta

from torch.distributed import TCPStore

port = int(os.environ["RDZV_PORT"])
store = TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(hours=1))
print(f"rendezvous store listening on 0.0.0.0:{store.port}", flush=True)
stop = {signal.SIGINT, signal.SIGTERM}
for sig in stop:  # an ignored disposition inherited from the parent would make the store unstoppable
    signal.signal(sig, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # sigwait takes them; nothing else does
signal.sigwait(stop)
PY

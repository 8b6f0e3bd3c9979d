# spotguard daemon image: the notice daemon only (aiohttp, structlog,
# prometheus-client). No torch: the trainer image brings its own and talks to
# this container over the shared Unix socket.
#
#   docker build -t spotguard:0.1.0 .
#   docker run --rm -v spotguard-run:/run/spotguard spotguard:0.1.0 daemon --cloud auto
#
# tests/deploy/test_dockerfile.py lints this file with hadolint and replays the
# build stage's install step (the RUN below) into a clean venv.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a self-contained virtualenv in /opt/spotguard --------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spotguard ./spotguard
# Install step (replayed by the tests): the package with its runtime
# dependencies and the cluster actions' clients (kubernetes_asyncio for
# --kubernetes-node-actions, boto3 for --asg-lifecycle-hook), nothing else;
# fail the build if torch slipped in.
RUN python -m venv /opt/spotguard \
    && /opt/spotguard/bin/pip install --no-cache-dir "/src[kubernetes,aws]" \
    && /opt/spotguard/bin/spotguard daemon --help > /dev/null \
    && if /opt/spotguard/bin/python -c "import torch" 2>/dev/null; then echo "torch must not be in the daemon image" >&2; exit 1; fi \
    && /opt/spotguard/bin/python -m compileall -q /opt/spotguard

# ---- runtime -----------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="spotguard" \
      org.opencontainers.image.description="Spot/preemptible VM termination-notice daemon (sidecar or DaemonSet)" \
      org.opencontainers.image.licenses="Apache-2.0"

# Fixed uid/gid so that pods (runAsUser/fsGroup) and hostPath sockets can name them.
RUN groupadd --system --gid 10001 spotguard \
    && useradd --system --uid 10001 --gid spotguard --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin spotguard \
    && install -d -o spotguard -g spotguard -m 0770 /run/spotguard

COPY --from=build /opt/spotguard /opt/spotguard

ENV PATH=/opt/spotguard/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SPOTGUARD_SOCKET=/run/spotguard/spotguard.sock \
    SPOTGUARD_LOG_FORMAT=json

USER 10001:10001
# The only interface: the socket directory, shared with the trainer (emptyDir,
# hostPath or a named volume). Metrics (--metrics-port) bind 127.0.0.1 only, by
# design: scrape them from the same pod / network namespace; no EXPOSE, since a
# published port could not reach them anyway.
VOLUME ["/run/spotguard"]

# Healthy only while the daemon serves its socket AND every metadata watcher has
# had a good answer recently ("I can see notices"); a blind one prints the cause
# and the fix. Start period: Azure's Scheduled Events can take up to 2 minutes
# to answer the first request.
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s --retries=3 \
    CMD ["spotguard", "status", "--check", "--timeout", "3"]

# The daemon handles SIGTERM itself (a clean stop within 2 s: trainers keep
# training and reconnect to the next daemon; --sigterm-notice makes it a
# "termination" notice instead), so it can run as PID 1 without an init.
STOPSIGNAL SIGTERM
ENTRYPOINT ["spotguard"]
CMD ["daemon", "--cloud", "auto"]

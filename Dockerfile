# syntax=docker/dockerfile:1
# kvmeta's container image: `docker build -t kvmeta .` (docs/deployment.md).
#
#   docker build --build-arg KVMETA_EXTRAS=redis -t kvmeta .   # extras: redis, events, metrics
#   docker run -p 18000:18000 -v kvmeta-data:/var/lib/kvmeta -e KVMETA_AUTH_TOKEN=... kvmeta
#   docker run -p 18000:18000 -e KVMETA_AUTH_TOKEN=... kvmeta --backend redis://valkey:6379/0
#
# The arguments after the image name replace CMD (the data directory): a server on a shared
# --backend keeps no data directory, and kvmeta refuses both together.
ARG PYTHON_IMAGE=python:3.12-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY . .
# The same two steps tests/packaging runs (scripts/package): the wheel is built from the sdist
# and installed with constraints/test.txt's pins, so the image runs what CI installed and ran.
RUN scripts/package build python /dist
ARG KVMETA_EXTRAS=redis,events
RUN python -m venv /opt/kvmeta \
    && scripts/package install /opt/kvmeta/bin/python /dist/kvmeta-*.whl "$KVMETA_EXTRAS"

FROM ${PYTHON_IMAGE}
# A fixed uid, so Kubernetes' runAsNonRoot can check it and a volume can be chowned to it.
RUN groupadd --system --gid 10001 kvmeta \
    && useradd --system --uid 10001 --gid kvmeta --home-dir /var/lib/kvmeta --no-create-home \
        --shell /usr/sbin/nologin kvmeta \
    && install -d -o kvmeta -g kvmeta -m 0700 /var/lib/kvmeta
COPY --from=build /opt/kvmeta /opt/kvmeta
ENV PATH=/opt/kvmeta/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /var/lib/kvmeta
# Journal and snapshots (docs/durability.md). Not used with a shared --backend.
VOLUME ["/var/lib/kvmeta"]
EXPOSE 18000
# /health answers without a token with auth on. No curl in a slim image: Python's urllib.
# KVMETA_PORT, when set, moves the server and this check together.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVMETA_PORT', '18000'), timeout=4)"]
# SIGTERM (docker stop, Kubernetes) finishes the requests under way and writes a snapshot.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvmeta", "serve", "--host", "0.0.0.0"]
CMD ["--data-dir", "/var/lib/kvmeta"]

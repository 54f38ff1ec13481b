# syntax=docker/dockerfile:1
# pdgate proxy + metaserver image: one image, two entrypoints (pdgate-entrypoint proxy|metaserver).
# Build from the repository root (the context must be the root, see .dockerignore):
#   docker build -f docker/pdgate.Dockerfile -t pdgate/pdgate:0.1.0 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# --- build: install the project into a self-contained virtual environment -------------------
FROM ${PYTHON_IMAGE} AS build
ARG VENV=/opt/pdgate
# 1: add the kv-routing extra (transformers for the proxy's kv policy, pyzmq for the metaserver's
# --kv-events): about 150 MB over the 55 MB venv, so off by default; the chart's kvRouting needs it.
ARG KV_ROUTING=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pdwire ./pdwire
COPY pdservice ./pdservice
COPY metaserver ./metaserver
COPY proxy ./proxy
COPY connector ./connector
COPY launch ./launch
RUN python -m venv "$VENV" && "$VENV/bin/python" -m pip install --upgrade pip
RUN if [ "$KV_ROUTING" = 1 ]; then "$VENV/bin/python" -m pip install ".[kv-routing]"; \
    else "$VENV/bin/python" -m pip install .; fi

# --- runtime: the venv only, as an unprivileged user ---------------------------------------
FROM ${PYTHON_IMAGE}
ARG VENV=/opt/pdgate
RUN groupadd --system --gid 10001 pdgate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pdgate
COPY --from=build ${VENV} ${VENV}
COPY docker/entrypoint.sh /usr/local/bin/pdgate-entrypoint
COPY docker/healthcheck.py /usr/local/bin/pdgate-healthcheck
ENV PATH=${VENV}/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# 8000: pd-proxy, 8300: pd-metaserver.
EXPOSE 8000 8300
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/usr/local/bin/pdgate-healthcheck"]
ENTRYPOINT ["pdgate-entrypoint"]
CMD ["proxy", "--help"]

# syntax=docker/dockerfile:1
# vLLM engine for Huawei Ascend NPUs: the upstream vllm-ascend image plus the pdgate connector,
# which pushes KV with the base image's Mooncake transfer engine (protocol "ascend").
# Build from the repository root:
#   docker build -f docker/engine-ascend.Dockerfile -t pdgate/engine-ascend:0.1.0 .
# It keeps the base image's root user: the Ascend driver's device nodes and the CANN toolkit under
# /usr/local/Ascend are set up for it (run as another user only with the HwHiAiUser group mapped).
ARG BASE_IMAGE=quay.io/ascend/vllm-ascend:v0.23.0
FROM ${BASE_IMAGE}
# Mooncake: vllm-ascend images ship the Ascend build their release is tested with
# (mooncake-transfer-engine-npu 0.3.11.post1 in v0.23.0); the connector and vllm-ascend's own
# Mooncake connectors use it as it is. Empty keeps it. A requirement here (for example
# mooncake-transfer-engine-npu==0.3.13.post1) replaces it: its pin is then dropped from the
# constraints below. The build fails if the image ends up without a `mooncake` package.
ARG MOONCAKE_PACKAGE=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/pdgate-src
COPY pyproject.toml README.md ./
COPY pdwire ./pdwire
COPY pdservice ./pdservice
COPY metaserver ./metaserver
COPY proxy ./proxy
COPY connector ./connector
COPY launch ./launch
# Pin what the base image has (see engine-cuda.Dockerfile), except a Mooncake being replaced.
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/base-constraints.txt \
 && if [ -n "${MOONCAKE_PACKAGE}" ]; then \
      sed -i -E '/^mooncake[-_.]transfer[-_.]engine/Id' /tmp/base-constraints.txt; \
    fi \
 && python3 -m pip install -c /tmp/base-constraints.txt . ${MOONCAKE_PACKAGE:+"${MOONCAKE_PACKAGE}"} \
 && python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('mooncake') is None and 'no Mooncake in the image: set MOONCAKE_PACKAGE')" \
 && rm -f /tmp/base-constraints.txt
ENV HF_HOME=/models
WORKDIR /
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]

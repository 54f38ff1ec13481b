# syntax=docker/dockerfile:1
# vLLM engine for Huawei Ascend NPUs: the upstream vllm-ascend image plus the pdgate connector and
# the Mooncake transfer engine built for Ascend (protocol "ascend"). Build from the repository root:
#   docker build -f docker/engine-ascend.Dockerfile -t pdgate/engine-ascend:0.1.0 .
# It keeps the base image's root user: the Ascend driver's device nodes and the CANN toolkit under
# /usr/local/Ascend are set up for it (run as another user only with the HwHiAiUser group mapped).
ARG BASE_IMAGE=quay.io/ascend/vllm-ascend:v0.23.0
FROM ${BASE_IMAGE}
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine-npu==0.3.13.post1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/pdgate-src
COPY pyproject.toml README.md ./
COPY pdwire ./pdwire
COPY metaserver ./metaserver
COPY proxy ./proxy
COPY connector ./connector
COPY launch ./launch
# Pin what the base image has (see engine-cuda.Dockerfile).
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/base-constraints.txt \
 && python3 -m pip install -c /tmp/base-constraints.txt . "${MOONCAKE_PACKAGE}" \
 && rm -f /tmp/base-constraints.txt
ENV HF_HOME=/models
WORKDIR /
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
  CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]

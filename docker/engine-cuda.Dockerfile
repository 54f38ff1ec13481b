# syntax=docker/dockerfile:1
# vLLM engine for NVIDIA GPUs: the upstream vllm-openai image plus the pdgate connector and the
# Mooncake transfer engine (RDMA or TCP). Build from the repository root:
#   docker build -f docker/engine-cuda.Dockerfile -t pdgate/engine-cuda:0.1.0 .
ARG BASE_IMAGE=vllm/vllm-openai:v0.33.0
FROM ${BASE_IMAGE}
ARG MOONCAKE_PACKAGE=mooncake-transfer-engine==0.3.13.post1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/pdgate-src
COPY pyproject.toml README.md ./
COPY pdwire ./pdwire
COPY pdservice ./pdservice
COPY metaserver ./metaserver
COPY proxy ./proxy
COPY connector ./connector
COPY launch ./launch
# Constrain every package the base image already has to its version there, so adding the
# connector can never upgrade or downgrade vLLM's own dependencies (the build fails instead).
RUN python3 -m pip freeze --exclude-editable | grep -v ' @ ' > /tmp/base-constraints.txt \
 && python3 -m pip install -c /tmp/base-constraints.txt . "${MOONCAKE_PACKAGE}" \
 && rm -f /tmp/base-constraints.txt
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin vllm
ENV HOME=/home/vllm HF_HOME=/models
USER 1000
WORKDIR /home/vllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["vllm", "serve"]

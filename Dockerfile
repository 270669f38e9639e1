# syntax=docker/dockerfile:1
# onnx-ps, CPU image: one image for parameter-server shards (the default) and workers.
#
#   podman build --pull=never --format docker -t onnx-ps .    # or: docker build -t onnx-ps .
#   podman run --rm -p 50051:50051 onnx-ps server --insecure  # a shard on 0.0.0.0:50051 (or TLS flags)
#   podman run --rm onnx-ps worker --servers HOST:50051 ...   # a worker
#
# deploy/containers/build-image.sh builds it on a machine with no registry (see
# docs/deployment.md); Dockerfile.cuda is the onnxruntime-gpu variant.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- deps: the dependencies alone, in a virtual environment. Only a change to
# pyproject.toml rebuilds this layer; code changes reuse it.
FROM ${PYTHON_IMAGE} AS deps
ARG ONNXRUNTIME=onnxruntime
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml ./
COPY deploy/containers/requirements.py deploy/containers/requirements.py
RUN python deploy/containers/requirements.py pyproject.toml --onnxruntime "${ONNXRUNTIME}" > requirements.txt \
    && python -m venv --without-pip /opt/onnx-ps \
    && python -m pip --python /opt/onnx-ps/bin/python install --no-cache-dir -r requirements.txt

# ---- build: the project's own wheel (no dependencies). The build backend is installed
# before the sources are copied, so a code change only reruns the last step.
FROM deps AS build
RUN python deploy/containers/requirements.py pyproject.toml --build-system > build-requirements.txt \
    && python -m venv /opt/build \
    && /opt/build/bin/pip install --no-cache-dir -r build-requirements.txt
COPY . .
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

# ---- runtime: the environment from `deps` plus the project's wheel; no compilers,
# no pip in the environment, no build files, no pip cache; runs as an unprivileged user.
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="onnx-ps" \
      org.opencontainers.image.description="ONNX-native gRPC parameter server: shards (ps-server) and workers (ps-worker)" \
      org.opencontainers.image.licenses="Apache-2.0"
# PS_HOST/PS_PORT: where `server` listens; PS_HEALTH_ADDRESS: what ps-health probes;
# ONNX_PS_CACHE: the workers' gradient-model cache, under /tmp, writable even with a
# read-only root (the Kubernetes manifests mount an emptyDir there).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PS_HOST=0.0.0.0 \
    PS_PORT=50051 \
    PS_HEALTH_ADDRESS=127.0.0.1:50051 \
    ONNX_PS_CACHE=/tmp/onnx-ps/gradients
RUN groupadd --gid 10001 ps \
    && useradd --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/ps --shell /usr/sbin/nologin ps \
    && mkdir -p /var/lib/onnx-ps/checkpoints \
    && chown -R ps:ps /var/lib/onnx-ps
COPY --from=deps /opt/onnx-ps /opt/onnx-ps
COPY --from=build /wheels /tmp/wheels
RUN python -m pip --python /opt/onnx-ps/bin/python install --no-cache-dir --no-deps /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
# After the install above, which runs the base image's pip: the environment has none.
ENV PATH=/opt/onnx-ps/bin:${PATH}
COPY --chmod=0755 deploy/containers/entrypoint.sh /usr/local/bin/ps-entrypoint
USER 10001:10001
WORKDIR /var/lib/onnx-ps
# 50051: ps.v1 + grpc.health.v1 (shards); 9464: Prometheus metrics (with --metrics-port 9464).
EXPOSE 50051 9464
# Shards only: a worker container has no server (run it with --no-healthcheck, or
# `healthcheck: disable: true` in compose). Kubernetes ignores this and uses its grpc probes.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 CMD ["ps-health", "--quiet"]
ENTRYPOINT ["ps-entrypoint"]
CMD ["server"]

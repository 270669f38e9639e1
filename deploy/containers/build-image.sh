#!/usr/bin/env bash
# Builds the onnx-ps image with podman on a machine without a registry: sets up the engine
# and the stand-in python:3.11-slim first (setup-engine.sh, idempotent), then builds with
# --pull=never. Prints the image name on stdout.
#
#   deploy/containers/build-image.sh                 # CPU image, tag $PS_IMAGE (localhost/onnx-ps:latest)
#   deploy/containers/build-image.sh --no-cache      # extra args go to `podman build`
#   PS_IMAGE=localhost/onnx-ps:dev deploy/containers/build-image.sh
#
# The CUDA image (Dockerfile.cuda) needs an nvidia/cuda base from a registry; build it with
# `docker build -f Dockerfile.cuda -t onnx-ps:cuda .` where one is reachable.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=deploy/containers/common.sh
. "$here/common.sh"

"$here/setup-engine.sh" >&2
ps_load_engine_env

start=$(date +%s)
ps_log "building $PS_IMAGE from $repo/Dockerfile"
podman build --pull=never --format docker --network=host \
    -f "$repo/Dockerfile" -t "$PS_IMAGE" "$@" "$repo" >&2
# Earlier builds of this image that no tag names any more (each rebuild leaves one);
# only images with this project's label, never the layer cache of the current build.
podman image prune -f --filter label=org.opencontainers.image.title=onnx-ps >/dev/null
ps_log "built $PS_IMAGE in $(( $(date +%s) - start )) s, $(podman image inspect --format '{{.Size}}' "$PS_IMAGE") bytes"
echo "$PS_IMAGE"

# shellcheck shell=bash disable=SC2034
# Shared settings for deploy/containers/*.sh (sourced, not run; the variables are used there).
# The cache (base-image tarball, engine config, image storage) lives outside the repository.

if [ -n "${PS_CONTAINER_CACHE:-}" ]; then
    PS_CACHE="$PS_CONTAINER_CACHE"
elif [ "$(id -u)" = 0 ]; then
    PS_CACHE=/var/cache/onnx-ps
else
    PS_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/onnx-ps"
fi
PS_ENGINE_ENV="$PS_CACHE/engine.env"       # CONTAINERS_CONF / CONTAINERS_STORAGE_CONF for podman
PS_BASE_TAR="$PS_CACHE/python-3.11-slim-standin.tar"
PS_BASE_IMAGE="docker.io/library/python:3.11-slim"
PS_IMAGE="${PS_IMAGE:-localhost/onnx-ps:latest}"

ps_log() { printf '[onnx-ps containers] %s\n' "$*" >&2; }

# Loads the engine settings written by setup-engine.sh, when present.
ps_load_engine_env() {
    if [ -f "$PS_ENGINE_ENV" ]; then
        # shellcheck disable=SC1090
        . "$PS_ENGINE_ENV"
        export CONTAINERS_CONF CONTAINERS_STORAGE_CONF
    fi
}

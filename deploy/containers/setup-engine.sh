#!/usr/bin/env bash
# Installs and configures rootful podman (Debian packages) and the local stand-in for
# python:3.11-slim. Idempotent: a second run only checks. Needs root on first use.
#
#   deploy/containers/setup-engine.sh            # engine + base image
#   . "$(deploy/containers/setup-engine.sh --print-env)"   # use the same podman settings
#
# Environment: PS_CONTAINER_CACHE (default /var/cache/onnx-ps as root, else
# $XDG_CACHE_HOME/onnx-ps), PS_SKIP_BASE=1 (engine only), PS_REBUILD_BASE=1.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=deploy/containers/common.sh
. "$here/common.sh"

if [ "${1:-}" = "--print-env" ]; then
    echo "$PS_ENGINE_ENV"
    exit 0
fi

mkdir -p "$PS_CACHE"
need_pkgs=()
for tool in podman:podman runc:runc buildah:buildah debootstrap:debootstrap; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || need_pkgs+=("${tool#*:}")
done
if [ ${#need_pkgs[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
    if ! command -v podman >/dev/null 2>&1; then
        ps_log "podman is not installed and this user is not root: install it (apt-get install podman runc buildah debootstrap) or run as root"
        exit 3
    fi
    need_pkgs=()   # not root: use the podman that is there
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
    ps_log "installing ${need_pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc buildah debootstrap \
        uidmap slirp4netns fuse-overlayfs netavark aardvark-dns iptables ca-certificates >/dev/null
fi

# Engine settings: runc + cgroupfs (crun rejects the hybrid cgroup setup found on some
# hosts), ulimits within the hard limits of this host, file event log (no journald),
# netavark networks (name resolution between containers), storage in the cache (outside
# the repository).
conf_dir="$PS_CACHE/conf"
mkdir -p "$conf_dir"
nofile="$(ulimit -Hn)"
[ "$nofile" = unlimited ] && nofile=1048576
nproc_limit="$(ulimit -Hu)"
[ "$nproc_limit" = unlimited ] && nproc_limit=32768
[ "$nproc_limit" -gt 32768 ] && nproc_limit=32768
# One runroot per cache: two storages must never share one.
cache_key="$(printf '%s' "$PS_CACHE" | cksum | cut -d' ' -f1)"
graphroot="$PS_CACHE/storage"
if [ "$(id -u)" = 0 ]; then
    runroot="/run/onnx-ps-containers/$cache_key"
else
    runroot="${XDG_RUNTIME_DIR:-/tmp/onnx-ps-$(id -u)}/onnx-ps-containers/$cache_key"
fi
cat >"$conf_dir/containers.conf.new" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc_limit:$nproc_limit"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
CONF
cat >"$conf_dir/storage.conf.new" <<CONF
[storage]
driver = "overlay"
graphroot = "$graphroot"
runroot = "$runroot"
CONF
for f in containers.conf storage.conf; do
    if cmp -s "$conf_dir/$f.new" "$conf_dir/$f"; then rm -f "$conf_dir/$f.new"; else mv "$conf_dir/$f.new" "$conf_dir/$f"; fi
done
cat >"$PS_ENGINE_ENV" <<ENV
CONTAINERS_CONF=$conf_dir/containers.conf
CONTAINERS_STORAGE_CONF=$conf_dir/storage.conf
export CONTAINERS_CONF CONTAINERS_STORAGE_CONF
ENV
ps_load_engine_env

if ! podman info >/dev/null 2>"$PS_CACHE/podman-info.err"; then
    ps_log "podman info failed:"; cat "$PS_CACHE/podman-info.err" >&2
    exit 4
fi
ps_log "engine ready: podman $(podman version --format '{{.Client.Version}}'), settings in $PS_ENGINE_ENV"

[ "${PS_SKIP_BASE:-0}" = 1 ] && exit 0

# The stand-in base image: Debian bookworm's python3 (3.11) in a minimal rootfs, tagged
# as python:3.11-slim so the Dockerfile stays standard (build with --pull=never).
if [ "${PS_REBUILD_BASE:-0}" != 1 ] && podman image exists "$PS_BASE_IMAGE"; then
    ps_log "base image $PS_BASE_IMAGE present"
    exit 0
fi
if [ "${PS_REBUILD_BASE:-0}" = 1 ] || [ ! -s "$PS_BASE_TAR" ]; then
    if [ "$(id -u)" != 0 ]; then
        ps_log "building the base image needs root (debootstrap)"; exit 3
    fi
    mirror="${DEBIAN_MIRROR:-}"
    if [ -z "$mirror" ] && [ -f /etc/apt/sources.list.d/debian.sources ]; then
        mirror="$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)"
    fi
    if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
        mirror="$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)"
    fi
    mirror="${mirror:-http://deb.debian.org/debian}"
    rootfs="$(mktemp -d "$PS_CACHE/rootfs.XXXXXX")"
    trap 'rm -rf "$rootfs"' EXIT
    ps_log "debootstrap bookworm from $mirror (about a minute)"
    debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
        bookworm "$rootfs" "$mirror" >"$PS_CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$PS_CACHE/debootstrap.log" >&2; exit 5; }
    # Outgoing TLS may go through a local CA on build hosts: trust the host's extra CAs.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
    fi
    rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
    ln -sf python3 "$rootfs/usr/bin/python"
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
    tar --numeric-owner -C "$rootfs" -cf "$PS_BASE_TAR.tmp" .
    mv "$PS_BASE_TAR.tmp" "$PS_BASE_TAR"
fi
ps_log "importing $PS_BASE_TAR as $PS_BASE_IMAGE"
old_id="$(podman image inspect --format '{{.Id}}' "$PS_BASE_IMAGE" 2>/dev/null || true)"
podman import --quiet --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    "$PS_BASE_TAR" "$PS_BASE_IMAGE" >/dev/null
podman tag "$PS_BASE_IMAGE" localhost/python:3.11-slim
# The replaced stand-in, if nothing else uses it.
if [ -n "$old_id" ] && [ "$old_id" != "$(podman image inspect --format '{{.Id}}' "$PS_BASE_IMAGE")" ]; then
    podman rmi "$old_id" >/dev/null 2>&1 || true
fi
ps_log "base image ready"

#!/bin/sh
# The image's entrypoint (installed as /usr/local/bin/ps-entrypoint).
#
#   server [FLAGS]    ps-server; binds $PS_HOST:$PS_PORT (default 0.0.0.0:50051) unless the
#                     flags say --host/--port or TF_CONFIG is set (then TF_CONFIG's address)
#   worker [FLAGS]    ps-worker
#   health [ADDRESS]  ps-health (exit 0 when the shard reports SERVING)
#   anything else     run as given, e.g. `ps-ctl ...` or `sh`
set -eu

role="${1:-server}"
[ $# -gt 0 ] && shift

case "$role" in
    server | ps-server)
        has_host="" has_port=""
        for arg in "$@"; do
            case "$arg" in
                --host | --host=*) has_host=1 ;;
                --port | --port=*) has_port=1 ;;
            esac
        done
        if [ -z "${TF_CONFIG:-}" ]; then
            [ -n "$has_port" ] || set -- --port "${PS_PORT:-50051}" "$@"
            [ -n "$has_host" ] || set -- --host "${PS_HOST:-0.0.0.0}" "$@"
        fi
        exec ps-server "$@"
        ;;
    worker | ps-worker) exec ps-worker "$@" ;;
    health | ps-health) exec ps-health "$@" ;;
    *) exec "$role" "$@" ;;
esac

#!/bin/sh
# pdgate-entrypoint: run one of the image's programs, listening on all interfaces by default.
#   pdgate-entrypoint proxy [pd-proxy flags]            (default port 8000)
#   pdgate-entrypoint metaserver [pd-metaserver flags]  (default port 8300)
#   pdgate-entrypoint <any command>                      (run it as is)
# A later --host flag overrides the default one.
set -eu
role="${1:-}"
case "$role" in
  proxy)
    shift
    exec pd-proxy --host "${PDGATE_LISTEN_HOST:-0.0.0.0}" "$@"
    ;;
  metaserver)
    shift
    exec pd-metaserver --host "${PDGATE_LISTEN_HOST:-0.0.0.0}" "$@"
    ;;
  "")
    echo "usage: pdgate-entrypoint proxy|metaserver [flags...]" >&2
    exit 2
    ;;
  *)
    exec "$@"
    ;;
esac

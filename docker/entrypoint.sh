#!/bin/sh
# pdgate-entrypoint: run one of the image's programs, listening on all interfaces by default.
#   pdgate-entrypoint proxy [pd-proxy flags]            (default port 8000)
#   pdgate-entrypoint metaserver [pd-metaserver flags]  (default port 8300)
#   pdgate-entrypoint <any command>                      (run it as is)
# A later --host flag overrides the default one.
#
# The metaserver is not started without credentials: a token (PD_METASERVER_TOKEN or --token)
# or a credentials file (PD_METASERVER_CREDENTIALS_FILE or --credentials-file). An open
# metaserver makes everyone who reaches its port an admin (register decoders, drain the fleet,
# read every binding); PD_METASERVER_INSECURE_OPEN=true (or --insecure-open) runs it open anyway.
set -eu

is_true() {
  case "$1" in
    [Tt][Rr][Uu][Ee] | 1 | [Yy][Ee][Ss] | [Oo][Nn]) return 0 ;;
    *) return 1 ;;
  esac
}

# Does the metaserver's command line or environment name a credential (or a config file, which
# may hold one: pd-metaserver then decides), or ask to run open?
metaserver_secured_or_opened() {
  if [ -n "${PD_METASERVER_TOKEN:-}" ] || [ -n "${PD_METASERVER_CREDENTIALS_FILE:-}" ] \
    || [ -n "${PD_METASERVER_CONFIG_FILE:-}" ] || is_true "${PD_METASERVER_INSECURE_OPEN:-}"; then
    return 0
  fi
  for arg in "$@"; do
    case "$arg" in
      --token | --token=?* | --credentials-file | --credentials-file=?* | --config-file | \
        --config-file=?* | --insecure-open) return 0 ;;
    esac
  done
  return 1
}

role="${1:-}"
case "$role" in
  proxy)
    shift
    exec pd-proxy --host "${PDGATE_LISTEN_HOST:-0.0.0.0}" "$@"
    ;;
  metaserver)
    shift
    if ! metaserver_secured_or_opened "$@"; then
      cat >&2 <<'EOF'
pdgate-entrypoint: refusing to start an open metaserver: it would listen on every interface and
take anyone who reaches it as an admin. Give it credentials:
  PD_METASERVER_TOKEN=<token> (or --token)                     one token for every part
  PD_METASERVER_CREDENTIALS_FILE=<file> (or --credentials-file)  roles (docs/security.md)
or, for a throwaway setup on a closed network only, run it open (INSECURE):
  PD_METASERVER_INSECURE_OPEN=true
EOF
      exit 1
    fi
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

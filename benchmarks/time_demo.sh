#!/usr/bin/env bash
# `make demo` from scratch, timed: what `make demo` runs once its venvs exist, into a new directory, so the world
# trains anew and no stage is reused. With `loaded`, two `yes > /dev/null` run beside it (the load test of docs/results/speed.md).
#   bash benchmarks/time_demo.sh /tmp/demo-idle             # idle
#   bash benchmarks/time_demo.sh /tmp/demo-loaded loaded    # beside two busy processes
# Prints the wall seconds; the log (with /usr/bin/time -v's figures) is <out>.log, the world's training time in
# <out>/world/world.json (info.train_seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: time_demo.sh <new output directory> [loaded]}
if [ -e "$out" ]; then echo "time_demo.sh: $out exists; give a new directory" >&2; exit 2; fi
if [ "${2:-}" = loaded ]; then
  yes > /dev/null & y1=$!
  yes > /dev/null & y2=$!
  trap 'kill $y1 $y2' EXIT
fi
start=$(date +%s)
/usr/bin/time -v env EVOESAP_QUANTIZE_PYTHON="$PWD/.venv-quantize/bin/python" \
  .venv/bin/python -m evoesap pipeline demo --out "$out" > "$out.log" 2>&1
echo "wall $(( $(date +%s) - start )) s, load average $(cut -d' ' -f1-3 /proc/loadavg)"

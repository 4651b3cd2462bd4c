#!/usr/bin/env bash
# Graceful stop under MPI (issue 34): OpenMPI's mpirun forwards SIGUSR1 to every process, so
# `train --stop-signal USR1` on N processes, signalled through mpirun mid-run, must stop every
# rank after the same step, checkpoint, exit 75, and resume under mpirun to the same per-step
# losses, bit for bit, as an uninterrupted N-process run. Installs nothing: needs the Debian
# packages libopenmpi-dev openmpi-bin libclang-dev.
# Usage: crates/parallel/scripts/mpi_signal_test.sh [ranks]
set -euo pipefail
cd "$(dirname "$0")/../../.."
ranks="${1:-2}"
command -v mpirun >/dev/null || { echo "mpirun not found: install openmpi-bin libopenmpi-dev libclang-dev" >&2; exit 2; }
cargo build --release -p ganymede --features mpi
target="${CARGO_TARGET_DIR:-target}"
bin="$(pwd)/$target/release/ganymede"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
flags=(--oversubscribe)
# OpenMPI refuses to run as root unless told to (containers, CI).
if [ "$(id -u)" = 0 ]; then flags+=(--allow-run-as-root); fi
# Long enough to be signalled mid-run on a slow machine; a checkpoint only at the end.
job=(train --preset tiny --steps 400 --set parallelism.gather_dtype=f32 --set metrics.val_every=0
  --set parallelism.timeout_s=60 --stop-signal USR1)
timeout 900 mpirun "${flags[@]}" -n "$ranks" "$bin" "${job[@]}" --out "$tmp/straight" >/dev/null

# mpirun itself in the background (not under `timeout`, which would take the signal itself),
# with a watchdog against a hang.
mpirun "${flags[@]}" -n "$ranks" "$bin" "${job[@]}" --out "$tmp/stopped" \
  >"$tmp/stopped.log" 2>&1 &
pid=$!
# (Its output goes nowhere, so a sleeping watchdog never holds the caller's pipe open.)
(sleep 900 && kill -9 "$pid") >/dev/null 2>&1 &
watchdog=$!
# Signal once a few steps are logged (rank 0 writes metrics.jsonl line by line).
for _ in $(seq 1 600); do
  n=$( (wc -l <"$tmp/stopped/metrics.jsonl") 2>/dev/null || echo 0)
  [ "$n" -ge 5 ] && break
  sleep 0.1
done
kill -USR1 "$pid"
set +e
wait "$pid"
rc=$?
set -e
pkill -P "$watchdog" 2>/dev/null || true
kill "$watchdog" 2>/dev/null || true
steps=$(wc -l <"$tmp/stopped/metrics.jsonl")
echo "mpi_signal_test: mpirun exited $rc after $steps of 400 steps"
if [ "$steps" -ge 400 ]; then
  echo "mpi_signal_test: the run finished before the signal took effect" >&2
  cat "$tmp/stopped.log" >&2
  exit 1
fi
# mpirun reports its processes' first non-zero status: 75, the graceful stop's.
[ "$rc" = 75 ] || { echo "mpi_signal_test: expected exit 75" >&2; cat "$tmp/stopped.log" >&2; exit 1; }
grep -q "resume with" "$tmp/stopped.log" || { echo "mpi_signal_test: no resume hint" >&2; cat "$tmp/stopped.log" >&2; exit 1; }
timeout 900 mpirun "${flags[@]}" -n "$ranks" "$bin" train --resume "$tmp/stopped" \
  --stop-signal USR1 >/dev/null
python3 - "$tmp/straight/metrics.jsonl" "$tmp/stopped/metrics.jsonl" <<'PY'
import json, sys
a = [json.loads(l)["loss"] for l in open(sys.argv[1])]
b = [json.loads(l)["loss"] for l in open(sys.argv[2])]
assert len(a) == len(b) == 400, (len(a), len(b))
bad = [i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y]
assert not bad, f"steps differ: {bad[:5]}"
print(f"mpi_signal_test: stopped and resumed run equals the uninterrupted one over {len(a)} steps, bit for bit")
PY

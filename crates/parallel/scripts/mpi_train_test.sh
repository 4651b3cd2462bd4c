#!/usr/bin/env bash
# Sharded training under MPI against one process: `tiny` with f32 gathers on N processes
# (default 4) must give the per-step losses of a single-process run on the same global batch,
# within 1e-6 (the bound the threads tests use). Installs nothing: needs the Debian packages
# libopenmpi-dev openmpi-bin libclang-dev.
# HSDP: `--set parallelism.dp_replicate=2` on 4 processes is 2 replicas of dp_shard 2.
# Usage: crates/parallel/scripts/mpi_train_test.sh [ranks] [steps] [extra --set ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
ranks="${1:-4}"
steps="${2:-10}"
shift $(( $# > 2 ? 2 : $# )) || true
command -v mpirun >/dev/null || { echo "mpirun not found: install openmpi-bin libopenmpi-dev libclang-dev" >&2; exit 2; }
cargo build --release -p ganymede --features mpi
target="${CARGO_TARGET_DIR:-target}"
bin="$target/release/ganymede"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
common=(train --preset tiny --steps "$steps" --set parallelism.gather_dtype=f32 --set checkpoint.enable=false "$@")
# The one-process reference takes every extra setting except the mesh's (a world of one has no
# dp_shard = 4, ep = 2 or dp_replicate = 2 to give).
one=(train --preset tiny --steps "$steps" --set checkpoint.enable=false)
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  if [ "${args[i]}" = --set ] && [[ "${args[i+1]:-}" == parallelism.* ]]; then
    i=$((i + 1))
  else
    one+=("${args[i]}")
  fi
done
"$bin" "${one[@]}" --out "$tmp/one" >/dev/null
flags=(--oversubscribe)
# OpenMPI refuses to run as root unless told to (containers, CI).
if [ "$(id -u)" = 0 ]; then flags+=(--allow-run-as-root); fi
timeout 600 mpirun "${flags[@]}" -n "$ranks" "$bin" "${common[@]}" --out "$tmp/mpi" \
  --set parallelism.timeout_s=60
python3 - "$tmp/one/metrics.jsonl" "$tmp/mpi/metrics.jsonl" "$ranks" <<'PY'
import json, sys
one = [json.loads(l)["loss"] for l in open(sys.argv[1])]
mpi = [json.loads(l) for l in open(sys.argv[2])]
assert len(one) == len(mpi), (len(one), len(mpi))
assert all(m["ranks"] == int(sys.argv[3]) for m in mpi)
d = max(abs(a - m["loss"]) for a, m in zip(one, mpi))
print(f"mpi_train_test: {sys.argv[3]} processes, {len(one)} steps, max |loss - one process| = {d:.3e}")
assert d <= 1e-6, d
PY

#!/usr/bin/env bash
# Build, here, what the GPU machine runs: the ganymede binary with the `cuda` feature in the
# `dist` profile (no debug info, stripped). No CUDA toolkit is needed: the driver, NVRTC and
# cuBLAS are loaded at run time. Checks that the binary and the working tree together fit the
# 64 MiB that may be carried, and says what to carry.
# Usage: scripts/device_build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --profile dist -p ganymede --features cuda
bin=target/dist/ganymede
limit=$((64 * 1024 * 1024))
bin_bytes=$(stat -c %s "$bin")
# Tracked and untracked-but-not-ignored files travel too.
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
# TorchTitan's wheels (scripts/fetch_wheelhouse.sh) travel too, in the carry list.
wheel_bytes=$(du -cb bench/wheelhouse/*.whl 2>/dev/null | tail -1 | cut -f1 || true)
wheel_bytes=${wheel_bytes:-0}
total=$((bin_bytes + tree_bytes + wheel_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "binary: $bin, $(mib "$bin_bytes")"
echo "working tree: $(mib "$tree_bytes"); wheelhouse: $(mib "$wheel_bytes"); together $(mib "$total") of $(mib "$limit")"
if [ "$total" -gt "$limit" ]; then
    echo "too large to carry" >&2
    exit 1
fi
# Without a GPU the binary must refuse CUDA with one line, not panic.
if ! "$bin" train --set device.kind=cuda --steps 1 --out "$(mktemp -d)" 2>/tmp/ganymede-cuda-refusal.txt; then
    echo "refusal here: $(cat /tmp/ganymede-cuda-refusal.txt)"
fi
if [ "$wheel_bytes" = 0 ]; then
    echo "no bench/wheelhouse: run scripts/fetch_wheelhouse.sh for the TorchTitan anchor"
fi
echo "carry: $bin bench/wheelhouse   (the run tool's carry list: [\"$bin\", \"bench/wheelhouse\"])"
echo "then on the GPU machine: scripts/device_check.sh OUTDIR"

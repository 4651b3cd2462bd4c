#!/usr/bin/env bash
# MPI check for ganymede-dist: builds the `mpi_check` example with the `mpi` feature and runs it
# on 4 processes; every collective is compared with the threads backend. Installs nothing:
# needs the Debian packages libopenmpi-dev openmpi-bin libclang-dev.
# Usage: crates/dist/scripts/mpi_test.sh [ranks]   (default 4)
set -euo pipefail
cd "$(dirname "$0")/../../.."
ranks="${1:-4}"
command -v mpirun >/dev/null || { echo "mpirun not found: install openmpi-bin libopenmpi-dev libclang-dev" >&2; exit 2; }
cargo build --release -p ganymede-dist --features mpi --example mpi_check
target="${CARGO_TARGET_DIR:-target}"
flags=(--oversubscribe)
# OpenMPI refuses to run as root unless told to (containers, CI).
if [ "$(id -u)" = 0 ]; then flags+=(--allow-run-as-root); fi
timeout 300 mpirun "${flags[@]}" -n "$ranks" "$target/release/examples/mpi_check"
echo "mpi_test: ${ranks} ranks passed"

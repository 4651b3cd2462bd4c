#!/usr/bin/env bash
# CI for the `cuda` feature, on a machine without a GPU:
#  - ganymede-cuda builds and is clippy clean with the feature, and so are the crates that build
#    on its device side: the device check (ganymede-device-check) and the NCCL group
#    (ganymede-dist with `nccl`), whose unit tests run too;
#  - NVRTC (the nvidia-cuda-nvrtc 13.0 wheel, installed into a venv if missing) compiles every
#    kernel file for sm_90 (GANYMEDE_REQUIRE_NVRTC=1: no NVRTC is a failure, not a skip);
#  - the probe answers with an error, not a panic, and the binary built with the feature refuses
#    device.kind = "cuda" in one line.
# Usage: crates/cuda/scripts/ci_cuda_feature.sh   (from anywhere)
set -euo pipefail
cd "$(dirname "$0")/../../.."

# A wheel's library folder with libnvrtc.so.13, preferring one with the CUDA headers beside it
# (nvidia/cu13/include) so kernels that include them are compiled too.
nvrtc_lib() {
    local found=""
    for d in "$HOME/.cache/ganymede/venv" "$HOME/.cache/ganymede/nvrtc-venv"; do
        local l
        l=$(ls -d "$d"/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1)
        [ -n "$l" ] && [ -e "$l/libnvrtc.so.13" ] || continue
        if [ -e "$l/../include/cuda_bf16.h" ]; then
            echo "$l"
            return 0
        fi
        [ -n "$found" ] || found=$l
    done
    [ -n "$found" ] && echo "$found"
}

if ! lib=$(nvrtc_lib); then
    venv="$HOME/.cache/ganymede/nvrtc-venv"
    python3 -m venv "$venv"
    timeout 600 "$venv/bin/pip" install --quiet --disable-pip-version-check 'nvidia-cuda-nvrtc==13.0.*'
    lib=$(nvrtc_lib)
fi
echo "ci: NVRTC from $lib"

cargo clippy --release -p ganymede-cuda -p ganymede-dist -p ganymede-device-check \
    --features ganymede-cuda/cuda,ganymede-dist/nccl,ganymede-device-check/cuda --all-targets \
    -- -D warnings
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" GANYMEDE_REQUIRE_NVRTC=1 \
    cargo test --release -p ganymede-cuda --features cuda
cargo test --release -p ganymede-dist --features nccl --lib nccl
cargo test --release -p ganymede --features cuda --test cuda_cli

#!/usr/bin/env bash
# Fetch, here (the GPU machine has no network), the pure-Python wheels of TorchTitan's anchor
# (bench/torchtitan_qwen3moe.py) into bench/wheelhouse/: TorchTitan 0.3.0 and the wheels its
# model's modules import, each pinned, without their dependencies (torch comes from the GPU
# machine's own venv; TorchTitan's `datasets`, `wandb`, `tensorboard` are for its trainer and
# are never imported here). bench/wheelhouse/ is ignored by git: carry it to the GPU machine
# beside the binary (the run tool's carry list), where scripts/device_anchor_check.sh installs
# it with `pip install --no-index --no-deps --target`.
# Usage: scripts/fetch_wheelhouse.sh   (GANYMEDE_PYTHON: the Python whose pip downloads;
# default the project venv's, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${GANYMEDE_PYTHON:-$HOME/.cache/ganymede/venv/bin/python}
[ -x "$py" ] || py=python3
dest=bench/wheelhouse
wheels=(
    torchtitan==0.3.0
    spmd_types==0.2.3
    torch_checkpointing==0.1.1
    torchdata==0.11.0
    tyro==1.0.17
    einops==0.8.2
    docstring-parser==0.18.0
    shtab==1.13.0
    typeguard==4.6.1
    rich==15.0.0
    markdown-it-py==4.3.0
    mdurl==0.1.2
    pygments==2.21.0
)
mkdir -p "$dest"
# Pure-Python wheels only (py3-none-any), for the GPU machine's Python 3.12.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation py --abi none --platform any -d "$dest" "${wheels[@]}"
n=$(ls "$dest"/*.whl | wc -l)
if [ "$n" -ne ${#wheels[@]} ]; then
    echo "expected ${#wheels[@]} wheels in $dest, found $n:" >&2
    ls "$dest" >&2
    exit 1
fi
for w in "$dest"/*.whl; do
    case "$w" in *-py3-none-any.whl | *-py2.py3-none-any.whl) ;; *) echo "not pure Python: $w" >&2; exit 1 ;; esac
done
du -cb "$dest"/*.whl | awk '{ printf "%8.1f KiB  %s\n", $1 / 1024, $2 }'

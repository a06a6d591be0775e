#!/usr/bin/env bash
# Stage MLX with its CUDA back-end, and the wheels gpu_suite.sh installs, for a GPU machine without a package index
# that a call reaches with at most about 40 MiB beside the checkout: the CUDA wheel unpacked, packed with xz (about
# 74 MB for MLX 0.32.4) and split in two, .mlxA/ (its first half, the mlx and tokenizers wheels) and .mlxB/ (its
# second half, the other wheels), folders git ignores here. Then, calls in a row (the machine stays warm between):
#     call 1, carry [".mlxA"]:          mkdir -p /tmp/w && cp .mlxA/* /tmp/w/
#     call 2, carry [".mlxB", ...]:     bash benchmarks/gpu_suite.sh GROUP ...   (installs both halves, see there)
# Usage: bash benchmarks/stage_mlx_cuda.sh [MLX_VERSION]   (default 0.32.4; Python 3.12, x86-64 Linux)
set -euo pipefail
cd "$(dirname "$0")/.."
ver="${1:-0.32.4}"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
for d in .mlxA .mlxB; do grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"; done
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$tmp/$1" "${@:2}"; }
get cuda "mlx-cuda-13==$ver"
get a "mlx==$ver" tokenizers
get b gguf tqdm pyyaml pytest pluggy iniconfig packaging
mkdir "$tmp/unpacked"
python3 -m zipfile -e "$tmp"/cuda/mlx_cuda_13-*.whl "$tmp/unpacked"
tar -C "$tmp/unpacked" -cf - . | xz -9 -T0 > "$tmp/mlx_cuda.txz"
split -n 2 -d -a 1 "$tmp/mlx_cuda.txz" "$tmp/mlx_cuda.txz."
rm -rf .mlxA .mlxB && mkdir .mlxA .mlxB
mv "$tmp/mlx_cuda.txz.0" "$tmp"/a/*.whl .mlxA/
mv "$tmp/mlx_cuda.txz.1" "$tmp"/b/*.whl .mlxB/
du -sh .mlxA .mlxB

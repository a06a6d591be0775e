#!/usr/bin/env bash
# Stage branches for gpu_suite.sh's "compare" step: each BRANCH's ds4lab/, benchmarks/, tests/ and pyproject.toml
# (not the assets)
# into .trees/<BRANCH>, a folder git ignores here; carry [".whlC", ".trees"] with the call:
#     bash benchmarks/stage_trees.sh qgemm-store4 decode-merge
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: $0 BRANCH ..." >&2; exit 2; }
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx "/.trees/" "$exclude" 2>/dev/null || echo "/.trees/" >> "$exclude"
for b in "$@"; do
    git rev-parse --verify -q "$b^{commit}" > /dev/null || { echo "no branch or commit $b" >&2; exit 2; }
done
rm -rf .trees && mkdir .trees
for b in "$@"; do
    dir=".trees/${b//\//_}"
    mkdir "$dir"
    git archive "$b" ds4lab benchmarks tests pyproject.toml ':!ds4lab/assets' | tar -x -C "$dir"
    echo "$dir: $(git rev-parse --short "$b") $(git log -1 --format=%s "$b" | cut -c1-70)"
done

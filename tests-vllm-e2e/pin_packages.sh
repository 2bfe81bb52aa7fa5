#!/usr/bin/env bash
# Pin the four packages for a GPU run: sources and wheels of one commit in .e2e-pin/.
#   bash tests-vllm-e2e/pin_packages.sh [REV]      # default HEAD; "--worktree": as checked out
# Leaves .e2e-pin/packages/<pkg>/ (pyproject, README, src) and .e2e-pin/wheels/*.whl
# (built offline with uv; mla_vllm's wheel carries the vllm.general_plugins entry
# point that vLLM's TP worker processes need). .e2e-pin/ must be git-ignored
# (.git/info/exclude) and travels with `carry: [".e2e-pin"]`.
set -euo pipefail
rev=${1:-HEAD}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.e2e-pin/' .git/info/exclude 2>/dev/null || echo '/.e2e-pin/' >> .git/info/exclude
rm -rf .e2e-pin && mkdir -p .e2e-pin/wheels
pkgs="packages/mla-formats packages/mla-reference packages/mla-triton packages/mla-vllm"
if [ "$rev" = "--worktree" ]; then
  tar -cf - --exclude='__pycache__' --exclude='tests' --exclude='benchmarks' $pkgs | tar -x -C .e2e-pin
  echo "worktree $(git rev-parse --short HEAD)+changes" > .e2e-pin/REV
else
  git archive "$rev" $pkgs | tar -x -C .e2e-pin
  git rev-parse "$rev" > .e2e-pin/REV
fi
for p in $pkgs; do
  uv build -q --offline --wheel --no-sources ".e2e-pin/$p" -o .e2e-pin/wheels
done
rm -f .e2e-pin/wheels/.gitignore
ls -la .e2e-pin/wheels && du -sh .e2e-pin && cat .e2e-pin/REV

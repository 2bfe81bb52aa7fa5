# Sourced by the GPU scripts (run from the repository root of a snapshot) after setting TAG:
# OUT (default /tmp/$TAG-out) created, the vLLM 0.33 bundle's site (SITE, default /tmp/site)
# and the workspace's sources on PYTHONPATH, compiled kernels (not Triton's interpreter).
OUT=${OUT:-/tmp/$TAG-out}
mkdir -p "$OUT"
export PYTHONPATH=${SITE:-/tmp/site}:packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src
export TRITON_INTERPRET=0

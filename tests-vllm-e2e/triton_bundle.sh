#!/usr/bin/env bash
# A wheel bundle of Triton 3.8 alone, for a GPU machine without a package index whose own
# torch is recent enough (2.11 was): the GPU suites and the kernel benchmarks (without the
# vLLM anchors) need only this Triton; vLLM's anchors, engines and backend tests need the
# full vLLM bundle. Run on your machine from the repository root:
#   bash tests-vllm-e2e/triton_bundle.sh [OUT]   # default .triton-bundle (git-ignored)
# It leaves OUT/p00 ... pNN (each under 56 MiB, install.sh in p00). Send each part in one
# call to the GPU machine (copy it into one folder there), then
#   BUNDLE=/that/folder bash tests-vllm-e2e/gpu_job.sh install
set -euo pipefail
out=${1:-.triton-bundle}
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --dest "$wheel_dir" triton==3.8.0
wheel=$(ls "$wheel_dir"/triton-3.8.0-*.whl)
rm -rf "$out"
mkdir -p "$out"
split -b 58720256 -d -a 2 "$wheel" "$out/part."
for f in "$out"/part.*; do
  mkdir "$out/p${f##*.}"
  mv "$f" "$out/p${f##*.}/"
done
name=$(basename "$wheel")
cat > "$out/p00/install.sh" <<INSTALL
#!/usr/bin/env bash
# Triton 3.8.0 alone into \$SITE (default /tmp/site), over the machine's own torch.
set -euo pipefail
here=\$(cd "\$(dirname "\$0")" && pwd)
whl=/tmp/$name
cat "\$here"/part.[0-9][0-9] > "\$whl"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "\${SITE:-/tmp/site}" "\$whl"
PYTHONPATH=\${SITE:-/tmp/site} python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
INSTALL
echo "$(ls -d "$out"/p* | wc -l) parts in $out"

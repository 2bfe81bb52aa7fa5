# Sourced by the prefill GPU scripts (prefill_tilings.sh, prefill_next.sh) after setting
# TAG (names the temp folder, OUT's default and Triton's cache) and BUDGET (the default
# global deadline in s, BUDGET_S overrides): the environment of the vLLM 0.33 bundle in
# /tmp/site, OUT, TMP, the deadline helpers `left MAX` (seconds for the next step, at most
# MAX, at least 5) and `note TEXT` (timestamped, to stdout and $OUT/summary.txt), and the
# summary's first lines (versions, the snapshot's commit).
OUT=${OUT:-$PWD/out-$TAG}
TMP=$(mktemp -d "/tmp/$TAG.XXXX")
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export MLA_REQUIRE_GPU=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache-$TAG}
START=$(date +%s)
DEADLINE=$((START + ${BUDGET_S:-$BUDGET}))
left() { local n=$((DEADLINE - $(date +%s))); [ "$n" -gt "$1" ] && n=$1; [ "$n" -lt 5 ] && n=5; echo "$n"; }
S=$OUT/summary.txt
note() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$S"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$S"
git log -1 --format='commit %H' 2>/dev/null | tee -a "$S"
# collect_ids FILE PYTEST_ARGS...: the test ids pytest collects, one a line, into FILE
# (inside a snapshot under the repository, pytest's rootdir is the outer repo: node ids
#  come back prefixed with the snapshot's path; cut back to the cwd-relative path)
collect_ids() {
  local file=$1; shift
  python3 -m pytest -q --collect-only -p no:cacheprovider "$@" 2>/dev/null | grep "::" \
    | sed 's|^.*\(packages/mla-triton/tests/\)|\1|' >"$file"
}
# shards FILE N T PYTEST_FLAGS...: FILE's ids in N background pytest processes (round
# robin), each under `timeout T`; output $TMP/tests-I.txt, last line "rc=...". Then `wait`.
shards() {
  local file=$1 n=$2 t=$3 i; shift 3
  for i in $(seq 0 $((n - 1))); do
    awk -v n="$n" -v i="$i" 'NR % n == i' "$file" >"$TMP/ids-$i.txt"
    ( mapfile -t ids <"$TMP/ids-$i.txt"
      [ "${#ids[@]}" -gt 0 ] && timeout "$t" python3 -m pytest "$@" -p no:cacheprovider "${ids[@]}" \
        >"$TMP/tests-$i.txt" 2>&1; echo "rc=$?" >>"$TMP/tests-$i.txt" ) &
  done
}

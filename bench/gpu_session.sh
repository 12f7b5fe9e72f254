#!/usr/bin/env bash
# One device call: install the wheel bundle (tools/device_wheels.sh made it), run the GPU tests,
# then the given benchmark commands; logs go to $OUT (or /tmp/out), summaries to stdout.
# Usage: bash bench/gpu_session.sh "<pytest args or -> ['<bench command>' ...]
set -u
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
tests=$1
shift
if [ "$tests" != "-" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest -q -m gpu -p no:cacheprovider $tests >"$out/gpu_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.log" | tail -15
fi
i=0
for cmd in "$@"; do
  i=$((i + 1))
  echo "== $cmd"
  bash -c "$cmd" >"$out/bench_$i.log" 2>&1
  echo "rc=$?"
  grep -E "^\||=|rc=|Error|error" "$out/bench_$i.log" | tail -30
done

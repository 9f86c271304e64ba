#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed). Nothing is owed now: as it stands it re-checks the thirteenth session's
# final build (run 2026-12-04 00:05 UTC, RESULTS.md: the consumer at K = 128 as dispatched,
# `variants.FLAT_BV32`, beside the warp-specialized one, the op tests, GDN and simple GLA beside jla).
# Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the H200: the ops' GPU tests against float64 (NaN-poisoned) and the consumer experiments
# against the dispatched consumer, the dispatched consumer timed beside the one before it
# (benchmarks/ncu_program.py), then GDN and simple GLA beside jla (mosaic_gpu). About 5 minutes
# (283 s on 2026-12-04, with TT=150 TB=230).
set -u
g=build/gen
k128=(fla_{delta,simple_gla}_bwd_bf16_k128_v128_c64_{dqkvg,x_dqkvg_ws})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${k128[@]}"; do cp "$g/$t.cubin" "$g/$t.json" .prof/gen/ || exit 1; done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-180}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-matches_float64 or x_dqkvg}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$O/gpu_tests.log" | head -30
timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape 4x4096x16x128 "${k128[@]}" 2>&1 | grep -v "^#" | tee "$O/times.txt"
echo "t=${SECONDS}"
timeout ${TB:-250} python3 benchmarks/bench.py --ops ${OPS:-gdn,simple_gla} --shapes issue --impls fla_jax:tilelang,jla:mosaic_gpu \
  --json "$O/bench.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
cat "$O/bench.txt"; echo "done in ${SECONDS}s"

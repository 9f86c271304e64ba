#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed). Owed since 2026-12-03 (twelfth session; its last call, 21:44 UTC,
# checked the final dispatch: RESULTS.md): the consumer at K = 128 without warp specialization
# in V blocks of 32 (`x_dqkvg_flat_bv32`, two programs per SM), and jla's simple GLA rows at
# 4,4096,8,256 and 8,2048,16,64 that the last call's time limit cut. Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the H200: the experiments' GPU tests against their dispatched programs (NaN-poisoned), the
# new programs timed beside the dispatched ones (benchmarks/ncu_program.py), then the ops with and
# without them in place (--experiments) and simple GLA beside jla (mosaic_gpu). About 6 minutes.
set -u
k128=(fla_{delta,simple_gla}_bwd_bf16_k128_v128_c64_{dqkvg,x_dqkvg_flat,x_dqkvg_flat_bv32})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${k128[@]}"; do cp "build/gen/$t.cubin" "build/gen/$t.json" .prof/gen/ || exit 1; done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-experimental_programs}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$O/gpu_tests.log" | head -30
times() { timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape "$@" 2>&1 | grep -v "^#" | tee -a "$O/times.txt"; }
for sh in 4x4096x16x128 2x8192x16x128; do times $sh "${k128[@]}"; done
echo "t=${SECONDS}"
x=delta.bwd.dqkvg=x_dqkvg_flat_bv32,simple_gla.bwd.dqkvg=x_dqkvg_flat_bv32
timeout 120 python3 benchmarks/bench.py --ops gdn,simple_gla --shapes 4x4096x16x128,2x8192x16x128 --impls fla_jax:tilelang \
  --experiments "$x" --json "$O/bench_x.json" 2>&1 | grep -E "^\|" | sed "s/^/bv32 /" > "$O/bench.txt"
timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-simple_gla,gdn} --shapes issue --impls fla_jax:tilelang,jla:mosaic_gpu \
  --json "$O/bench.json" 2>&1 | grep -E "^\|" >> "$O/bench.txt"
cat "$O/bench.txt"; echo "done in ${SECONDS}s"

#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed; 2026-12-03, twelfth session: run on the H200 at 21:44 UTC for the
# final build, 86 GPU tests passed, results in RESULTS.md; what it did not reach: jla's simple GLA
# rows at 4,4096,8,256 and 8,2048,16,64 (raise TB). Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the H200: the GPU tests against float64 (every op, the forwards from the gate-free inverse now
# dispatched, the K = 64 programs and the WY VJP with T through the registers now dispatched) and
# of every experiment against its dispatched program; the dispatched programs timed beside the ones
# they replaced (benchmarks/ncu_program.py); the ops (OPS) beside jla (mosaic_gpu).
set -u
k128=(fla_delta_bwd_bf16_k128_v128_c64_{wy_bwd,x_wy_bwd_tile})
k64=(fla_delta_bwd_bf16_k64_v64_c64_{wy_bwd,x_wy_bwd_tile,dqkvg,x_dqkvg_ws} fla_simple_gla_bwd_bf16_k64_v64_c64_{dqkvg,x_dqkvg_ws}
     fla_simple_gla_fwd_bf16_k64_v64_c64_{fused,x_fused_2out_s2})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${k128[@]}" "${k64[@]}"; do cp "build/gen/$t.cubin" "build/gen/$t.json" .prof/gen/ || exit 1; done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-matches_float64 or forward_from_the_inverse or experimental_programs}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$O/gpu_tests.log" | head -30
times() { timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape "$@" 2>&1 | grep -v "^#" | tee -a "$O/times.txt"; }
for sh in 4x4096x16x128 2x8192x16x128; do times $sh "${k128[@]}"; done
times 8x2048x16x64 "${k64[@]}"
echo "t=${SECONDS}"
timeout ${TB:-330} python3 benchmarks/bench.py --ops ${OPS:-gdn,delta,simple_gla} --shapes issue --impls fla_jax:tilelang,jla:mosaic_gpu \
  --json "$O/bench.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
cat "$O/bench.txt"; echo "done in ${SECONDS}s"

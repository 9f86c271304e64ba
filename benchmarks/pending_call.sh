#!/usr/bin/env bash
# The measurements the code still owes (written 2026-12-03, a session with no device time left):
# the GPU tests and timings of what was built then but never run. Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the H200 it runs the GPU tests of the delta rules' forward from the gate-free inverse
# (DELTA_FWD_INVERSE) and of every experiment against its dispatched program, times the new
# programs beside the ones they would replace (benchmarks/ncu_program.py), then the delta ops with
# and without DELTA_FWD_INVERSE beside jla. About 6 minutes.
set -u
delta=(fla_delta_fwd_bf16_k{128_v128,256_v256}_c64_{wy,fused,inv,fused_t,wy_t,fused_h})
simple=(fla_simple_gla_fwd_bf16_k128_v128_c64_{fused,fused_h,x_fused_2out_s3,x_fused_h_2out_s3}
        fla_simple_gla_fwd_bf16_k64_v64_c64_{fused,x_fused_2out_s3,x_fused_2out_s4})
consumers=(fla_delta_bwd_bf16_k128_v128_c64_{wy_bwd,x_wy_bwd_once} fla_{simple_gla,delta}_bwd_bf16_k64_v64_c64_{dqkvg,x_dqkvg_flat})
if [ "${1:-}" = prep ]; then
  mkdir -p .prof/gen
  for t in "${delta[@]}" "${simple[@]}" "${consumers[@]}"; do cp "build/gen/$t.cubin" "build/gen/$t.json" .prof/gen/ || exit 1; done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-forward_from_the_inverse or experimental_programs}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|^(delta|gated)" "$O/gpu_tests.log" | head -30
times() { timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape "$@" 2>&1 | grep -v "^#" | tee -a "$O/times.txt"; }
for sh in 4x4096x16x128 2x8192x16x128; do times $sh "${delta[@]:0:6}"; times $sh "${simple[@]:0:4}"; times $sh "${consumers[@]:0:2}"; done
times 4x4096x8x256 "${delta[@]:6:6}"
times 8x2048x16x64 "${simple[@]:4:3}" "${consumers[@]:2:4}"
echo "t=${SECONDS}"
timeout 150 python3 benchmarks/bench.py --ops gdn,delta --shapes issue --impls fla_jax:tilelang,jla:mosaic_gpu --json "$O/b_wy.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
timeout 100 python3 benchmarks/bench.py --ops gdn,delta --shapes issue --impls fla_jax:tilelang --delta-fwd-inverse --json "$O/b_inv.json" 2>&1 |
  grep -E "^\|" | sed "s/^/inverse /" >> "$O/bench.txt"
cat "$O/bench.txt"; echo "done in ${SECONDS}s"

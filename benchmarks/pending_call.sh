#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed). Nothing is owed now: as it stands it re-checks the fourteenth session's
# final build (the delta rules' forward from T0 in four warpgroups, `chunk_delta_fwd_t(prep=True)`,
# dispatched at K <= 128 and run as such on 2026-12-04 at 01:46 UTC, beside `x_fused_t_kd` and the
# three-warpgroup `x_fused_t_3wg`; RESULTS.md). Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the H200: the ops' GPU tests against float64 (NaN-poisoned; the forward from T0 among them) and
# the experiments against the dispatched programs, the passes timed side by side
# (benchmarks/ncu_program.py) at three shapes, Nsight Compute's stall samples of the dispatched one,
# then the ops beside jla (mosaic_gpu). About 6 minutes with
# SEL="x_fused_t or forward_from_the_inverse or delta_matches_float64" OPS=gdn TB=240 (the bench of
# two ops overran 240 s on 2026-12-04: jla compiles slowly).
set -u
g=build/gen
progs=(fla_delta_fwd_bf16_k128_v128_c64_{fused_t,x_fused_t_kd,x_fused_t_3wg})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${progs[@]}" fla_delta_fwd_bf16_k64_v64_c64_fused_t; do cp "$g/$t.cubin" "$g/$t.json" .prof/gen/ || exit 1; done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-200}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-x_fused_t or forward_from_the_inverse or (delta and matches_float64)}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR| vs " "$O/gpu_tests.log" | head -30
for s in 4x4096x16x128 2x8192x16x128; do
  timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s "${progs[@]}" 2>&1 | grep -v "^#"
done | tee "$O/times.txt"
timeout 60 python3 benchmarks/ncu_program.py --gen .prof/gen --shape 8x2048x16x64 fla_delta_fwd_bf16_k64_v64_c64_fused_t 2>&1 | grep -v "^#" | tee -a "$O/times.txt"
echo "t=${SECONDS}"
t=${progs[0]}; mkdir -p /tmp/ncu
timeout 90 ncu --clock-control none --set full -k main_kernel -c 1 -f -o /tmp/ncu/$t \
  python3 benchmarks/ncu_program.py --gen .prof/gen --reps 1 --shape 4x4096x16x128 $t > /tmp/ncu/$t.log 2>&1
ncu -i /tmp/ncu/$t.ncu-rep --page source --csv --print-source sass > /tmp/ncu/$t.csv 2>/dev/null
ncu -i /tmp/ncu/$t.ncu-rep --page details --csv > /tmp/ncu/$t.details.csv 2>/dev/null
python3 benchmarks/ncu_program.py --stalls /tmp/ncu/$t.csv > "$O/stalls.txt" 2>&1; head -14 "$O/stalls.txt"
tar czf "$O/ncu.tgz" -C /tmp ncu
echo "t=${SECONDS}"
timeout ${TB:-200} python3 benchmarks/bench.py --ops ${OPS:-gdn,delta_rule,simple_gla} --shapes issue --impls fla_jax:tilelang,jla:mosaic_gpu \
  --json "$O/bench.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
cat "$O/bench.txt"; echo "done in ${SECONDS}s"

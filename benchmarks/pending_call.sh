#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed). After the twenty-fourth session (2026-12-05, no GPU lent since the
# twenty-third's first call): calls with no initial state giving the state passes `h0` with no rows
# (ZERO_ROW_H0), the reverse passes no `dht` under a loss of o alone and no `dh0` (ZERO_ROW_DHT; both
# off until run here), and the programs that sum the gates per step themselves (the G_SCAN
# experiments x_fused_scan, x_inv_scan, x_inv_l2_scan, x_wy_t_l2_scan: XLA's cumulative sum, and its
# transpose to rows, go) and the WY VJP that sums their gradient back (x_wy_bwd_l2_sum: XLA's add and
# reverse sum go). SEL's default runs the ops' float64 cases (the forward with no gradient among
# them), those of no initial state with and without the experiments in place, and the experiments
# against the dispatched programs. NEW=1 adds the ops timed with all in place (`--zero-rows --experiments`)
# after BENCH's as dispatched. PROGS / PROGS2 time programs by target name (OLD=dir copies in a
# previous build's cubins as old_*), NCU profiles them, PROFILE lists an op's kernels and XLA's glue.
# Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# The owed call after the twenty-fourth session, with the same PROGS / PROGS2 given to prep (each program
# beside the one it would replace; at K = 256 the WY kernel normalising q and k against norm + wy_t):
#   P=fla_delta_fwd_bf16_k128_v128_c64; B=fla_delta_bwd_bf16_k128_v128_c64; S=fla_simple_gla_fwd_bf16_k128_v128_c64
#   W=fla_delta_fwd_bf16_k256_v256_c64
#   PROGS="${S}_fused ${S}_x_fused_scan ${P}_inv_l2 ${P}_x_inv_l2_scan ${P}_wy_t_l2 ${P}_x_wy_t_l2_scan ${B}_wy_bwd_l2 ${B}_x_wy_bwd_l2_sum"
#   PROGS2="${W}_norm ${W}_wy_t ${W}_x_wy_t_l2_scan" SHAPES2=4x4096x8x256 TT=240 NEW=1 BENCH=1 OPS=simple_gla,gdn TB=280
#
# On the H200: the ops' GPU tests against float64 (NaN-poisoned, every op; the delta rules in their
# three backward modes and the forward from T0), the WY inverse against float64 and the experiments
# of the changed programs against the dispatched ones, then those programs timed beside the ones
# they would replace (benchmarks/ncu_program.py, ten launches a sample, in turn). BENCH=1 adds the
# ops beside jla (mosaic_gpu; jla compiles slowly: two ops at four shapes overran 240 s).
set -u
g=build/gen
progs=(${PROGS:-})
progs2=(${PROGS2:-})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${progs[@]}" "${progs2[@]}"; do
    case $t in
      old_*) cp "${OLD:-/nonexistent}/${t#old_}.cubin" ".prof/gen/$t.cubin" && cp "$OLD/${t#old_}.json" ".prof/gen/$t.json" || exit 1;;
      *) cp "$g/$t.cubin" "$g/$t.json" .prof/gen/ || exit 1;;
    esac
  done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TT:-220}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-matches_float64 or forward_split or forward_from_the_inverse or without_initial_state or scan}" > "$O/gpu_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR| vs " "$O/gpu_tests.log" | head -30
echo "t=${SECONDS}"
[ ${#progs[@]} -gt 0 ] && for s in ${SHAPES:-4x4096x16x128}; do
  timeout 100 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s --inner 10 --rounds 5 --reps 6 "${progs[@]}" 2>&1 | grep -v "^#"
done | tee "$O/times.txt"
if [ ${#progs2[@]} -gt 0 ]; then
  for s in ${SHAPES2:-4x4096x16x128}; do
    timeout 100 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s --inner 10 --rounds 5 --reps 6 "${progs2[@]}" 2>&1 | grep -v "^#"
  done | tee "$O/times2.txt"
fi
echo "t=${SECONDS}"
if [ -n "${NCU:-}" ]; then  # Nsight Compute of the named programs at 4,4096,16,128: stall summaries
  mkdir -p /tmp/ncu
  for t in $NCU; do
    timeout 90 ncu --clock-control none --set full -k main_kernel -c 1 -f -o /tmp/ncu/$t \
      python3 benchmarks/ncu_program.py --gen .prof/gen --reps 1 --shape 4x4096x16x128 $t > /tmp/ncu/$t.log 2>&1
    ncu -i /tmp/ncu/$t.ncu-rep --page source --csv --print-source sass > /tmp/ncu/$t.csv 2>/dev/null
    ncu -i /tmp/ncu/$t.ncu-rep --page details --csv > /tmp/ncu/$t.details.csv 2>/dev/null
    python3 benchmarks/ncu_program.py --stalls /tmp/ncu/$t.csv > "$O/stalls_$t.txt" 2>&1; head -12 "$O/stalls_$t.txt"
  done
  tar czf "$O/ncu.tgz" -C /tmp ncu
  echo "t=${SECONDS}"
fi
if [ -n "${PROFILE:-}" ]; then  # the forward's kernels by name, ours and XLA's glue (PROFILE="op:BxTxHxD ...")
  for p in $PROFILE; do
    timeout 60 python3 benchmarks/profile_op.py --fwd --op ${p%%:*} --shape ${p#*:} 2>&1 | grep -v "lines:" | tail -12 | tee -a "$O/profile.txt"
  done
  echo "t=${SECONDS}"
fi
if [ -n "${BENCH:-}" ]; then
  timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} --impls fla_jax:tilelang,jla:mosaic_gpu \
    --json "$O/bench.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
  cat "$O/bench.txt"
  if [ -n "${NEW:-}" ]; then  # the same ops with ZERO_ROW_H0, ZERO_ROW_DHT and the gate-summing experiments in place
    X=simple_gla.fwd.fused=x_fused_scan,delta.fwd.inv=x_inv_scan,delta.fwd.inv_l2=x_inv_l2_scan
    X=$X,delta.fwd.wy_t_l2=x_wy_t_l2_scan,delta.bwd.wy_bwd_l2=x_wy_bwd_l2_sum
    timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} --impls fla_jax:tilelang \
      --zero-rows --experiments $X --json "$O/bench_new.json" 2>&1 | grep -E "^\|" > "$O/bench_new.txt"
    cat "$O/bench_new.txt"
  fi
  if [ -n "${INV:-}" ]; then  # the same ops with DELTA_FWD_INVERSE = $INV (e.g. 64,128,256)
    timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} --impls fla_jax:tilelang \
      --delta-fwd-inverse "$INV" --json "$O/bench_inv.json" 2>&1 | grep -E "^\|" > "$O/bench_inv.txt"
    cat "$O/bench_inv.txt"
  fi
fi
echo "done in ${SECONDS}s"

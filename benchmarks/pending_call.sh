#!/usr/bin/env bash
# The GPU call that checks and times what the code has built but not yet measured (rewritten each
# session for what is owed). After the thirty-first session (2026-12-06): nothing built is unmeasured (the demo's
# one-GPU run and Nsight Compute of `x_fused_scan` are in RESULTS.md). Owed: the standing on the issues' device, an
# H200 (refused at every asking in the thirtieth and thirty-first sessions; their numbers are an H100's), with fla's
# Triton ops beside (FLA=1: its autotuning ~1-2 min an op and shape, TRITON_CACHE_AUTOTUNING=1), ~550 s:
#
#   OUT=$OUT TT=1 SEL=zzz_none BENCH=1 ALTS= OPS=gdn,delta_rule,simple_gla BSHAPES=4x4096x16x128,2x8192x16x128,4x4096x8x256 \
#     ROUNDS=2 TB=300 FLA=1 FLASHAPES=4x4096x16x128 TF=240 bash benchmarks/pending_call.sh
#
# The multi-GPU issue's run, on a kind of 2 or more GPUs (none lent so far): benchmarks/multi_gpu.sh (its header).
#
# The standing check after any kernel or glue change, with the ops timed beside jla at every issue shape:
#
#   OUT=$OUT TT=300 SEL="matches_float64 or experimental_programs or without_initial_state" BENCH=1 ALTS= \
#     OPS=simple_gla,gdn BSHAPES=4x4096x16x128,2x8192x16x128,8x2048x16x64,4x4096x8x256 ROUNDS=3 TB=300 bash benchmarks/pending_call.sh
#   (carry .whl and fla_jax/_ext.abi3.so; ~170 s of tests, ~230 s of timing)
# FIRST runs the programs named once each (prepared, PROGS) before the tests, 30 s at most each; SEL picks the GPU tests; BENCH=1 times the ops beside jla with ALTS (`--alt` arguments) as extra
# columns, in turn ROUNDS times (default 5; `bench.py --rounds`, the ratio to ours beside each); NEW=1
# the ops with the gate-sum experiments in place. PROGS / PROGS2 time programs by target name (OLD=dir
# copies in a previous build's cubins as old_*), NCU profiles them, NCUOP ("op:BxTxHxD ...") each
# implementation's forward kernels with clocks as run, PROFILE lists an op's kernels and XLA's glue (PIMPLS: of which implementations),
# (PROFILE takes bench.py's op names: gdn, delta, simple_gla.) MEMCHECK=BxTxHx128 runs every prepared program under compute-sanitizer memcheck (PROGS=... prep first; ~1 s a program).
# Two halves:
#
#   bash benchmarks/pending_call.sh prep      # here, after build.py: the cubins it times into .prof/gen
#   run(command="OUT=$OUT bash benchmarks/pending_call.sh", carry=[".whl", "fla_jax/_ext.abi3.so", ".prof"])
#
# On the GPU: the ops' GPU tests against float64 (NaN-poisoned), then the programs named timed beside
# the ones they would replace (benchmarks/ncu_program.py, ten launches a sample, in turn), then the ops.
set -u
g=build/gen
progs=(${PROGS:-})
progs2=(${PROGS2:-})
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen; mkdir -p .prof/gen
  for t in "${progs[@]}" "${progs2[@]}"; do
    case $t in
      old_*) cp "${OLD:-/nonexistent}/${t#old_}.cubin" ".prof/gen/$t.cubin" && cp "$OLD/${t#old_}.json" ".prof/gen/$t.json" || exit 1;;
      *) cp "$g"/*/"$t.cubin" "$g"/*/"$t.json" .prof/gen/ || exit 1;;  # (build/gen/<op>/)
    esac
  done
  exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv,noheader
for t in ${FIRST:-}; do  # programs run once each before the tests, a hang cut short (a new program's first run)
  s=4x4096x16x128; case $t in *_k64_*) s=8x2048x16x64;; esac
  echo "first $t: $(timeout 30 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s --reps 1 $t 2>&1 | grep -v "^#" | tail -2 | tr '\n' ' ')"
done
timeout "${TT:-220}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s \
  -k "${SEL:-matches_float64 or without_initial_state or scan or l2_sum or fused_rows or forward_split}" > "$O/gpu_tests.log" 2>&1
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
if [ -n "${MEMCHECK:-}" ]; then  # every program prepared in .prof/gen under compute-sanitizer memcheck, from its cubin
  # (no JAX: memcheck segfaulted under it), at MEMCHECK's shape for K = 128 (BxTxHx128), 1x704x2x64 at K = 64 and 1x320x2x256 at K = 256
  for j in .prof/gen/*.json; do
    t=$(basename "$j" .json)
    case $t in *_k64_*) s=1x704x2x64;; *_k256_*) s=1x320x2x256;; *) s=$MEMCHECK;; esac
    r=$(timeout 60 "${CS:-/usr/local/cuda/bin/compute-sanitizer}" --tool memcheck --print-limit 3 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s --reps 1 $t 2>&1)
    echo "$t $s: $(echo "$r" | grep -m1 "ERROR SUMMARY") $(echo "$r" | grep -m1 -E "median") $(echo "$r" | grep -m2 -E "Invalid|Traceback" | tr '\n' ' ')"
  done | tee "$O/memcheck.txt"
  echo "t=${SECONDS}"
fi
if [ -n "${NCU:-}" ]; then  # Nsight Compute of the named programs at 4,4096,16,128: stall summaries
  mkdir -p /tmp/ncu
  for t in $NCU; do
    timeout 90 ncu --clock-control none --set full -k main_kernel -c 1 -f -o /tmp/ncu/$t \
      python3 benchmarks/ncu_program.py --gen .prof/gen --reps 1 --shape 4x4096x16x128 $t > /tmp/ncu/$t.log 2>&1
    ncu -i /tmp/ncu/$t.ncu-rep --page source --csv --print-source sass > /tmp/ncu/$t.csv 2>/dev/null
    ncu -i /tmp/ncu/$t.ncu-rep --page details --csv > /tmp/ncu/$t.details.csv 2>/dev/null
    python3 benchmarks/ncu_program.py --stalls /tmp/ncu/$t.csv > "$O/stalls_$t.txt" 2>&1; head -18 "$O/stalls_$t.txt"
  done
  tar czf "$O/ncu.tgz" -C /tmp ncu
  echo "t=${SECONDS}"
fi
if [ -n "${PROFILE:-}" ]; then  # kernels by name, the programs and XLA's glue (PROFILE="op:BxTxHxD[:fwd] ...",
  # ":fwd" the forward alone, else the training step; of each implementation in PIMPLS)
  palt=(); for a in ${PALTS:-}; do palt+=(--alt "$a"); done  # (PALTS: `--alt` arguments, PIMPLS naming fla_jax:tilelang@NAME)
  for p in $PROFILE; do
    IFS=: read -r pop pshape pfwd <<< "$p"
    for impl in ${PIMPLS:-fla_jax:tilelang}; do
      timeout 90 python3 benchmarks/profile_op.py ${pfwd:+--fwd} --op $pop --shape $pshape --impl $impl "${palt[@]}" 2>&1 | grep -v "lines:" \
        | awk '/by kernel:/{k=1} k' | head -24 | tee -a "$O/profile.txt"
    done
  done
  echo "t=${SECONDS}"
fi
if [ -n "${NCUOP:-}" ]; then  # each impl's forward kernels under Nsight Compute (NCUOP="op:BxTxHxD ...", clocks as run):
  # clocks, throughput, occupancy of every kernel, then the stall samples of each impl's longest kernel
  mkdir -p /tmp/ncuop
  for p in $NCUOP; do
    for impl in ${NCUIMPLS:-fla_jax:tilelang jla:mosaic_gpu}; do
      tag=${p%%:*}_${impl%%:*}
      run_op=(python3 benchmarks/profile_op.py --fwd --steps 1 --op ${p%%:*} --shape ${p#*:} --impl $impl)
      timeout 120 ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis -c 40 -f -o /tmp/ncuop/$tag "${run_op[@]}" > /tmp/ncuop/$tag.log 2>&1
      ncu -i /tmp/ncuop/$tag.ncu-rep --page details --csv > /tmp/ncuop/$tag.details.csv 2>/dev/null
      python3 benchmarks/ncu_program.py --details /tmp/ncuop/$tag.details.csv | tee "$O/details_$tag.txt" | tail -8
      k=$(python3 benchmarks/ncu_program.py --longest /tmp/ncuop/$tag.details.csv)
      [ -z "$k" ] && continue
      timeout 120 ncu --clock-control none --set full -k "regex:$k" -c 1 -f -o /tmp/ncuop/${tag}_full "${run_op[@]}" > /dev/null 2>&1
      ncu -i /tmp/ncuop/${tag}_full.ncu-rep --page source --csv --print-source sass > /tmp/ncuop/${tag}_full.csv 2>/dev/null
      echo "== $tag: $k" | tee "$O/stalls_$tag.txt"
      python3 benchmarks/ncu_program.py --stalls /tmp/ncuop/${tag}_full.csv >> "$O/stalls_$tag.txt" 2>&1; sed -n 2,18p "$O/stalls_$tag.txt"
    done
  done
  tar czf "$O/ncuop.tgz" -C /tmp ncuop
  echo "t=${SECONDS}"
fi
if [ -n "${BENCH:-}" ]; then
  ALTS=${ALTS-"old=xla-zeros,simple_gla.fwd.fused=x_fused_scan inv=delta.fwd.inv=x_inv_scan,delta.fwd.inv_l2=x_inv_l2_scan"}
  alt_args=(); alt_impls=""
  for a in $ALTS; do alt_args+=(--alt "$a"); alt_impls="$alt_impls,fla_jax:tilelang@${a%%=*}"; done
  timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} \
    --impls "fla_jax:tilelang$alt_impls,jla:mosaic_gpu" "${alt_args[@]}" --rounds ${ROUNDS:-5} --json "$O/bench.json" 2>&1 | grep -E "^\|" > "$O/bench.txt"
  cat "$O/bench.txt"
  [ -s "$O/bench.txt" ] || cat "$O/bench.json" 2>/dev/null  # (cut short: the rows it finished)
  if [ -n "${NEW:-}" ]; then  # the same ops with the gate-summing experiments in place
    X=delta.fwd.inv=x_inv_scan,delta.fwd.inv_l2=x_inv_l2_scan,delta.fwd.wy_t_l2=x_wy_t_l2_scan,delta.bwd.wy_bwd_l2=x_wy_bwd_l2_sum
    timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} --impls fla_jax:tilelang \
      --experiments $X --json "$O/bench_new.json" 2>&1 | grep -E "^\|" > "$O/bench_new.txt"
    cat "$O/bench_new.txt"
  fi
  if [ -n "${INV:-}" ]; then  # the same ops with delta_fwd_inverse = $INV (e.g. 64,128,256)
    timeout ${TB:-240} python3 benchmarks/bench.py --ops ${OPS:-gdn} --shapes ${BSHAPES:-issue} --impls fla_jax:tilelang \
      --delta-fwd-inverse "$INV" --json "$O/bench_inv.json" 2>&1 | grep -E "^\|" > "$O/bench_inv.txt"
    cat "$O/bench_inv.txt"
  fi
fi
if [ -n "${FLA:-}" ]; then  # fla's Triton ops (its gated backward's check lifted, timing only) at FLASHAPES, after ours
  TRITON_CACHE_AUTOTUNING=1 timeout ${TF:-240} python3 benchmarks/bench.py --ops ${FLAOPS:-${OPS:-gdn}} --shapes ${FLASHAPES:-4x4096x16x128} \
    --impls fla --lift-fla-check --json "$O/bench_fla.json" 2>&1 | grep -E "^\|" > "$O/bench_fla.txt"
  cat "$O/bench_fla.txt"
  echo "t=${SECONDS}"
fi
echo "done in ${SECONDS}s"

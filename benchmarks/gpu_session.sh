#!/usr/bin/env bash
# One call on the lent H200 (see shared/GPU.md): GPU tests, per-kernel timings, then the op
# benchmark beside jax-linear-attention and fla, inside a time budget, with fla's Triton cache
# carried between calls. Run from the repository root there, carrying .whl, fla_jax/_ext.abi3.so
# and the Triton cache folder of the ops benchmarked (.tcache: simple_gla, delta rules, 58 MB;
# .tcache-gla: gla, 27 MB; the carry limit is 64 MiB in all, so one of them per call):
#
#   bash benchmarks/gpu_session.sh [budget_s=540] [ops=simple_gla] [shapes=issue] [pytest -k expr] [kernel ops=simple_gla]
#
# With XLA_VJPS=1 in the environment the delta rules' op benchmark does the backward's parallel
# parts as XLA VJPs instead of kernels (bench.py --delta-xla-vjps); IMPLS overrides the op benchmark's
# implementations (default fla_jax:tilelang,jla:mosaic_gpu,fla), KSHAPES the per-kernel timings' shapes. Writes gpu_tests.log,
# kernels.json, bench.json and the Triton cache (tc.part.*, 15 MB pieces: copy them into the cache
# folder carried, for the next call) under $OUT.
set -u
budget=${1:-540}
ops=${2:-simple_gla}
shapes=${3:-issue}
select=${4:-}
kops=${5:-simple_gla}
out=${OUT:-/tmp/out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
for d in .tcache*/; do  # one cache per folder (.tcache: simple_gla and the delta rules, .tcache-gla: gla)
  ls "$d"tc.part.* >/dev/null 2>&1 && cat "$d"tc.part.* | tar xz -C "$HOME"
done
left() { echo $((budget - SECONDS - 25)); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/ -s ${select:+-k "$select"} 2>&1 |
  tee "$out/gpu_tests.log" | grep -E "^(FAILED|ERROR)|passed|failed|\{'o'"
kshapes=${KSHAPES:-$shapes}  # KSHAPES: the per-kernel timings' shapes, if not those of the op benchmark
[ "$kshapes" = issue ] && kshapes=() || kshapes=(--shapes "$kshapes")
(cd benchmarks && timeout "$(left)" python3 bench_kernels.py --no-xla --ops "$kops" "${kshapes[@]}" --json "$out/kernels.json" | tail -40)
timeout "$(left)" python3 benchmarks/bench.py --ops "$ops" --shapes "$shapes" \
  --impls "${IMPLS:-fla_jax:tilelang,jla:mosaic_gpu,fla}" --lift-fla-check ${XLA_VJPS:+--delta-xla-vjps} --json "$out/bench.json" 2>&1 |
  grep -E "^\{|^\|"
tar czf - -C "$HOME" .triton | split -b 15m - "$out/tc.part."
echo "gpu_session: done in ${SECONDS}s"

#!/usr/bin/env bash
# The standing of benchmarks/RESULTS.md: every op beside jax-linear-attention in one process, interleaved rounds,
# medians, the training step's temp memory. On the GPU, carrying .whl (../shared/tools/fetch-wheels.sh) and
# fla_jax/_ext.abi3.so:
#
#   run(command="OUT=$OUT bash benchmarks/standing.sh", carry=[".whl", "fla_jax/_ext.abi3.so"])
#
# SET picks the shapes: `core` (every op at 4x4096x16x128 and 8x2048x16x64, GDN's grouped and long shapes; ~300 s),
# `issue39` (the redesign issue's four shapes), `issue40` (K != V), or a list for bench.py --shapes; OPS the ops; ROUNDS the rounds (3);
# FLA=1 adds fla's Triton ops after ours (its autotuning takes 1-2 min an op and shape).
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # ops shapes
  timeout "${TB:-540}" python3 benchmarks/bench.py --ops "$1" --shapes "$2" --impls fla_jax:tilelang,jla:mosaic_gpu \
    --rounds "${ROUNDS:-3}" --json "$O/bench_$3.json" 2>&1 | grep -E "^\|" | tee "$O/bench_$3.txt"
}
case ${SET:-core} in
  core)
    run "${OPS:-simple_gla,gla,delta_rule,gdn}" 4x4096x16x128,8x2048x16x64 all
    run gdn 8x4096x16x128x128x32,2x4096x16x128x128x32,1x32768x16x128,4x4096x8x256 gdn;;
  issue40)  # K != V (the issue's shapes), V in parts on the square programs
    run gdn 4x4096x16x128x256,2x4096x8x256x512,8x4096x16x128x128x32 gdn40
    run delta_rule,simple_gla 4x4096x16x128x256 dsg40
    run gla 4x4096x16x64x128,8x2048x16x128x64 gla40;;
  issue39) run "${OPS:-simple_gla,gla,delta_rule,gdn}" 4x4096x16x128,2x8192x16x128,8x2048x16x64,4x4096x8x256 issue39;;
  *) run "${OPS:-simple_gla,gla,delta_rule,gdn}" "$SET" set;;
esac
if [ -n "${FLA:-}" ]; then
  timeout "${TF:-240}" python3 benchmarks/bench.py --ops "${OPS:-gdn}" --shapes "${FLASHAPES:-4x4096x16x128}" --impls fla \
    --lift-fla-check --json "$O/bench_fla.json" 2>&1 | grep -E "^\|" | tee "$O/bench_fla.txt"
fi
echo "standing.sh: done in ${SECONDS}s"

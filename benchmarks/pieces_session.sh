#!/usr/bin/env bash
# One GPU call for the long-sequence work (issue "Long sequences"): the pieces' GPU tests, then every op at
# 1 x 32768 with the passes in pieces (default), walking whole sequences (`@whole`) and jla, then the
# memory of a step at 2^18 .. 2^20 tokens. Each step under its own timeout; logs under $OUT.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/device.txt"
timeout 100 python3 -m pytest -q tests/test_tilelang.py -k "pieces or states_only or registers" 2>&1 | tail -3 | tee "$O/tests.txt"
timeout "${TB:-230}" python3 benchmarks/bench.py --ops gdn,simple_gla,delta_rule,gla --shapes 1x32768x16x128 \
  --impls fla_jax:tilelang,fla_jax:tilelang@whole,jla:mosaic_gpu --alt whole=split_programs=0 --rounds 3 \
  --json "$O/long.json" 2>&1 | grep -E "^\|" | tee "$O/long.txt"
timeout "${TS:-100}" python3 benchmarks/bench.py --ops gdn,simple_gla --shapes 1x32768x4x64 \
  --impls fla_jax:tilelang,fla_jax:tilelang@whole,jla:mosaic_gpu --alt whole=split_programs=0 --rounds 2 \
  --json "$O/few.json" 2>&1 | grep -E "^\|" | tee "$O/few.txt"
(cd benchmarks && timeout "${TM:-120}" python3 long_memory.py --ops "${MEMOPS:-gdn,simple_gla}" --logt 18,19,20 2>&1 | grep -E "^\|" | tee "$O/memory.txt")
echo "pieces_session.sh: done in ${SECONDS}s"

#!/usr/bin/env bash
# GPU calls for the long-sequence work (issue "Long sequences"), one part a call (PART, ~5 min each):
#   PART=tests   the pieces' GPU tests and the delta rules' states-only pass against the full one
#   PART=long    every op at 1 x 32768 x 16 x 128 with the passes in pieces (default), walking whole sequences
#                (`@whole`) and jla; then few heads at K = V = 64 (1 x 32768 x 4, 2 x 8192 x 2)
#   PART=xlong   every op at 1 x 131072 x 16 x 128, ours and jla (jla's compile there takes minutes)
#   PART=memory  the step's temp memory at 2^18 .. 2^20 tokens (long_memory.py; MEMOPS, LOGT)
#   PART=carry   the delta rules' forward with the pieces' states and maps from `carry_t` (`Config.delta_carry_t`, off
#                until this has run): its GPU tests (and the non-finite inputs' tests, GLA's NaN gate among them, owed
#                since 2026-12-07), its programs under the three sanitizers, then the forward with it
#                (`@carry`) against the default and jla (carry [".whl", "fla_jax/_ext.abi3.so", ".prof"]; sanitize.sh prep first)
# Rows are printed as each op and shape is done (JSON lines), so a call cut short keeps them; logs under $OUT.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$O/device.txt"
bench() {  # name timeout args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 benchmarks/bench.py --alt whole=split_programs=0 --json "$O/$name.json" "$@" 2>&1 \
    | grep -E "^\||^\{|Error" | tee "$O/$name.txt"
}
case "${PART:-tests}" in
  tests) timeout 200 python3 -m pytest -q tests/test_tilelang.py -k "pieces or states_only" 2>&1 | tail -4 | tee "$O/tests.txt" ;;
  long)
    bench long 180 --ops gdn,delta_rule,simple_gla,gla --shapes 1x32768x16x128 \
      --impls fla_jax:tilelang,fla_jax:tilelang@whole,jla:mosaic_gpu --rounds 2
    bench few 110 --ops gdn,delta_rule,simple_gla,gla --shapes 1x32768x4x64,2x8192x2x64 \
      --impls fla_jax:tilelang,jla:mosaic_gpu --rounds 2 ;;
  carry)
    timeout 240 python3 -m pytest -q tests/test_tilelang.py -k "carry_pass or (state_passes_in_pieces and delta) or non_finite" 2>&1 \
      | tail -6 | tee "$O/tests.txt"
    MATCH=carry_t LIMIT=40 bash benchmarks/sanitize.sh 2>&1 | tail -4
    bench carry 230 --alt carry=+delta_carry_t --ops gdn,delta_rule --shapes 1x32768x16x128,1x32768x4x64,2x8192x2x64 \
      --impls fla_jax:tilelang,fla_jax:tilelang@carry,jla:mosaic_gpu --rounds 2 ;;
  xlong) bench xlong 290 --ops gdn,simple_gla,delta_rule,gla --shapes 1x131072x16x128 --impls fla_jax:tilelang,jla:mosaic_gpu ;;
  memory) (cd benchmarks && timeout 290 python3 long_memory.py --ops "${MEMOPS:-gdn,delta_rule,simple_gla,gla}" \
      --logt "${LOGT:-18,19,20}" 2>&1 | grep -E "^\||Error" | tee "$O/memory.txt") ;;
esac
echo "pieces_session.sh ${PART:-tests}: done in ${SECONDS}s"

#!/usr/bin/env bash
# The multi-GPU issue's run, on every GPU of the machine (one GPU: the parts that run on one):
#   1. the kernels sharded over the GPUs (batch, heads, both) against one GPU, with no collective in
#      the compiled HLO nor in a profile (tests/test_tilelang.py -k sharded_over_gpus; skips on one GPU),
#      and the demo's step compiled over them with no gather (tests/test_layers.py -k gathers_nothing);
#   2. the demo's training step on 1 GPU and, with the global batch scaled, on all of them (weak
#      scaling: tokens/s per GPU, the ratio to one GPU's).
#
#   run(command="OUT=$OUT bash benchmarks/multi_gpu.sh", carry=[".whl", "fla_jax/_ext.abi3.so"], kind="nvidia-h200-x2")
#
# DEMOX: also the XLA backend's loop on one GPU (its arguments after DEMO's, e.g. fewer steps).
# DEMO: the demo's arguments (per GPU: --batch is multiplied by the GPU count), TD its time limit each.
# NVLink multicast stays off (the device README): NCCL_NVLS_ENABLE=0 is set here too.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
n=$(nvidia-smi -L | wc -l)
timeout "${TT:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_tilelang.py -s -k "sharded_over_gpus or layers_train" \
  > "$O/sharded_tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|SKIPPED" "$O/sharded_tests.log" | head -20
# the demo's step compiled over all the GPUs (data parallel, heads split in two): all-reduces only
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_layers.py -k "gathers_nothing" > "$O/demo_hlo.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR|SKIPPED" "$O/demo_hlo.log" | head -8
echo "t=${SECONDS}"
DEMO=${DEMO:---steps 40 --batch 8 --seq-len 4096 --d-model 1024 --layers 4 --heads 8 --head-dim 128 --log-every 10}
per_gpu_batch=$(echo "$DEMO" | grep -oE -- "--batch [0-9]+" | awk '{print $2}')
for g in 1 $([ "$n" -gt 1 ] && echo "$n"); do
  devs=$(seq -s, 0 $((g - 1)))
  CUDA_VISIBLE_DEVICES=$devs timeout "${TD:-240}" python3 -m fla_jax.demo --backend tilelang --dtype bfloat16 $DEMO \
    --batch $((per_gpu_batch * g)) > "$O/demo_${g}gpu.txt" 2>&1
  echo "$g GPU(s): $(grep -E "^devices|compiled|^done|^training steps|Error" "$O/demo_${g}gpu.txt" | tr '\n' ' ')"
done
if [ -n "${DEMOX:-}" ]; then  # the same loop on one GPU with the XLA backend (bf16 too), DEMOX's arguments after DEMO's
  CUDA_VISIBLE_DEVICES=0 timeout "${TDX:-240}" python3 -m fla_jax.demo --backend xla --dtype bfloat16 $DEMO $DEMOX > "$O/demo_xla.txt" 2>&1
  echo "xla, 1 GPU: $(grep -E "compiled|^done|^training steps|Error" "$O/demo_xla.txt" | tr '\n' ' ')"
fi
if [ "$n" -gt 1 ]; then
  python3 - "$O/demo_1gpu.txt" "$O/demo_${n}gpu.txt" <<'PY'
import re, sys
rate = [float(re.search(r"training steps: .*?\(([\d,]+) per device\)", open(f).read()).group(1).replace(",", "")) for f in sys.argv[1:]]
print(f"weak scaling: {rate[1]:,.0f} tokens/s per GPU on all against {rate[0]:,.0f} on one: {rate[1] / rate[0]:.3f}")
PY
fi
echo "done in ${SECONDS}s"

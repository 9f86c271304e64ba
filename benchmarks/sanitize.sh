#!/usr/bin/env bash
# Every dispatched program under compute-sanitizer (memcheck, racecheck, synccheck), launched from its cubin by
# benchmarks/ncu_program.py (no JAX in the process: memcheck segfaulted under it), at small shapes: K = 64 at
# 1x704x2x64, K = 128 at 1x320x2x128, K = 256 at 1x320x2x256 (sequences of several chunks, a partial last one).
# Run after any kernel change, on the GPU; the results go to benchmarks/RESULTS.md.
#
#   bash benchmarks/sanitize.sh prep                       # here, after build.py: the cubins into .prof/gen
#   run(command="OUT=$OUT TOOLS='memcheck racecheck synccheck' bash benchmarks/sanitize.sh", carry=[".prof"])
#
# TOOLS picks the tools (default all three), MATCH a grep pattern over the target names (default: all), LIMIT the
# seconds one run may take (default 60). One line per program and tool: its ERROR SUMMARY, or what went wrong.
# Exits 1 if any program had an error or did not finish.
set -u
if [ "${1:-}" = prep ]; then
  rm -rf .prof/gen && mkdir -p .prof/gen
  python3 - <<'PY' || exit 1
import shutil, sys
sys.path.insert(0, ".")
from build import generated
from kernels.variants import VARIANTS
for v in VARIANTS:
    for p in v.programs:
        for ext in ("cubin", "json"):
            shutil.copy(generated(v.target(p), ext), f".prof/gen/{v.target(p)}.{ext}")
PY
  grep -qx '/.prof/' .git/info/exclude 2>/dev/null || echo '/.prof/' >> .git/info/exclude
  echo "sanitize.sh: $(ls .prof/gen/*.json | wc -l) programs in .prof/gen"; exit 0
fi
O=${OUT:-/tmp/out}; mkdir -p "$O"
CS=${CS:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
for tool in ${TOOLS:-memcheck racecheck synccheck}; do
  for j in .prof/gen/*.json; do
    t=$(basename "$j" .json)
    echo "$t" | grep -q -- "${MATCH:-.}" || continue
    case $t in *_k64_*) s=1x704x2x64;; *_k256_*) s=1x320x2x256;; *) s=1x320x2x128;; esac
    r=$(timeout "${LIMIT:-60}" "$CS" --tool "$tool" --print-limit 3 python3 benchmarks/ncu_program.py --gen .prof/gen --shape $s --reps 1 "$t" 2>&1)
    rc=$?
    # (memcheck and synccheck end with "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: N hazards displayed")
    summary=$(echo "$r" | grep -m1 -E "(ERROR|RACECHECK) SUMMARY" || echo "no summary (rc $rc)")
    clean=$(echo "$summary" | grep -cE "ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards")
    [ "$rc" = 0 ] && [ "$clean" = 1 ] && summary="clean: $summary" ||
      summary="FAILED (rc $rc): $summary $(echo "$r" | grep -m3 -E "Invalid|Race|hazard|Barrier|Error|Traceback" | tr '\n' ' ')"
    echo "$tool $t $s: $summary"
  done
done | tee "$O/sanitize.txt"
n=$(wc -l < "$O/sanitize.txt"); ok=$(grep -c ": clean: " "$O/sanitize.txt")
echo "sanitize.sh: $ok of $n clean in ${SECONDS}s"
[ "$ok" = "$n" ]

"""Times this checkout's fla_jax against an older build of it on the same GPU, in one call: bench.py's
`fla_jax:tilelang` for each op and shape, the two builds in alternating processes (two builds of the
extension register the same FFI target names, so they cannot share one), and prints each op and shape's
forward and training step, new against old.

    python benchmarks/compare_builds.py --old .old --ops simple_gla,gla --shapes issue --passes 2

`--old`: a folder holding an older `fla_jax` package with its built `_ext.abi3.so` (an installed wheel's
`site-packages/fla_jax` copied there). Each pass runs new then old, the next old then new; the times are the
medians over passes of bench.py's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench(pythonpath: str, args, json_path: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH", "")])))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--impls", "fla_jax:tilelang", "--ops", args.ops,
           "--shapes", args.shapes, "--rounds", str(args.rounds), "--json", json_path]
    # (run from a folder of its own, so that `import fla_jax` finds the build PYTHONPATH names, not the checkout's)
    subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), check=False, stdout=subprocess.DEVNULL)
    return json.loads(Path(json_path).read_text()) if Path(json_path).exists() else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a folder holding the older fla_jax package (built)")
    ap.add_argument("--ops", default="simple_gla,gla,delta_rule,gated_delta_rule")
    ap.add_argument("--shapes", default="issue")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    builds = {"new": str(ROOT), "old": str(Path(args.old).resolve())}
    times: dict[tuple, dict[str, list]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.passes):
            for name in ("new", "old") if i % 2 == 0 else ("old", "new"):
                for row in bench(builds[name], args, f"{tmp}/{name}{i}.json"):
                    if "error" in row:
                        print(name, row, flush=True)
                        continue
                    t = times.setdefault((row["op"], tuple(row["shape"])), {"new": [], "old": []})
                    t[name].append((row["fwd_ms"], row["fwdbwd_ms"]))
                print(f"pass {i} {name} done", flush=True)
    rows = []
    print("\n| op | B,T,H,D | new fwd / step ms | old fwd / step ms | fwd new/old | step new/old |")
    print("|---|---|---|---|---|---|")
    for (op, shape), t in times.items():
        if not t["new"] or not t["old"]:
            continue
        med = {n: [statistics.median(x[d] for x in t[n]) for d in (0, 1)] for n in ("new", "old")}
        ratio = [med["new"][d] / med["old"][d] for d in (0, 1)]
        rows.append({"op": op, "shape": shape, "new": med["new"], "old": med["old"], "ratio": ratio})
        print(f"| {op} | {','.join(map(str, shape))} | {med['new'][0]:.3f} / {med['new'][1]:.3f} | "
              f"{med['old'][0]:.3f} / {med['old'][1]:.3f} | {ratio[0]:.3f} | {ratio[1]:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())

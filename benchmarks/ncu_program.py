"""Launch built TileLang programs straight from their cubins, without JAX, so that Nsight Compute
can read their counters (ncu on a JAX process ended in a segmentation fault), and time them.

The build writes, per target, `<target>.cubin` and `<target>.json` (parameters, TMA descriptors,
grid, block and shared memory as lowered) to `build/gen/<op>/`; this script allocates each parameter for
a problem of B sequences of T tokens, H heads and K = V = D, fills it (gates as in-chunk cumulative
log decays, chunk tables for whole sequences, everything else random), encodes the descriptors
and launches through the driver API (ctypes on libcuda: no CuPy, torch or JAX needed).

    python benchmarks/ncu_program.py --gen build/gen --shape 4x4096x16x128 fla_delta_fwd_bf16_k128_v128_c64_wy
    python benchmarks/ncu_program.py --inner 10 --rounds 5 --reps 10 A B C   # A, B, C in turn, 10 launches a sample
    ncu --clock-control none --set full -k main_kernel -c 1 -o wy python benchmarks/ncu_program.py --reps 1 ...

Values are not checked here (the GPU tests do that): only the programs' time and counters.
`--stalls` summarises a report's SASS page instead (where the warps waited, and the
instructions with the most stall samples), on any machine:

    ncu -i wy.ncu-rep --page source --csv --print-source sass > wy.csv
    python benchmarks/ncu_program.py --stalls wy.csv

(A device call returns only a few files from $OUT: tar the reports into one.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import itertools
import json
import pathlib
import re
import statistics

import numpy as np


class Driver:
    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    @staticmethod
    def check(r, what):
        if r != 0:
            raise RuntimeError(f"{what} failed with CUresult {r}")

    def upload(self, a: np.ndarray) -> ctypes.c_uint64:
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(max(a.nbytes, 16))), "cuMemAlloc")
        a = np.ascontiguousarray(a)
        self.check(self.lib.cuMemcpyHtoD_v2(ptr, a.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(a.nbytes)), "cuMemcpyHtoD")
        return ptr

    def function(self, cubin: bytes, smem: int):
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), self._cubin), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"main_kernel"), "cuModuleGetFunction")
        self.check(self.lib.cuFuncSetAttribute(fn, 8, ctypes.c_int(smem)), "cuFuncSetAttribute")  # max dynamic smem
        return fn

    def tensor_map(self, dtype, rank, ptr, dims, strides, box, elem, tail):
        m = (ctypes.c_uint64 * 16)()
        u64, u32 = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
        self.check(self.lib.cuTensorMapEncodeTiled(
            m, ctypes.c_int(dtype), ctypes.c_uint32(rank), ctypes.c_void_p(ptr.value), u64(*dims),
            (ctypes.c_uint64 * max(rank - 1, 1))(*strides[1:]), u32(*box), u32(*elem), *(ctypes.c_int(t) for t in tail)),
            "cuTensorMapEncodeTiled")
        return m

    def launch(self, fn, grid, block, smem, params):
        arr = (ctypes.c_void_p * len(params))(*(ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in params))
        self.check(self.lib.cuLaunchKernel(fn, *(ctypes.c_uint(x) for x in grid), *(ctypes.c_uint(x) for x in block),
                                           ctypes.c_uint(smem), None, arr, None), "cuLaunchKernel")

    def time(self, fn, grid, block, smem, params, reps, inner=1):
        """`reps` times, in ms per launch, of `inner` back-to-back launches each (one launch between
        two events leaves the GPU idle between samples and reads its clock ramp and the launch too)."""
        ev = [ctypes.c_void_p() for _ in range(2)]
        for e in ev:
            self.check(self.lib.cuEventCreate(ctypes.byref(e), 0), "cuEventCreate")
        out = []
        for _ in range(reps):
            self.check(self.lib.cuEventRecord(ev[0], None), "cuEventRecord")
            for _ in range(inner):
                self.launch(fn, grid, block, smem, params)
            self.check(self.lib.cuEventRecord(ev[1], None), "cuEventRecord")
            self.check(self.lib.cuEventSynchronize(ev[1]), "cuEventSynchronize")
            ms = ctypes.c_float()
            self.check(self.lib.cuEventElapsedTime(ctypes.byref(ms), ev[0], ev[1]), "cuEventElapsedTime")
            out.append(ms.value / inner)
        return out


def _expr(s, dims):
    """A dimension expression of the generated launcher (`fla::floordiv((d_L + int64_t(63)), ...)`) as an int."""
    if isinstance(s, int):
        return s
    return int(eval(s.replace("fla::floordiv", "floordiv").replace("int64_t", "int"),
                    {"floordiv": lambda a, b: a // b, "int": int}, dims))


def _fill(name, dtype, shape, rng, T, per_chunk=False, per_step=False):
    """Random contents of one parameter; `per_chunk`: its first dim is the chunk index (`NT`); `per_step`: a
    `[B, T, ...]` buffer of the step programs (gates per step, not summed)."""
    n = int(np.prod(shape)) if shape else 1
    if name in ("cstart", "first"):
        return np.arange(shape[0], dtype=np.int32) * (T // 64)
    if name == "ccount":
        return np.full(shape, T // 64, np.int32)
    if dtype == "int32":
        return np.zeros(shape, np.int32)
    if name == "g" and per_step:
        return (-np.abs(rng.standard_normal(shape)) * 0.1).astype(np.float32)
    if name == "g" and per_chunk and dtype == "float32":  # the same as per-chunk rows [NT, H, 64]
        return np.cumsum(-np.abs(rng.standard_normal(shape)) * 0.1, -1).astype(np.float32)
    if name in ("g", "gc") and dtype == "float32" and len(shape) >= 2:  # in-chunk cumulative log decays
        step = -np.abs(rng.standard_normal((shape[0] // 64, 64) + tuple(shape[1:]))) * 0.1
        return np.cumsum(step, 1).reshape(shape).astype(np.float32)
    if name == "beta":
        return rng.uniform(size=shape).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32).reshape(shape)
    if name in ("k", "q") and len(shape) >= 2:
        x /= np.linalg.norm(x, axis=-1, keepdims=True)
    else:
        x *= 0.1
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return (x.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16, truncated


def generated(gen: pathlib.Path, target: str, ext: str) -> pathlib.Path:
    """A program's generated file: in `gen` itself (a flat copy such as sanitize.sh's `.prof/gen`), or in the
    build's folder of its op (`build/gen/<op>/`, build.py `generated`)."""
    flat = gen / f"{target}.{ext}"
    return flat if flat.exists() else gen / re.match(r"fla_(.+?)_(?:fwd|bwd)_", target)[1] / f"{target}.{ext}"


def prepare(drv, gen: pathlib.Path, target: str, B: int, T: int, H: int, seed: int = 0):
    meta = json.loads(generated(gen, target, "json").read_text())
    rng = np.random.default_rng(seed)
    # (NS, M: simple GLA's `enter`, one piece per sequence, the whole sequence; N0, ND: h0 / dh0 and dht, a row each;
    # V, where a program takes it on its grid: the variant's)
    dims = {"d_L": B * T, "d_H": H, "d_HV": H, "d_NT": B * T // 64, "d_N": B, "d_N0": B, "d_ND": B, "d_R": B * T, "d_NS": B,
            "d_M": T // 64, "d_V": int(re.search(r"_v(\d+)_c\d+_", target)[1]), "d_B": B, "d_T": T}
    sym = {k[2:]: v for k, v in dims.items()}
    ptrs, scalars = {}, {}
    for p in meta["params"]:
        if p["kind"] == "scalar":
            scalars[p["name"]] = (ctypes.c_float if p["dtype"] == "float32" else ctypes.c_int32)(
                0.088 if p["name"] == "scale" else 1)
            continue
        shape = tuple(sym[s] if isinstance(s, str) else s for s in p["shape"])
        ptrs[p["name"]] = drv.upload(_fill(p["name"], p["dtype"], shape, rng, T, per_chunk=p["shape"][:1] == ["NT"],
                                           per_step=p["shape"][:2] == ["B", "T"]))
    maps = {}
    for name, d in meta["descs"].items():
        ev = lambda xs: [_expr(x, dims) for x in xs]
        maps[name] = drv.tensor_map(d["dtype"], d["rank"], ptrs[d["ptr"]], ev(d["dims"]), ev(d["strides"]),
                                    ev(d["box"]), ev(d["elem"]), d["tail"])
    cubin = generated(gen, target, "cubin").read_bytes()
    runs = []
    for launch in meta["launches"]:
        fn = drv.function(cubin, launch["smem"]) if launch["kernel"] == "main_kernel" else None
        assert fn is not None, "one main_kernel per program expected"
        params = []
        for a in launch["args"]:
            n = a["name"]
            if n in maps:
                params.append(maps[n])
            elif n in ptrs:
                params.append(ptrs[n])
            elif n in scalars:
                params.append(scalars[n])
            else:
                params.append(ctypes.c_int32(sym[n]))
        runs.append((fn, [_expr(x, dims) for x in launch["grid"]], [_expr(x, dims) for x in launch["block"]],
                     launch["smem"], params))
    return runs


def stalls(path: str, top: int = 25):
    """Stall samples of an ncu SASS source page (CSV): totals per reason, per warpgroup's part of a
    warp-specialized program, then the instructions with the most samples and their three main
    reasons."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if "Source" in r)
    ix = {h: i for i, h in enumerate(rows[head])}
    reasons = [h for h in rows[head] if h.startswith("stall_") and "Not Issued" not in h]
    n = lambda r, h: int(r[ix[h]]) if r[ix[h]].strip().isdigit() else 0
    data = rows[head + 1 :]
    total = collections.Counter({h: sum(n(r, h) for r in data) for h in reasons})
    everything = sum(total.values()) or 1
    print(f"{everything} stall samples")
    for h, c in total.most_common(10):
        print(f"  {h[6:]:20s} {c:8d} {100 * c / everything:5.1f}%")
    samples = "Warp Stall Sampling (All Samples)"
    # a warp-specialized program's warpgroups each start with a register reallocation (`setmaxnreg`): the samples
    # of the code between two are one warpgroup's (the last part also holds the out-of-line barrier-wait loops)
    cuts = [i for i, r in enumerate(data) if "USETMAXREG" in r[ix["Source"]]]
    if cuts:
        print("by part, split at the register reallocations (a warpgroup's code each):")
        bounds = [0, *cuts, len(data)]
        for a, b in itertools.pairwise(bounds):
            if a == b:
                continue
            c = sum(n(r, samples) for r in data[a:b])
            most = max(data[a:b], key=lambda r: n(r, samples))
            print(f"  SASS lines {a:5d}-{b - 1:5d} {c:8d} {100 * c / everything:5.1f}%  most at {most[ix['Source']].strip()[:50]}")
    ranked = sorted(data, key=lambda r: -n(r, samples))
    for r in ranked[:top]:
        main = sorted(((n(r, h), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"{n(r, samples):7d}  {r[ix['Source']].strip()[:60]:60s} {main}")


DETAILS = ("Duration", "SM Frequency", "DRAM Frequency", "Memory Throughput", "DRAM Throughput", "L2 Cache Throughput",
           "Compute (SM) Throughput", "Registers Per Thread", "Dynamic Shared Memory Per Block", "Achieved Occupancy",
           "Warp Cycles Per Issued Instruction", "L2 Hit Rate", "Executed Ipc Active")


def _kernels(path: str) -> dict:
    """The kernels of an ncu details page (CSV): `(ID, name, grid, block) -> {metric: (value, unit)}`
    for DETAILS, and its duration in us under `"us"`."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    kernels = collections.defaultdict(dict)
    for r in rows:
        if r.get("Metric Name") in DETAILS:
            kernels[(r["ID"], r["Kernel Name"], r["Grid Size"], r["Block Size"])][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    for m in kernels.values():
        v, unit = m.get("Duration", ("0", "us"))
        m["us"] = float(v.replace(",", "")) * {"ns": 1e-3, "ms": 1e3, "msecond": 1e3, "nsecond": 1e-3}.get(unit, 1.0)
    return kernels


def details(path: str, least_us: float = 5.0):
    """The main figures of each kernel on an ncu details page (CSV) that ran at least `least_us`:
    its name, grid and block, then DETAILS where present (unit as ncu gives it)."""
    for (i, name, grid, block), m in _kernels(path).items():
        if m.pop("us") < least_us:
            continue
        print(f"[{i}] {name[:70]} grid {grid} block {block}")
        print("    " + "; ".join(f"{k} {v} {u}" for k, (v, u) in m.items()))


def longest(path: str):
    """The name (no parameter list) of the kernel that ran longest on an ncu details page (CSV), for `ncu -k`."""
    kernels = _kernels(path)
    if kernels:
        print(max(kernels, key=lambda k: kernels[k]["us"])[1].split("(")[0].split()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("targets", nargs="*")
    ap.add_argument("--stalls", metavar="CSV", help="summarise an ncu SASS source page instead")
    ap.add_argument("--details", metavar="CSV", help="summarise an ncu details page (every kernel of 5 us or more) instead")
    ap.add_argument("--longest", metavar="CSV", help="the name of the longest kernel on an ncu details page instead")
    ap.add_argument("--gen", default="build/gen")
    ap.add_argument("--shape", default="4x4096x16x128", help="BxTxHxD")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=1, help="back-to-back launches per timed sample")
    ap.add_argument("--rounds", type=int, default=1, help="time the targets in turn, this many rounds")
    args = ap.parse_args()
    if args.stalls:
        return stalls(args.stalls)
    if args.details:
        return details(args.details)
    if args.longest:
        return longest(args.longest)
    if not args.targets:
        ap.error("name at least one target (or --stalls CSV)")
    B, T, H, _ = (int(x) for x in args.shape.split("x"))
    drv = Driver()
    if args.rounds == 1:
        for target in args.targets:
            for run in prepare(drv, pathlib.Path(args.gen), target, B, T, H):
                ms = drv.time(*run, reps=args.reps, inner=args.inner)
                print(f"{target}: median {statistics.median(ms):.4f} ms over {len(ms)} (first {ms[0]:.4f})", flush=True)
        return
    # interleaved: every target prepared first, then timed in turn each round, so that a drift of
    # the GPU's clock over the run falls on all of them alike
    runs = {t: list(prepare(drv, pathlib.Path(args.gen), t, B, T, H)) for t in args.targets}
    times = {t: [] for t in args.targets}
    for _ in range(args.rounds):
        for t, rs in runs.items():
            for run in rs:
                times[t] += drv.time(*run, reps=args.reps, inner=args.inner)
    for t, ms in times.items():
        q = statistics.quantiles(ms, n=4)
        print(f"{t}: median {statistics.median(ms):.4f} ms (quartiles {q[0]:.4f} / {q[2]:.4f}) over {len(ms)} samples of "
              f"{args.inner} launches, {args.rounds} rounds", flush=True)


if __name__ == "__main__":
    main()

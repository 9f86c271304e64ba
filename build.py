"""Builds fla_jax's CUDA kernels ahead of time, on a machine with or without a GPU.

    python build.py [--jobs N] [--force] [--experiments [NAMES]] [--wheel]

For every dispatched program of every variant in `kernels/variants.py` (and with `--experiments` the
experimental ones declared beside them):

1. lower the TileLang program for sm_90a (`{"kind": "cuda", "arch": "sm_90a"}`) and read the
   lowered host function: kernel parameter order, grid and block expressions, dynamic shared
   memory, and the arguments of every TMA descriptor;
2. compile the device code to a cubin with nvcc (`-gencode arch=compute_90a,code=sm_90a`);
3. generate an XLA FFI handler (`build/gen/<target>.cc`) that checks the buffers' dtypes and
   shapes, binds the dynamic dims, encodes the TMA descriptors and launches the embedded cubin;

then compiles `ffi/*.cc` with the generated handlers into one nanobind extension,
`fla_jax/_ext.abi3.so` (stable ABI, Python >= 3.12), against jaxlib's FFI headers.

Steps 1-2 are cached by a content hash (kernel sources and variants, this file's lowering and
compile steps, the nvcc target), so an unchanged kernel is not rebuilt; object files likewise. Without nvcc or TileLang it says so and exits 1; fla_jax still imports
and uses its pure-JAX backends.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BUILD = ROOT / "build"
GEN = BUILD / "gen"
OBJ = BUILD / "obj"
# the headers a generated handler includes (`handler_source`; a unit of handlers includes them first), and how many
# handlers a translation unit holds (`build_extension`)
HANDLER_HEADERS = ("<algorithm>", "<cstdint>", "<string>", '"runtime.h"', '"xla/ffi/api/ffi.h"')
UNITY = 16
EXT = ROOT / "fla_jax" / "_ext.abi3.so"
ARCH = ["-gencode", "arch=compute_90a,code=sm_90a"]
MAX_DYNAMIC_SMEM = 227 * 1024  # per block on sm_90 (opt-in limit)
DTYPE_ENUM = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int32": "S32"}
SCALAR_C = {"float32": "float", "int32": "int32_t"}


def generated(target: str, ext: str) -> Path:
    """Where the build writes one program's file `ext` (cu, cubin, cubin.inc, json, cc): `build/gen/<op>/`, so that
    one op's generated code is in one folder."""
    return GEN / re.match(r"fla_(.+?)_(?:fwd|bwd)_", target)[1] / f"{target}.{ext}"


def interface(meta: dict) -> dict:
    """A program's interface as its description records it (the prim_func's parameters): inputs, then outputs, each
    `[name, dtype, shape]` (a shape entry an int or a symbol such as "L"), the scalar attributes `[name, dtype]`, and
    `{symbol: m}` for a symbol that must be a multiple of m (V on the grid: `kernels.common.v_tile`).
    The extension carries it (`fla_jax._ext.interfaces()`): the runtime binds its calls to it by name."""
    buffers = [p for p in meta["params"] if p["kind"] == "buffer"]
    return {"inputs": [[p["name"], p["dtype"], p["shape"]] for p in buffers if p["name"] not in meta["outputs"]],
            "outputs": [[p["name"], p["dtype"], p["shape"]] for n in meta["outputs"] for p in buffers if p["name"] == n],
            "attrs": [[p["name"], p["dtype"]] for p in meta["params"] if p["kind"] == "scalar"],
            "multiple_of": meta.get("multiple_of", {})}


def cuda_home() -> Path | None:
    """The CUDA toolkit: $CUDA_HOME, the folder of the nvcc on PATH, or /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "bin" / "nvcc").exists() and (Path(c) / "include" / "cuda.h").exists():
            return Path(c)
    return None


def content_key(variant, program) -> str:
    """What a cubin and its launch description depend on: the program's module and the shared
    kernel sources beside it (`kernels/*.py`: program modules import only from there; of
    `variants.py` only how a program calls its builder, so that declaring a program rebuilds
    nothing else), the lowering and compile steps of this file, the toolchain flags (handler
    codegen is redone on every build). So a change to one kernel module rebuilds that module's
    programs only."""
    from kernels import variants

    h = hashlib.sha256()
    module = ROOT / "kernels" / (program.module.replace(".", "/") + ".py")
    for f in (*sorted(f for f in (ROOT / "kernels").glob("*.py") if f.name != "variants.py"), module):
        h.update(f.read_bytes())
    for fn in (_cexpr, lower_one, compile_cubin, variants.Program.prim_func):
        h.update(inspect.getsource(fn).encode())
    h.update(repr(variants.DTYPES).encode())
    h.update(repr((variant, program, ARCH)).encode())
    return h.hexdigest()[:20]


# ----------------------------------------------------------------------------- lowering (workers)


def _cexpr(e, tir) -> str:
    """A TIR integer expression as C++ over `d_<var>` int64 values."""
    if isinstance(e, int):
        return f"int64_t({e})"
    if isinstance(e, tir.IntImm):
        return f"int64_t({e.value})"
    if isinstance(e, tir.Var):
        return f"d_{e.name}"
    if isinstance(e, tir.Cast):
        return f"int64_t({_cexpr(e.value, tir)})"
    ops = {tir.Add: "+", tir.Sub: "-", tir.Mul: "*", tir.Div: "/", tir.Mod: "%"}
    for cls, sym in ops.items():
        if isinstance(e, cls):
            return f"({_cexpr(e.a, tir)} {sym} {_cexpr(e.b, tir)})"
    calls = {tir.FloorDiv: "fla::floordiv", tir.FloorMod: "fla::floormod", tir.Max: "std::max<int64_t>", tir.Min: "std::min<int64_t>"}
    for cls, fn in calls.items():
        if isinstance(e, cls):
            return f"{fn}({_cexpr(e.a, tir)}, {_cexpr(e.b, tir)})"
    raise NotImplementedError(f"build.py cannot print TIR expression {type(e).__name__}: {e}")


def lower_one(variant, program, key: str) -> dict:
    """Lowers one program, writes `<target>.cu`, returns its launch description (JSON-able)."""
    import tilelang
    from tilelang import tvm

    tir = tvm.tirx
    target_name = variant.target(program)
    func = program.prim_func(variant)
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    # warp-specialized programs: every warpgroup's shared buffers live at once (TileLang's reuse
    # planner would overlap buffers of different warpgroups, whose code it sees in sequence)
    ws = "fla.disable_shared_memory_reuse" in (func.attrs or {})
    # and programs marked so are lowered without TileLang's own warp specialization
    flat = "fla.disable_warp_specialized" in (func.attrs or {})
    config = {"tl.disable_shared_memory_reuse": True} if ws else {}
    config.update({"tl.disable_warp_specialized": True} if flat else {})
    with target, tvm.transform.PassContext(config=config) if config else contextlib.nullcontext():
        art = tilelang.lower(func, target=target)
    if ws and art.kernel_source.count("__syncthreads()") > 1:  # one after the barrier set-up; any other
        # is reached by some warpgroups only, after the producer waits on the consumers: a deadlock
        raise RuntimeError(f"{target_name}: TileLang synced the whole block inside the warp-specialized part")
    generated(target_name, "cu").write_text(art.kernel_source)

    params = []
    for p in func.params:
        if p in func.buffer_map:
            buf = func.buffer_map[p]
            shape = [int(s) if isinstance(s, (int, tir.IntImm)) else s.name for s in buf.shape]
            params.append({"name": buf.name, "data": buf.data.name, "kind": "buffer", "dtype": str(buf.dtype), "shape": shape})
        else:
            params.append({"name": p.name, "kind": "scalar", "dtype": str(p.dtype)})
    unknown = set(program.outputs) - {p["name"] for p in params}
    if unknown:
        raise ValueError(f"{target_name}: outputs {sorted(unknown)} are not parameters")

    kernels = {gv.name_hint: fn for gv, fn in art.device_mod.functions.items()}
    calls = []
    tir.stmt_functor.post_order_visit(
        art.host_mod["main"].body,
        lambda n: calls.append(n) if isinstance(n, tir.Call) and "call_packed" in str(n.op.name) else None,
    )
    descs, launches = {}, []
    for c in calls:
        fname, args = c.args[0].value, list(c.args[1:])
        if fname == "__tvm_tensormap_create_tiled":
            rank = int(args[2].value)
            vals = [_cexpr(a, tir) for a in args[4:]]
            descs[args[0].name] = {
                "dtype": int(args[1].value), "rank": rank, "ptr": args[3].name,
                "dims": vals[0:rank], "strides": vals[rank : 2 * rank], "box": vals[2 * rank : 3 * rank],
                "elem": vals[3 * rank : 4 * rank], "tail": [int(a.value) for a in args[4 + 4 * rank :]],
            }
        elif fname in kernels:
            tags = list(kernels[fname].attrs["tirx.kernel_launch_params"])
            n = len(args) - len(tags)
            kargs = []
            for a in args[:n]:
                kargs.append({"name": a.name, "dtype": str(a.dtype)})
            dims = dict(zip(tags, args[n:]))
            smem = dims.get("tirx.use_dyn_shared_memory", 0)
            if not isinstance(smem, (int, tir.IntImm)):
                raise NotImplementedError(f"{target_name}: dynamic shared memory {smem} is not a constant")
            smem = int(smem.value if isinstance(smem, tir.IntImm) else smem)
            if smem > MAX_DYNAMIC_SMEM:
                raise ValueError(f"{target_name}: needs {smem} bytes of dynamic shared memory, more than the "
                                 f"{MAX_DYNAMIC_SMEM} a block can have on sm_90 (fewer stages or smaller blocks)")
            launches.append({
                "kernel": fname,
                "args": kargs,
                "grid": [_cexpr(dims.get(f"blockIdx.{x}", 1), tir) for x in "xyz"],
                "block": [_cexpr(dims.get(f"threadIdx.{x}", 1), tir) for x in "xyz"],
                "smem": smem,
            })
        elif fname != "__tvm_set_device":  # XLA has already made the device current
            raise NotImplementedError(f"{target_name}: host calls {fname}, which build.py does not translate")
    if not launches:
        raise RuntimeError(f"{target_name}: no kernel launch found in the lowered host code")
    # a program that reads V off its buffers takes only multiples of its V block (`kernels.common.v_tile`)
    tile = (func.attrs or {}).get("fla.v_tile")
    meta = {"target": target_name, "key": key, "variant": repr(variant), "program": repr(program),
            "source": f"kernels/{program.module.replace('.', '/')}.py", "params": params,
            "outputs": list(program.outputs), "descs": descs, "launches": launches,
            "multiple_of": {} if tile is None else {"V": int(tile)}}
    return meta  # written by `main` once the cubin is: its key is what marks the cubin as built


# What TileLang prints when its ThreadSync pass cannot place a barrier where the code needs one (a sync inside a
# branch that not every thread takes, hoisted out of it): the race it names stays in the kernel.
RACE_WARNING = "the race remains"


def lower_logged(variant, program, key: str) -> dict:
    """`lower_one`, with what TileLang printed while lowering (its C++ passes write to the process's
    stderr) kept as `lowering_log` in the description, so that `main` can refuse what it warns of."""
    import tempfile

    with tempfile.TemporaryFile("w+b") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            meta = lower_one(variant, program, key)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    sys.stderr.write(text)
    meta["lowering_log"] = [ln for ln in text.splitlines() if "warn" in ln.lower() or RACE_WARNING in ln]
    return meta


def _hashes(target_name: str) -> dict[str, str]:
    """The SHA-256 of a program's CUDA source and cubin, as its description records them."""
    return {f"{ext}_sha256": hashlib.sha256(generated(target_name, ext).read_bytes()).hexdigest() for ext in ("cu", "cubin")}


def _built(meta: dict, key: str) -> bool:
    """Whether a program's description says its cubin was compiled from the lowering of `key`
    (and the files are the ones it compiled)."""
    return meta["key"] == key and all(meta.get(k) == h for k, h in _hashes(meta["target"]).items())


def compile_cubin(target_name: str, cuda: Path, tl_root: Path) -> dict:
    """Compiles a program's CUDA source to its cubin (and the `.inc` that embeds it); returns what
    ptxas reports of it (`ptxas_report`)."""
    cmd = ["nvcc", "-cubin", *ARCH, "-std=c++17", "-O3", "--use_fast_math", "-w", "-DENABLE_BF16", "-Xptxas", "-v",
           f"-I{tl_root / 'src'}", f"-I{tl_root / '3rdparty' / 'cutlass' / 'include'}",
           "-o", str(generated(target_name, "cubin")), str(generated(target_name, "cu"))]
    cmd[0] = str(cuda / "bin" / "nvcc")
    r = run(cmd)
    data = generated(target_name, "cubin").read_bytes()
    rows = ",".join(f"0x{b:02x}" for b in data)
    generated(target_name, "cubin.inc").write_text(f"alignas(64) static const unsigned char kCubin[] = {{{rows}}};\n")
    return ptxas_report(r.stdout + r.stderr)


def ptxas_report(text: str) -> dict:
    """ptxas's `-v` lines for the kernel: registers a thread, bytes of spill stores and loads, and
    whether it serialized the tensor-core products for want of registers (its warning C7512). A
    warp-specialized pass compiles to one register count for all its warpgroups (the launch's
    share, 128 at 512 threads) whatever `setmaxnreg` gives them later; over it, ptxas keeps the
    state in local memory (2026-12-05: simple GLA's forward 1.7x behind jla's on an H100 so)."""
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0
    return {"registers": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "serialized": "C7512" in text}


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r


# ----------------------------------------------------------------------------- handler codegen


def handler_source(meta: dict) -> str:
    """The FFI handler of one program: checks, dynamic dims, TMA descriptors, launch."""
    tgt = meta["target"]
    params = meta["params"]
    outputs = meta["outputs"]
    buffers = {p["name"]: p for p in params if p["kind"] == "buffer"}
    by_data = {p["data"]: p["name"] for p in buffers.values()}
    inputs = [p for p in params if p["kind"] == "buffer" and p["name"] not in outputs]
    scalars = [p for p in params if p["kind"] == "scalar"]
    sig = ["cudaStream_t stream"]
    # parameter names are prefixed: kernels use names such as `do` that are C++ keywords
    sig += [f"ffi::AnyBuffer x_{p['name']}" for p in inputs]
    sig += [f"ffi::Result<ffi::AnyBuffer> x_{n}" for n in outputs]
    sig += [f"{SCALAR_C[p['dtype']]} x_{p['name']}" for p in scalars]
    L = [f"// generated by build.py from {meta['source']} for {meta['variant']}, program {meta['program']}; do not edit",
         *(f"#include {h}" for h in HANDLER_HEADERS), '',
         'namespace ffi = xla::ffi;', '', 'namespace {', f'#include "{tgt}.cubin.inc"', '']
    for i, ln in enumerate(meta["launches"]):
        L.append(f'fla::Kernel kernel{i}(kCubin, "{ln["kernel"]}", {ln["smem"]}u);')
    L += ['', f'constexpr char kTarget[] = "{tgt}";', '',
          'ffi::Error Bad(const std::string& what) { return ffi::Error::InvalidArgument(std::string(kTarget) + ": " + what); }', '',
          f'ffi::Error Impl({", ".join(sig)}) {{']
    bound: set[str] = set()
    for p in params:
        if p["kind"] != "buffer":
            continue
        n = p["name"]
        acc = f"x_{n}->" if n in outputs else f"x_{n}."
        L.append(f'  if ({acc}element_type() != ffi::DataType::{DTYPE_ENUM[p["dtype"]]}) return Bad("`{n}` must be {p["dtype"]}");')
        L.append(f'  auto s_{n} = {acc}dimensions();')
        L.append(f'  if (s_{n}.size() != {len(p["shape"])}) return Bad("`{n}` must have rank {len(p["shape"])}, got " + std::to_string(s_{n}.size()));')
        for i, d in enumerate(p["shape"]):
            if isinstance(d, int):
                L.append(f'  if (s_{n}[{i}] != {d}) return Bad("`{n}` dim {i} must be {d}, got " + std::to_string(s_{n}[{i}]));')
            elif d not in bound:
                bound.add(d)
                L.append(f'  const int64_t d_{d} = s_{n}[{i}];')
                L.append(f'  if (d_{d} > 2147483647LL) return Bad("dim {d} = " + std::to_string(d_{d}) + " does not fit in int32");')
            else:
                L.append(f'  if (s_{n}[{i}] != d_{d}) return Bad("`{n}` dim {i} must equal {d} = " + std::to_string(d_{d}) + ", got " + std::to_string(s_{n}[{i}]));')
        L.append(f'  void* p_{p["data"]} = {acc}untyped_data();')
    for d, m in meta.get("multiple_of", {}).items():  # (the kernel assumes it: its V blocks' copies carry no bound checks)
        L.append(f'  if (d_{d} % {m} != 0) return Bad("dim {d} = " + std::to_string(d_{d}) + " must be a multiple of {m}");')
    for name, d in meta["descs"].items():
        r = d["rank"]
        L += [f'  CUtensorMap m_{name};', '  {',
              f'    const uint64_t dims[{r}] = {{{", ".join(f"uint64_t({e})" for e in d["dims"])}}};',
              f'    const uint64_t strides[{r}] = {{{", ".join(f"uint64_t({e})" for e in d["strides"])}}};',
              f'    const uint32_t box[{r}] = {{{", ".join(f"uint32_t({e})" for e in d["box"])}}};',
              f'    const uint32_t elem[{r}] = {{{", ".join(f"uint32_t({e})" for e in d["elem"])}}};',
              f'    std::string e = fla::encode_tiled(&m_{name}, {d["dtype"]}, {r}, p_{d["ptr"]}, dims, strides, box, elem, {", ".join(map(str, d["tail"]))});',
              '    if (!e.empty()) return ffi::Error::Internal(std::string(kTarget) + ": " + e);', '  }']
    for v in sorted(bound):
        L.append(f'  int32_t i_{v} = int32_t(d_{v});')
    for s in scalars:
        L.append(f'  {SCALAR_C[s["dtype"]]} a_{s["name"]} = x_{s["name"]};')
    for i, ln in enumerate(meta["launches"]):
        refs = []
        for a in ln["args"]:
            n = a["name"]
            if n in meta["descs"]:
                refs.append(f"&m_{n}")
            elif n in by_data:
                refs.append(f"&p_{n}")
            elif n in bound:
                refs.append(f"&i_{n}")
            elif n in {s["name"] for s in scalars}:
                refs.append(f"&a_{n}")
            else:
                raise NotImplementedError(f"{tgt}: kernel argument {n} is neither a buffer, descriptor, dim nor scalar")
        L += ['  {', f'    void* args[] = {{{", ".join(refs)}}};',
              f'    const int64_t grid[3] = {{{", ".join(ln["grid"])}}};',
              f'    const int64_t block[3] = {{{", ".join(ln["block"])}}};',
              f'    std::string e = fla::launch(kernel{i}, grid, block, reinterpret_cast<CUstream>(stream), args);',
              '    if (!e.empty()) return ffi::Error::Internal(std::string(kTarget) + ": " + e);', '  }']
    L += ['  return ffi::Error::Success();', '}', '', '}  // namespace', '']
    # `<target>_aliased` takes one more input per output, aliased to it (input_output_aliases):
    # tests pass NaN-filled buffers there, so an element the kernel does not write stays NaN.
    extra = ["ffi::AnyBuffer" for _ in outputs]
    names = [a.split()[-1] for a in sig[1:]]
    n_in = len(inputs)
    L.insert(L.index("}  // namespace"), "\n".join([
        f'ffi::Error ImplAliased({", ".join(sig[:1 + n_in] + extra + sig[1 + n_in:])}) {{',
        f'  return Impl(stream, {", ".join(names)});', '}', '']))
    for symbol, n_args in ((tgt, n_in), (f"{tgt}_aliased", n_in + len(outputs))):
        bind = ["ffi::Ffi::Bind()", ".Ctx<ffi::PlatformStream<cudaStream_t>>()"]
        bind += [".Arg<ffi::AnyBuffer>()"] * n_args + [".Ret<ffi::AnyBuffer>()"] * len(outputs)
        bind += [f'.Attr<{SCALAR_C[s["dtype"]]}>("{s["name"]}")' for s in scalars]
        impl = "Impl" if symbol == tgt else "ImplAliased"
        L.append(f'XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol}, {impl}, {"".join(bind)}, {{ffi::Traits::kCmdBufferCompatible}});')
    return "\n".join(L) + "\n"


def registry_source(targets: list[str], interfaces: dict[str, dict]) -> str:
    """The extension's table of FFI handlers, and every program's `interface` as one JSON text."""
    text = json.dumps(interfaces, separators=(",", ":"))
    assert ")fla_json" not in text
    L = ["// generated by build.py from kernels/variants.py; do not edit", "#pragma once",
         '#include "xla/ffi/api/c_api.h"', "", f'static const char kInterfaces[] = R"fla_json({text})fla_json";', ""]
    symbols = [s for t in targets for s in (t, f"{t}_aliased")]
    L += [f'extern "C" XLA_FFI_Error* {t}(XLA_FFI_CallFrame*);' for t in symbols]
    L += ["", "struct Target { const char* name; void* handler; };", "static const Target kTargets[] = {"]
    L += [f'    {{"{t}", reinterpret_cast<void*>(&{t})}},' for t in symbols]
    L += ["};", ""]
    return "\n".join(L)


# ----------------------------------------------------------------------------- extension


def build_extension(targets: list[str], cuda: Path, jobs: int) -> None:
    import jax.ffi
    import nanobind

    interfaces = {t: interface(json.loads(generated(t, "json").read_text())) for t in targets}
    (GEN / "registry.inc").write_text(registry_source(targets, interfaces))
    nb_src = Path(nanobind.source_dir())
    includes = [f"-I{ROOT / 'ffi'}", f"-I{GEN}", f"-I{jax.ffi.include_dir()}", f"-I{cuda / 'include'}",
                f"-I{nanobind.include_dir()}", f"-I{nb_src.parent / 'ext' / 'robin_map' / 'include'}",
                f"-I{sysconfig.get_paths()['include']}"]
    flags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-DPy_LIMITED_API=0x030C0000", "-DNDEBUG", "-w"]
    sources = [nb_src / "nb_combined.cpp", ROOT / "ffi" / "module.cc", ROOT / "ffi" / "runtime.cc"]
    # The handlers compiled UNITY to a translation unit, each in a namespace of its own (their names live in an
    # anonymous namespace; the FFI symbols are extern "C"): g++ parses XLA's FFI headers once a unit, not once a
    # handler (about 1.5 s a handler instead of 6 on CI's cores)
    members = {}
    by_op: dict[Path, list[Path]] = {}  # (each op's handlers in units of its own folder)
    for t in targets:
        by_op.setdefault(generated(t, "cc").parent, []).append(generated(t, "cc"))
    for folder, handlers in by_op.items():
        for i in range(0, len(handlers), UNITY):
            unit, group = folder / f"handlers_{i // UNITY}.cc", handlers[i : i + UNITY]
            unit.write_text("// generated by build.py: handlers compiled together; do not edit\n"
                            + "".join(f"#include {h}\n" for h in HANDLER_HEADERS)
                            + "".join(f'namespace unit{j} {{\n#include "{src.name}"\n}}\n' for j, src in enumerate(group)))
            members[unit] = group
            sources.append(unit)
    OBJ.mkdir(parents=True, exist_ok=True)

    def compile_obj(src: Path) -> Path:
        h = hashlib.sha256(src.read_bytes() + " ".join(flags + includes).encode())
        for dep in [ROOT / "ffi" / "runtime.h", *([GEN / "registry.inc"] if src.name == "module.cc" else [])]:
            h.update(dep.read_bytes())
        for member in members.get(src, ()):
            h.update(member.read_bytes() + member.with_suffix(".cubin.inc").read_bytes())
        obj = OBJ / f"{src.parent.name}-{src.stem}-{h.hexdigest()[:16]}.o"
        if not obj.exists():
            run(["g++", *flags, *includes, "-c", str(src), "-o", str(obj)])
        return obj

    with cf.ThreadPoolExecutor(jobs) as pool:
        objs = list(pool.map(compile_obj, sources))
    lib = cuda / "lib64"
    if not (lib / "libcudart_static.a").exists():
        lib = cuda / "targets" / "x86_64-linux" / "lib"
    tmp = EXT.with_suffix(".tmp")
    run(["g++", "-shared", "-o", str(tmp), *map(str, objs), f"-L{lib}", "-lcudart_static", "-ldl", "-lrt", "-lpthread",
         "-Wl,--exclude-libs,ALL"])
    os.replace(tmp, EXT)


def write_wheel(dist: Path) -> Path:
    """The runtime as a wheel in `dist`: fla_jax's modules and the built extension, tagged for CPython >= 3.12's
    stable ABI on this platform; no `kernels/` (build time only) and no build requirements."""
    import base64
    import tomllib
    import zipfile

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    tag = "cp312-abi3-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")
    info = f"{name}-{version}.dist-info"
    files = {f"fla_jax/{p.relative_to(ROOT / 'fla_jax').as_posix()}": p.read_bytes()
             for p in sorted((ROOT / "fla_jax").rglob("*.py")) if "__pycache__" not in p.parts}
    files["fla_jax/_ext.abi3.so"] = EXT.read_bytes()
    extras = project.get("optional-dependencies", {})
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", f"Summary: {project['description']}",
             f"Requires-Python: {project['requires-python']}", *(f"Requires-Dist: {d}" for d in project["dependencies"])]
    for extra in ("demo",):  # (test and build are the checkout's, not a user's)
        lines += [f"Provides-Extra: {extra}", *(f'Requires-Dist: {d}; extra == "{extra}"' for d in extras.get(extra, ()))]
    files[f"{info}/METADATA"] = ("\n".join(lines) + "\n\n" + (ROOT / "README.md").read_text()).encode()
    files[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: fla_jax build.py\nRoot-Is-Purelib: false\nTag: {tag}\n".encode()
    files[f"{info}/top_level.txt"] = b"fla_jax\n"
    digest = lambda b: "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b"=").decode()
    record = [f"{n},{digest(b)},{len(b)}" for n, b in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    dist.mkdir(parents=True, exist_ok=True)
    wheel = dist / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, b in files.items():
            zf.writestr(n, b)
    return wheel


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Builds fla_jax's TileLang kernels and FFI extension.")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--force", action="store_true", help="rebuild every kernel, ignoring the cache")
    ap.add_argument("--experiments", nargs="?", const="*", default="", metavar="NAMES",
                    help="also build the experimental programs (kernels/variants.py EXPERIMENTS), for benchmarks; "
                         "NAMES (comma-separated, e.g. x_fused_states) builds those experiments alone")
    ap.add_argument("--wheel", action="store_true",
                    help="then write dist/fla_jax-<version>-cp312-abi3-<platform>.whl: the runtime and the extension")
    args = ap.parse_args(argv)
    cuda = cuda_home()
    if cuda is None:
        print("build.py: no nvcc (CUDA toolkit) found; the tilelang backend is not built. fla_jax still works with its "
              "pure-JAX backends.")
        return 1
    try:
        import tilelang
    except ImportError as e:
        print(f"build.py: TileLang is not installed ({e}); install the `build` extra (pip install -e '.[build]'). "
              "fla_jax still works with its pure-JAX backends.")
        return 1
    sys.path.insert(0, str(ROOT))
    from kernels.variants import VARIANTS

    for v in VARIANTS:
        generated(v.symbol + "_", "json").parent.mkdir(parents=True, exist_ok=True)
    tl_root = Path(tilelang.__file__).parent
    names = set(args.experiments.split(",")) - {""}
    if names - {"*"} and not names & {p.name for v in VARIANTS for p in v.experiments}:
        print(f"build.py: --experiments {args.experiments}: no experiment of that name in kernels/variants.py")
        return 1
    work = [(v, p, content_key(v, p)) for v in VARIANTS for p in v.declared
            if p in v.programs or "*" in names or p.name in names]
    todo = []
    for v, p, key in work:
        meta_file = generated(v.target(p), "json")
        cached = meta_file.exists() and generated(v.target(p), "cubin.inc").exists() and _built(json.loads(meta_file.read_text()), key)
        if cached and not args.force:
            print(f"  cached    {v.target(p)}")
        else:  # no stale description may outlive an interrupted build with a key that matches
            meta_file.unlink(missing_ok=True)
            todo.append((v, p, key))
    t0 = time.time()
    ctx = __import__("multiprocessing").get_context("spawn")
    with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(lower_logged, v, p, key): v.target(p) for v, p, key in todo}
        for fut in cf.as_completed(futures):
            name = futures[fut]
            meta = fut.result()
            meta["ptxas"] = ptxas = compile_cubin(name, cuda, tl_root)
            meta |= _hashes(name)
            generated(name, "json").write_text(json.dumps(meta, indent=1))
            spills = ptxas["spill_stores"] or ptxas["spill_loads"] or ptxas["serialized"]
            note = f"; ptxas: {ptxas['spill_stores']} bytes spilled, products serialized {ptxas['serialized']}" if spills else ""
            print(f"  built     {name} ({time.time() - t0:.0f}s){note}", flush=True)
    targets, races = [], []
    for v, p, _ in work:
        meta = json.loads(generated(v.target(p), "json").read_text())
        if any(RACE_WARNING in ln for ln in meta.get("lowering_log", ())):
            races.append((v.target(p), not p.of))
        generated(v.target(p), "cc").write_text(handler_source(meta))
        targets.append(v.target(p))
    if races:
        print(f"build.py: TileLang reported a race it could not remove ('{RACE_WARNING}') in {[t for t, _ in races]}")
    if any(dispatched for _, dispatched in races):
        print("build.py: refusing to link: dispatched programs must lower without a reported race")
        return 1
    build_extension(targets, cuda, args.jobs)
    print(f"build.py: {len(targets)} kernels in {EXT.relative_to(ROOT)} ({time.time() - t0:.0f}s)")
    if args.wheel:
        if args.experiments:  # (an install holds the dispatched programs alone)
            print("build.py: --wheel builds without --experiments")
            return 1
        print(f"build.py: wrote {write_wheel(ROOT / 'dist').relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

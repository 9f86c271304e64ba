"""The built extension (`fla_jax._ext`): loading it, registering its FFI targets with XLA, each program's
interface as the build recorded it, calling one program by the names of its parameters, and whether the
kernels can run here."""

from __future__ import annotations

import functools
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fla_jax._problem import Problem
from fla_jax._tilelang import config

def load_extension(name: str = "fla_jax._ext"):
    """`(module, None)`, or `(None, why)` where the extension is not built or does not load."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(name) is None:  # (importing it then would fail with a circular-import message)
        return None, f"{name} is not built"
    try:
        return importlib.import_module(name), None
    except ImportError as e:  # built, but it does not load here
        return None, f"{name} does not load: {e}"


_ext, IMPORT_ERROR = load_extension()
if _ext is not None:
    for _name, _capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def registered() -> list[str]:
    """The FFI targets this install registered (each program also has a `_aliased` twin)."""
    return [] if _ext is None else sorted(n for n in _ext.registrations() if not n.endswith("_aliased"))


class Param(NamedTuple):
    """One buffer of a program: its name, dtype and shape (an entry an int, or a symbol such as "L" that the
    program reads off the buffer, equal wherever it appears)."""

    name: str
    dtype: str
    shape: tuple


class Interface(NamedTuple):
    """A program's parameters as the build recorded them from its prim_func (build.py `interface`): inputs and
    outputs in the order the FFI handler takes them, the scalar attributes by name, and `(symbol, m)` for each
    symbol that must be a multiple of m (V, for a program that takes V on its grid)."""

    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    attrs: tuple[str, ...]
    multiple_of: tuple[tuple[str, int], ...] = ()

    def bind(self, args) -> dict:
        """`args` given in the order of the inputs, by name (as `call` takes them): for tests and benchmarks that
        hold a program's inputs as a tuple."""
        names = [q.name for q in self.inputs]
        if len(args) != len(names):
            raise TypeError(f"the program takes {len(names)} inputs {names}, got {len(args)}")
        return dict(zip(names, args))

    def check(self, target: str, results, named: dict) -> None:
        """Refuses, at trace time and naming the program and the argument, a call whose named arguments are not
        the program's inputs and attributes, or whose buffers (inputs and `results`) do not fit its declared
        dtypes and shapes (the FFI handler would refuse them on the GPU, and the emulated tests would not)."""
        want = [q.name for q in self.inputs] + list(self.attrs)
        if sorted(named) != sorted(want):
            raise TypeError(f"{target} takes {want}; the call gave {sorted(named)} (missing "
                            f"{sorted(set(want) - set(named))}, unknown {sorted(set(named) - set(want))})")
        if len(results) != len(self.outputs):
            raise TypeError(f"{target} writes {[q.name for q in self.outputs]}; the call asked for {len(results)} results")
        bound: dict[str, int] = {}
        for q, x in [*((q, named[q.name]) for q in self.inputs), *zip(self.outputs, results)]:
            if jnp.dtype(x.dtype) != jnp.dtype(q.dtype) or len(x.shape) != len(q.shape):
                raise TypeError(f"{target}: `{q.name}` must be {q.dtype} of shape {q.shape}, got {x.dtype} {tuple(x.shape)}")
            for d, (want_d, got) in enumerate(zip(q.shape, x.shape)):
                if isinstance(want_d, str):
                    want_d = bound.setdefault(want_d, got)
                if got != want_d:
                    raise ValueError(f"{target}: `{q.name}` dim {d} must be {q.shape[d]} = {want_d}, got {got} "
                                     f"(shape {tuple(x.shape)})")
        for symbol, m in self.multiple_of:
            if bound.get(symbol, 0) % m:
                raise ValueError(f"{target}: {symbol} = {bound[symbol]} must be a multiple of {m}")


@functools.cache
def interfaces() -> dict[str, Interface]:
    """Each built program's `Interface`, by FFI target (none where the extension is not built)."""
    if _ext is None:
        return {}
    if not hasattr(_ext, "interfaces"):  # (built before the extension carried them)
        raise RuntimeError("fla_jax._ext predates the programs' interfaces: rebuild it with `python build.py`")
    param = lambda q: Param(q[0], q[1], tuple(q[2]))
    return {t: Interface(tuple(map(param, d["inputs"])), tuple(map(param, d["outputs"])), tuple(a[0] for a in d["attrs"]),
                         tuple(d.get("multiple_of", {}).items())) for t, d in json.loads(_ext.interfaces()).items()}


def call(p: Problem, target: str, results, *, init=None, in_place=None, **named):
    """`ffi_call` of program `target` for call `p`: its inputs and attributes by the names its prim_func gives them
    (`interfaces`), checked against it; with `Config.poison_outputs` its outputs start as NaN. `results`: the
    outputs' shapes, in its order. `init`: the outputs' contents before the call, for a program that updates them
    in place (never poisoned). `in_place`: {output: input} an output that may take its input's buffer (XLA copies
    the input first only where it is still used after the call), for a program in which each thread reads an
    element of the input before it writes that element of the output and no thread touches another's; not while
    poisoning, which must see every element of each output written."""
    single = not isinstance(results, tuple)
    results = (results,) if single else results
    interface = interfaces().get(target)
    if interface is not None:  # (an experiment this install did not build has none: only the emulator runs it)
        interface.check(target, results, named)
    out = launch(p, target, results, named, init, in_place)
    return out[0] if single else tuple(out)


def launch(p: Problem, target: str, results: tuple, named: dict, init, in_place=None):
    """Runs the program on the GPU: its inputs in its order (the CPU tests put `kernel_emulator.launch` here)."""
    interface = interfaces().get(target)
    if interface is None:  # an experiment this install did not build (`build.py --experiments`): the call lowers (the
        # CPU tests read such a step's custom calls) in the order given, and XLA refuses it as unregistered on a GPU
        attrs = {a: x for a, x in named.items() if a == "scale"}
        args = [x for a, x in named.items() if a not in attrs]
    else:
        args = [named[q.name] for q in interface.inputs]
        attrs = {a: named[a] for a in interface.attrs}
    if config.of(p).poison_outputs or init is not None:
        init = init or [jnp.full(r.shape, jnp.nan, r.dtype) for r in results]
        aliases = {len(args) + i: i for i in range(len(results))}
        return jax.ffi.ffi_call(f"{target}_aliased", results, vmap_method="sequential", input_output_aliases=aliases)(
            *args, *init, **attrs
        )
    aliases = {}
    if in_place and interface is not None:
        ins, outs = [q.name for q in interface.inputs], [q.name for q in interface.outputs]
        aliases = {ins.index(i): outs.index(o) for o, i in in_place.items()}
    return jax.ffi.ffi_call(target, results, vmap_method="sequential", input_output_aliases=aliases)(*args, **attrs)


@functools.cache
def status() -> tuple[bool, str | None]:
    """Whether the backend can run here, and why not (devices do not change within a process)."""
    if _ext is None:
        return False, f"the TileLang CUDA kernels are not built into this install (run `python build.py`; {IMPORT_ERROR})"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return False, "no CUDA GPU is visible to JAX"
    cc = getattr(gpus[0], "compute_capability", None)
    if cc != "9.0":
        return False, f"the kernels are built for Hopper (sm_90a), this GPU has compute capability {cc}"
    return True, None

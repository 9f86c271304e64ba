"""The built extension (`fla_jax._ext`): loading it, registering its FFI targets with XLA, calling one
program, and whether the kernels can run here."""

from __future__ import annotations

import functools

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


def call(p: Problem, target: str, results, *args, init=None, **attrs):
    """`ffi_call` of one kernel program of call `p`; with its `Config.poison_outputs` its outputs start as NaN.
    `init`: the outputs' contents before the call, for a program that updates them in place (never poisoned)."""
    single = not isinstance(results, tuple)
    results = (results,) if single else results
    if config.of(p).poison_outputs or init is not None:
        init = init or [jnp.full(r.shape, jnp.nan, r.dtype) for r in results]
        aliases = {len(args) + i: i for i in range(len(results))}
        out = jax.ffi.ffi_call(f"{target}_aliased", results, vmap_method="sequential", input_output_aliases=aliases)(
            *args, *init, **attrs
        )
    else:
        out = jax.ffi.ffi_call(target, results, vmap_method="sequential")(*args, **attrs)
    return out[0] if single else tuple(out)


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

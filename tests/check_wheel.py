"""Checks an installed fla_jax wheel (`python build.py --wheel`), run by .ci/run in a fresh virtual environment
that has nothing but the wheel and what it requires, from outside the checkout:

    python -m venv /tmp/w && /tmp/w/bin/pip install dist/fla_jax-*.whl && (cd /tmp && /tmp/w/bin/python tests/check_wheel.py)

No GPU needed: the package imports from site-packages with no build-time package (`kernels`, TileLang,
torch), registers every dispatched program's FFI target, and a GDN training step lowered for CUDA calls
registered targets only. Exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import sysconfig

import jax
import jax.numpy as jnp


def main() -> int:
    import fla_jax
    from fla_jax import _variants, tilelang_backend

    where = fla_jax.__file__
    assert where.startswith(sysconfig.get_paths()["purelib"]) or where.startswith(sysconfig.get_paths()["platlib"]), where
    assert importlib.util.find_spec("kernels") is None, "the build-time package `kernels` is importable beside the wheel"
    needs = " ".join(importlib.metadata.requires("fla_jax") or ())
    assert not any(n in needs for n in ("tilelang", "torch", "nanobind")), needs
    registered = set(tilelang_backend.registered())
    dispatched = {v.target(p) for v in _variants.VARIANTS for p in v.programs}
    assert registered == dispatched, (len(registered), len(dispatched), sorted(dispatched ^ registered)[:3])
    status = fla_jax.backends()["tilelang"]
    assert status.usable or "GPU" in status.reason, status

    S = jax.ShapeDtypeStruct
    q, g = S((2, 256, 4, 128), jnp.bfloat16), S((2, 256, 4), jnp.float32)
    e = fla_jax.explain(fla_jax.chunk_gated_delta_rule, q, q, q, g, g, use_qk_l2norm_in_kernel=True)
    assert e.kernels_take_it and e.training and set(e.forward + e.training) <= registered, e
    loss = lambda *a: jnp.sum(fla_jax.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, backend="tilelang")[0].astype(jnp.float32))
    if status.usable:  # (on a Hopper GPU the op itself takes the kernels; elsewhere explain's lowering stands for it)
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(q, q, q, g, g).lower(lowering_platforms=("cuda",)).as_text()
        assert set(re.findall(r"custom_call @(fla_\w+?)[(\s]", text)) <= registered
        keys = jax.random.split(jax.random.key(0), 5)
        args = [jax.random.normal(kk, a.shape, jnp.float32).astype(a.dtype) for kk, a in zip(keys, (q, q, q, g, g))]
        args[3], args[4] = -jax.nn.softplus(args[3]), jax.nn.sigmoid(args[4])
        ours, xla = (jax.jit(lambda *a, b=b: fla_jax.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, backend=b)[0])(*args)
                     for b in ("tilelang", "xla"))
        err = float(jnp.linalg.norm((ours - xla).astype(jnp.float32)) / jnp.linalg.norm(xla.astype(jnp.float32)))
        assert err < 0.01, err
        print(f"wheel check: GDN on the kernels against XLA, relative error {err:.1e}")
    print(f"wheel check: fla_jax {fla_jax.__version__} from {where}, {len(registered)} targets registered, "
          f"GDN step on the kernels: {', '.join(n.rsplit('_c64_', 1)[1] for n in e.training)}; tilelang here: {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

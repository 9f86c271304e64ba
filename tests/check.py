"""Comparison helpers: fla's relative RMS error ratio, against the float64 reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from cases import Case, forward_outputs, loss_and_outputs, make_inputs
from ref64 import naive


def err_ratio(ref, x) -> float:
    """`||ref - x|| / ||ref||` in float64; NaN or inf anywhere in x gives inf."""
    ref = np.asarray(ref, np.float64)
    x = np.asarray(jnp.asarray(x).astype(jnp.float64))
    if ref.shape != x.shape:
        raise AssertionError(f"shape {x.shape} != reference {ref.shape}")
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.linalg.norm(ref - x) / max(np.linalg.norm(ref), 1e-30))


def reference_grads(case: Case, diff: dict, cot: dict):
    """`(grads, (o, ht))` of the float64 reference for the same loss the tests use."""
    f64 = {n: jnp.asarray(a, jnp.float64) for n, a in diff.items()}
    return _ref_fn(case)(f64, {n: jnp.asarray(a, jnp.float64) for n, a in cot.items()})


def errors_against_float64(case: Case, seed: int, backend: str = "tilelang", terms: tuple[str, ...] = ("o", "ht")) -> dict[str, float]:
    """`err_ratio` against the float64 reference of o and ht under a gradient (`o`, `ht`) and with
    none (`o fwd`, `ht fwd`: the forward's own programs), and of every gradient (`d<name>`) of a
    loss of the outputs named in `terms` (the reference's loss with zero cotangents for the others)."""
    diff, cot = make_inputs(case, seed)
    ref_cot = {n: a if n[1:] in terms else jnp.zeros_like(a) for n, a in cot.items()}  # ("do", "dht")
    ref_g, (ref_o, ref_ht) = reference_grads(case, diff, ref_cot)
    grads, (o, ht) = loss_and_outputs(case, backend, terms)(diff, cot)
    fo, fht = forward_outputs(case, backend)(diff)
    errs = {"o": err_ratio(ref_o, o), "ht": err_ratio(ref_ht, ht), "o fwd": err_ratio(ref_o, fo), "ht fwd": err_ratio(ref_ht, fht)}
    return errs | {"d" + n: err_ratio(ref_g[n], grads[n]) for n in diff}


@functools.lru_cache(maxsize=None)
def _ref_fn(case: Case):
    def loss(d, cot):
        g = d.get("g")
        if "g_gamma" in d:
            g = jnp.broadcast_to(d["g_gamma"], (case.B, case.T, case.H))
        o, ht = naive(
            case.op, d["q"], d["k"], d["v"], g, d.get("beta"), scale=case.scale, h0=d.get("initial_state"),
            cu=None if case.cu is None else list(case.cu), l2norm=case.l2norm,
        )
        return jnp.sum(o * cot["do"]) + jnp.sum(ht * cot["dht"]), (o, ht)

    return jax.jit(jax.grad(loss, has_aux=True))

"""One grid of problem shapes for the tests (and the benchmarks' shapes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import fla_jax

OPS = {
    "simple_gla": fla_jax.chunk_simple_gla,
    "gla": fla_jax.chunk_gla,
    "delta_rule": fla_jax.chunk_delta_rule,
    "gated_delta_rule": fla_jax.chunk_gated_delta_rule,
}


# the tilelang programs that sum the gates per step themselves (kernels/variants.py G_SCAN: simple GLA's state pass, the
# delta rules' inverse and training WY kernel), and the WY VJP that sums their gradient back to the steps (DG_SUM), as
# `TileLangConfig.experiments` entries that put them in the dispatched programs' place
GATE_SCAN_EXPERIMENTS = {("simple_gla", "fwd", "fused"): "x_fused_scan", ("delta", "fwd", "inv"): "x_inv_scan",
                         ("delta", "fwd", "inv_l2"): "x_inv_l2_scan", ("delta", "fwd", "wy_t_l2"): "x_wy_t_l2_scan",
                         ("delta", "bwd", "wy_bwd_l2"): "x_wy_bwd_l2_sum"}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    B: int
    T: int
    H: int
    K: int
    V: int
    dtype: str = "float32"
    HV: int | None = None  # GDN grouped value heads
    h0: bool = False
    norm: float = 1.0  # gate logit normaliser: 0.1 strong decay, 10 weak
    cu: tuple[int, ...] | None = None  # varlen boundaries (B must be 1)
    l2norm: bool = False
    gate: str = "g"  # simple_gla: "g", "g_gamma" or "none"
    chunk_size: int = 64
    scale: float | None = None

    def __str__(self):
        s = f"{self.op}-B{self.B}-T{self.T}-H{self.H}-K{self.K}-V{self.V}-{self.dtype}"
        if self.HV:
            s += f"-HV{self.HV}"
        if self.h0:
            s += "-h0"
        if self.norm != 1.0:
            s += f"-norm{self.norm}"
        if self.cu:
            s += "-varlen" + "_".join(map(str, self.cu))
        if self.l2norm:
            s += "-l2"
        if self.gate != "g":
            s += f"-{self.gate}"
        if self.chunk_size != 64:
            s += f"-C{self.chunk_size}"
        if self.scale is not None:
            s += f"-scale{self.scale}"
        return s

    @property
    def n_seqs(self):
        return self.B if self.cu is None else len(self.cu) - 1

    @property
    def heads_v(self):
        return self.HV or self.H


def make_inputs(case: Case, seed: int) -> tuple[dict, dict]:
    """Random inputs: (differentiable arrays by keyword, cotangents `do`, `dht`)."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(case.dtype)
    B, T, H, K, V, HV = case.B, case.T, case.H, case.K, case.V, case.heads_v
    randn = lambda *s: rng.standard_normal(s)
    logsig = lambda x: -np.logaddexp(0, -x)
    q, k = randn(B, T, H, K), randn(B, T, H, K)
    if case.op in ("delta_rule", "gated_delta_rule") and not case.l2norm:
        k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    diff = {"q": jnp.asarray(q, dt), "k": jnp.asarray(k, dt), "v": jnp.asarray(randn(B, T, HV, V), dt)}
    if case.op == "simple_gla" and case.gate == "g":
        diff["g"] = jnp.asarray(logsig(randn(B, T, H)) / case.norm, jnp.float32)
    elif case.op == "simple_gla" and case.gate == "g_gamma":
        diff["g_gamma"] = jnp.asarray(logsig(randn(H)) / case.norm, jnp.float32)
    elif case.op == "gla":
        diff["g"] = jnp.asarray(logsig(randn(B, T, H, K)) / case.norm, jnp.float32)
    elif case.op == "gated_delta_rule":
        diff["g"] = jnp.asarray(logsig(randn(B, T, HV)) / case.norm, jnp.float32)
    if case.op in ("delta_rule", "gated_delta_rule"):
        diff["beta"] = jnp.asarray(1 / (1 + np.exp(-randn(B, T, HV))), jnp.float32)
    if case.h0:
        diff["initial_state"] = jnp.asarray(randn(case.n_seqs, HV, K, V), jnp.float32)
    cot = {"do": jnp.asarray(randn(B, T, HV, V), jnp.float32), "dht": jnp.asarray(randn(case.n_seqs, HV, K, V), jnp.float32)}
    return diff, cot


def static_kwargs(case: Case) -> dict:
    kw = {"scale": case.scale, "output_final_state": True}
    if case.cu is not None:
        kw["cu_seqlens"] = jnp.asarray(case.cu, jnp.int32)
    if case.op in ("delta_rule", "gated_delta_rule"):
        kw["use_qk_l2norm_in_kernel"] = case.l2norm
    if case.op == "simple_gla":
        kw["chunk_size"] = case.chunk_size
    return kw


def loss_and_outputs(case: Case, backend: str, terms: tuple[str, ...] = ("o", "ht")):
    """A jitted `diff, cot -> (grads, (o, ht))` for one backend; the loss takes the outputs named in
    `terms` (an output it does not take has a symbolic zero cotangent)."""
    op = OPS[case.op]

    def loss(diff, cot):
        o, ht = op(**diff, **static_kwargs(case), backend=backend)
        l = (jnp.sum(o.astype(jnp.float32) * cot["do"]) if "o" in terms else 0.0) + (jnp.sum(ht * cot["dht"]) if "ht" in terms else 0.0)
        return l, (o, ht)

    return jax.jit(jax.grad(loss, has_aux=True))


def forward_outputs(case: Case, backend: str):
    """A jitted `diff -> (o, ht)` for one backend: the forward with no gradient."""
    return jax.jit(lambda diff: OPS[case.op](**diff, **static_kwargs(case), backend=backend))


# The delta rules' tilelang backward, (`Config.delta_fused_bwd`, `delta_wy_bwd_kernel`, `delta_grads_kernel`): its
# chunk-parallel parts as XLA VJPs, the per-chunk part by the consumer kernel, the WY VJP by its kernel
# too, and the two in one program wherever it is built (K <= 128; elsewhere as all_kernels).
DELTA_BWD_MODES = {"xla_vjps": (False, False, ()), "consumer_kernel": (True, False, ()), "all_kernels": (True, True, ()),
                   "grads_kernel": (True, True, (64, 128))}


def delta_bwd_config(mode: str, **more) -> fla_jax.TileLangConfig:
    """The tilelang configuration of one of DELTA_BWD_MODES (and `more` settings)."""
    fused, wy_kernel, grads = DELTA_BWD_MODES[mode]
    return fla_jax.TileLangConfig(delta_fused_bwd=fused, delta_wy_bwd_kernel=wy_kernel, delta_grads_kernel=grads, **more)

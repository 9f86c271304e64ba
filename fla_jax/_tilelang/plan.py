"""The tilelang backend's planner: every choice of which programs run a call, and of the pieces its state passes walk,
as pure functions of the call (its `Problem` with the `Config`, head dims, sequences and heads). The op modules
(`simple_gla`, `gla`, `delta`) ask it and decide nothing themselves; `plan` gathers its answers for one call
(`fla_jax.explain` prints them).

Program lookup: each kind (`fused`, `dh`, ...) maps to the variant's dispatched program, or to the experiment that
`Config.experiments` puts in its place."""

from __future__ import annotations

import dataclasses

from fla_jax._problem import Problem
from fla_jax._tilelang import config
from fla_jax._variants import find as find_variant


def targets(p: Problem, direction: str, K: int, V: int) -> dict[str, str]:
    """{program name: FFI target} of one variant, each kind's the program that runs (`program`):
    also a kind that only an experiment put in place by `Config.experiments` provides there. The variants are
    per K (their head_v = K); V is that of the call (the gated ops' programs take it on their grid)."""
    del V
    variant = find_variant("delta" if p.delta else p.op, direction, p.dtype, K, K)
    kinds = [prog.name for prog in variant.programs]
    kinds += [prog.of for prog in variant.experiments if prog.of not in kinds and chosen(p, direction, prog)]
    return {prog.name: variant.target(prog) for prog in variant.experiments} | {
        kind: variant.target(program(p, direction, K, kind)) for kind in kinds}


def chosen(p: Problem, direction: str, prog) -> bool:
    """Whether `Config.experiments` puts experiment `prog` in its kind's place."""
    return config.of(p).overrides().get(("delta" if p.delta else p.op, direction, prog.of)) == prog.name


def program(p: Problem, direction: str, K: int, name: str):
    """The `fla_jax._variants.Program` of one kind that runs: the dispatched one, or the experiment
    that `Config.experiments` puts in its place (its config decides how its inputs are laid out)."""
    variant = find_variant("delta" if p.delta else p.op, direction, p.dtype, K, K)
    picked = next((prog for prog in variant.experiments if prog.of == name and chosen(p, direction, prog)), None)
    return picked or next(prog for prog in variant.programs if prog.name == name)


def program_config(p: Problem, direction: str, K: int, name: str) -> dict:
    """The config of the program of one kind that runs (`program`)."""
    return dict(program(p, direction, K, name).config)


def value_parts(p: Problem, K: int, V: int) -> int:
    """In how many float32 parts the backward's consumer writes what sums over the key channels:
    1 (dv in the input dtype), or K / BK where it splits the key channels over programs (dv as
    `[parts, L, HV, V]`, and but for GLA, whose dg is per channel, dg as `[parts, L, HV]`)."""
    del V  # (variants have K = V)
    return K // program_config(p, "bwd", K, "dqkvg").get("BK", K)


def v_twin(targets: dict[str, str], name: str, K: int, V: int) -> str:
    """The program of kind `name` for head dims K, V (`targets`: the variant's): `name`, or at V != K its twin that
    takes V on its grid where `name` takes V = K alone (`<name>_v`: the gated ops' backward)."""
    return f"{name}_v" if V != K and f"{name}_v" in targets else name


def state_programs(N: int, H: int, V: int) -> int:
    """The forward state pass's programs: one per V block of 64, sequence and (value) head."""
    return N * H * max(1, V // 64)


def pieces(p: Problem, N: int, HV: int, V: int, nt: int) -> int:
    """In how many pieces the state passes walk each of N sequences of (on average) nt chunks: a power of two
    such that their programs number at most `Config.split_programs`, each piece `Config.split_min_chunks`
    chunks at least; 1 where the programs fill a quarter of `split_programs` already. (The pieces' extra
    passes move the tokens again: they pay where a pass's time is its chain's, few programs walking many
    chunks; with twice the programs the extra traffic outweighs the shorter chains. RESULTS.md: one long
    sequence.)"""
    cfg = config.of(p)
    programs, P = state_programs(N, HV, V), 1
    if programs * 4 > cfg.split_programs:
        return 1
    while programs * P * 2 <= cfg.split_programs and nt // (P * 2) >= cfg.split_min_chunks:
        P *= 2
    return P


def stores_gate_rows(p: Problem, K: int) -> bool:
    """Whether the forward under a gradient hands the backward G's per-chunk rows (`gate_rows`, as
    `[B, NT_b, HV, C]`): simple GLA's and the delta rules' where both their forward storing h and
    their reverse pass load them by TMA (`g_rows`, K <= 128), so that they are formed once (by XLA's
    transpose, or by the delta rules' WY kernel where it sums the gates, `g_scan`)."""
    return p.op != "gla" and all(program_config(p, d, K, name).get("g_rows", False) for d, name in (("fwd", "fused_h"), ("bwd", "dh")))


def forward_split_pieces(p: Problem, *, gradient: bool, varlen: bool, B: int, H: int, K: int, V: int, nt: int) -> int:
    """Simple GLA's forward with no gradient on dense input (`simple_gla.split_forward`): in how many pieces its
    state pass walks each of B sequences of nt chunks (`Config.split_programs`), a power of two dividing nt. 1
    (no split) for the other ops, under a gradient (the backward takes h from one pass: the state passes' own
    pieces serve it, `pieces`), with varlen tables (sequences of unequal length) and at V != K (`enter` is built for
    V = K: it does not take V on its grid)."""
    if p.op != "simple_gla" or gradient or varlen or V != K:
        return 1
    cfg = config.of(p)
    programs, pieces = state_programs(B, H, V), 1
    while programs * pieces * 2 <= cfg.split_programs and nt % (pieces * 2) == 0 and nt // (pieces * 2) >= cfg.split_min_chunks:
        pieces *= 2
    return pieces


def delta_carry_pass(targets: dict[str, str]) -> str:
    """The delta rules' program for the passes over pieces that carry states alone under a gradient (`common.state_pass`'s
    `light`): the chain alone (`fused_s`, K <= 128), else the forward pass storing no h (`fused`)."""
    return "fused_s" if "fused_s" in targets else "fused"


def delta_wy(store_h: bool, l2norm: bool) -> str:
    """The delta rules' WY kernel of the forward: under a gradient storing T (from the raw q and k with `l2norm`), else
    w and u alone."""
    return ("wy_t_l2" if l2norm else "wy_t") if store_h else "wy"


def delta_state_pass_t(p: Problem, targets: dict, l2norm: bool, N: int, HV: int, V: int, nt: int) -> str:
    """The delta rules' forward from the inverse: its state pass's program for N sequences of nt chunks on average
    and HV value heads, each sequence in `pieces` (`Config.delta_narrow_programs`: V blocks of 32 where those of 64
    leave SMs idle)."""
    name = "fused_t_l2" if l2norm else "fused_t"
    narrow = f"{name}_v32"
    programs = state_programs(N * pieces(p, N, HV, V, nt), HV, V)
    return narrow if narrow in targets and 2 * programs <= config.of(p).delta_narrow_programs else name


def delta_carry_t(p: Problem, targets: dict, l2norm: bool) -> str | None:
    """The delta rules' forward from the inverse, walking pieces: the program giving the pieces' states from zeros
    and their maps of the state in one launch (`Config.delta_carry_t`, K <= 128), or None (two passes of the state
    pass's own program)."""
    name = "carry_t_l2" if l2norm else "carry_t"
    return name if config.of(p).delta_carry_t and name in targets else None


def folds_l2norm(p: Problem, K: int) -> bool:
    """Whether the forward with no gradient normalises q and k in its kernels (the inverse and the
    state pass from it, `inv_l2`, `fused_t_l2`), rather than after XLA's pass."""
    cfg = config.of(p)
    return p.delta and K in cfg.delta_fwd_inverse and cfg.delta_l2norm_fused and "inv_l2" in targets(p, "fwd", K, K)


def folds_l2norm_h(p: Problem, K: int) -> bool:
    """Whether the forward under a gradient normalises q and k in its WY kernel (`wy_t_l2`, which
    also writes them normalised and their `1 / |x|` for the backward), rather than by a `norm`
    pass each before it."""
    return p.delta and config.of(p).delta_l2norm_fused and "wy_t_l2" in targets(p, "fwd", K, K)


def delta_forward_from_inverse(p: Problem, K: int, store_h: bool) -> bool:
    """Whether the delta rules' forward runs from the gate-free inverse (`inv` + `fused_t`: no gradient, at the head
    dims of `Config.delta_fwd_inverse`), rather than from the WY kernel's w and u (`wy` + `fused`)."""
    return not store_h and K in config.of(p).delta_fwd_inverse


@dataclasses.dataclass(frozen=True)
class DeltaBackward:
    """The delta rules' backward after the reverse pass: `grads` the one program of the consumer and the WY VJP
    (None: two, `consumer` and `wy` saying for each whether a kernel runs it or JAX's VJP in XLA); `q_norm`,
    `k_norm` whether the programs that form dq and dk fold the normalisation's gradient in (else a `norm_bwd`
    pass each)."""

    grads: str | None
    consumer: bool
    wy: bool
    q_norm: bool
    k_norm: bool


def delta_backward(p: Problem, K: int, l2norm: bool, bwd: dict[str, str]) -> DeltaBackward:
    """The delta rules' backward programs at head dim K (`bwd`: the variant's targets)."""
    cfg = config.of(p)
    fused, wy_kernel = cfg.delta_fused_bwd, cfg.delta_wy_bwd_kernel
    q_norm = l2norm and cfg.delta_l2norm_fused and fused and "dqkvg_l2" in bwd
    k_norm = l2norm and cfg.delta_l2norm_fused and fused and wy_kernel
    name = "grads_l2" if q_norm and k_norm else "grads"
    if K in cfg.delta_grads_kernel and fused and wy_kernel and name in bwd:
        return DeltaBackward(grads=name, consumer=True, wy=True, q_norm=name == "grads_l2", k_norm=name == "grads_l2")
    return DeltaBackward(grads=None, consumer=fused, wy=wy_kernel, q_norm=q_norm, k_norm=k_norm)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the planner decides for one call on the kernels (`plan`): the pieces each sequence's state passes walk
    with no gradient and under one (1: whole sequences), and the programs named by kind."""

    forward_pieces: int
    training_pieces: int
    forward: tuple[str, ...]
    training: tuple[str, ...]

    def __str__(self) -> str:
        pieces = lambda P: "whole sequences" if P == 1 else f"{P} pieces each"
        return (f"forward: {', '.join(self.forward)} ({pieces(self.forward_pieces)}); "
                f"training step: {', '.join(self.training)} ({pieces(self.training_pieces)})")


def plan(p: Problem, *, K: int, V: int, N: int, HV: int, nt: int, l2norm: bool, varlen: bool) -> Plan:
    """The planner's choices for a call of N sequences (rows, or varlen sequences) of nt chunks each on average,
    HV value heads, at the programs' head dims K, V (after `fla_jax._tiling`)."""
    fwd, bwd = targets(p, "fwd", K, K), targets(p, "bwd", K, K)
    P_split = forward_split_pieces(p, gradient=False, varlen=varlen, B=N, H=HV, K=K, V=V, nt=nt)
    P_step = pieces(p, N, HV, V, nt)
    P_fwd = P_split if P_split > 1 else P_step
    if p.delta:
        if delta_forward_from_inverse(p, K, False):
            l2 = l2norm and folds_l2norm(p, K)
            carry_t = delta_carry_t(p, fwd, l2) if P_fwd > 1 else None
            forward = ("inv_l2" if l2 else "inv", *((carry_t,) if carry_t else ()), delta_state_pass_t(p, fwd, l2, N, HV, K, nt))
        else:  # (q and k normalised by XLA before the kernels where asked)
            forward = ("wy", "fused")
        l2h = l2norm and folds_l2norm_h(p, K)
        carry = (delta_carry_pass(fwd),) if P_step > 1 else ()
        b = delta_backward(p, K, l2norm, bwd)
        two = (*(("dqkvg_l2" if b.q_norm else "dqkvg",) if b.consumer else ()), *(("wy_bwd_l2" if b.k_norm else "wy_bwd",) if b.wy else ()))
        after = (b.grads,) if b.grads else two
        norms = ("norm_bwd",) if l2norm and not (b.q_norm and b.k_norm) else ()
        training = (*(("norm",) if l2norm and not l2h else ()), delta_wy(True, l2h), *carry, "fused_h", "dh", *after, *norms)
    else:  # (under a gradient the pieces' passes that carry states alone store no h: `fused`)
        carry = ("fused",) if P_step > 1 else ()
        if p.op == "gla":
            forward, training = ("a", "fused"), ("a", *carry, "fused_h", v_twin(bwd, "dh", K, V), v_twin(bwd, "dqkvg", K, V))
        else:
            forward = ("fused", "enter") if P_split > 1 else ("fused",)
            training = (*carry, "fused_h", v_twin(bwd, "dh", K, V), v_twin(bwd, "dqkvg", K, V))
    return Plan(forward_pieces=P_fwd, training_pieces=P_step, forward=forward, training=training)

"""The `tilelang` backend: TileLang CUDA kernels, built ahead of time by build.py into
`fla_jax._ext`, called through XLA FFI custom calls.

Built so far: simple GLA (`kernels/simple_gla/`): forward (one pass, states kept on chip; under a
gradient it also stores the state before each chunk; without one, where the pass's programs would
leave SMs idle, in pieces of each sequence at once, `Config.split_programs`) and backward (reverse state-gradient pass, one
fused dq/dk/dv/dg consumer), bf16/fp16 inputs, K = V in {64, 128, 256}, dense batches and
`cu_seqlens`. GLA (`kernels/gla/`): the intra-chunk matrix A (chunk-wide on the tensor cores where
the chunk's gate range allows, else by sub-chunks) and the gates' in-chunk cumulative sums, a
forward state pass reading them, and the backward as simple GLA's (reverse state-gradient pass, one
fused consumer that also takes the reverse cumulative sum of dg), with gates per key channel. The delta rules and GDN (`kernels/delta/`): WY preparation, forward state pass and
reverse state-gradient pass (which also stores the gradient of v_new) as kernels, and the
backward's chunk-parallel parts by two more kernels
(`Config.delta_fused_bwd`, `delta_wy_bwd_kernel`; switched off, JAX VJPs do them), at K = 128 by
one (`delta_grads_kernel`), and
`use_qk_l2norm_in_kernel` inside the kernels where `delta_l2norm_fused` (the forward's inverse or
WY kernel normalises q and k, the backward's consumer and WY VJP take its gradient), else by a
normalisation kernel each way.
Everything else answers `unsupported(...)` with the reason, and "auto" falls back to `xla`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from fla_jax import _layout, _partition, _tiling, xla
from fla_jax._problem import Problem, l2_normalise

def _load_extension(name: str = "fla_jax._ext"):
    """`(module, None)`, or `(None, why)` where the extension is not built or does not load."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(name) is None:  # (importing it then would fail with a circular-import message)
        return None, f"{name} is not built"
    try:
        return importlib.import_module(name), None
    except ImportError as e:  # built, but it does not load here
        return None, f"{name} does not load: {e}"


_ext, IMPORT_ERROR = _load_extension()
if _ext is not None:
    for _name, _capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")

from fla_jax._variants import HEAD_DIMS, find as _find_variant


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """How the kernels run a call: the dispatched choices by default; alternatives for tests and benchmarks.
    Passed explicitly, `chunk_gla(..., backend=fla_jax.TileLangConfig(...))` (the tilelang backend with this
    configuration), and part of what the op traces and caches, so a compiled function cannot disagree with it.
    Measurements behind the defaults: benchmarks/RESULTS.md and git history."""

    # The delta rules' backward after the reverse pass: the per-chunk part by the simple GLA consumer kernel on
    # v_new (`chunk_bwd_dqkvg(delta=True)`), and the WY preparation's VJP by a kernel
    # (`kernels/delta/wy.py` `chunk_delta_wy_bwd`), each instead of JAX's VJP in XLA (several times slower).
    delta_fused_bwd: bool = True
    delta_wy_bwd_kernel: bool = True
    # The head dims at which the consumer and the WY VJP run as one program (`kernels/delta/grads.py`, built at
    # K <= 128; with both switches above): h, k and dk read or formed once, three warpgroups handing each other
    # their products through shared memory, one program per SM. Not at K = 64, where the two programs each run
    # several programs to an SM and the fused one runs one, and measured slower.
    delta_grads_kernel: tuple[int, ...] = (128,)
    # The gates' in-chunk cumulative sums (and their VJP) in XLA as one float32 product with a triangle of
    # ones (`_in_chunk_cumsum`), the per-chunk rows loaded by TMA (`g_rows`) straight from it, instead of
    # XLA's scan and a transpose. Off: it saved ~1.5 us a call, within the ops' spread.
    gate_sum_dot: bool = False
    # The head dims at which the delta rules' forward with no gradient runs from the gate-free inverse T0
    # (`chunk_delta_wy(inverse_only=True)`, program `inv`) and `chunk_delta_fwd_t` (`fused_t`, which forms
    # v_new = Ag (v - exp(G) k S) on chip), instead of the WY kernel's w and u (jla's forward).
    delta_fwd_inverse: tuple[int, ...] = (64, 128, 256)
    # The forward from the inverse where few sequences and heads leave SMs idle: where its state pass's
    # programs (one per V block of 64, sequence and value head) number at most half this (the H200's SMs),
    # V blocks of 32 (`fused_t_v32`, `fused_t_l2_v32`: twice the programs). 0 switches it off.
    delta_narrow_programs: int = 132
    # use_qk_l2norm_in_kernel folded into the kernels: under a gradient the normalisation's gradient in the
    # backward's consumer (`dqkvg_l2`, K <= 128) and WY VJP (`wy_bwd_l2`) instead of a `norm_bwd` pass per
    # tensor, the normalisation in the WY kernel (`wy_t_l2`) instead of a `norm` pass per tensor; without a
    # gradient, from the inverse, in `inv_l2` and `fused_t_l2` instead of XLA's pass before them.
    delta_l2norm_fused: bool = True
    # Simple GLA's forward with no gradient on dense input: where the state pass's programs (one per V block,
    # sequence and head) number at most half `split_programs`, each sequence is walked in 2, 4, ... pieces at
    # once (of at least `split_min_chunks` chunks), every piece but the first from a zero state; XLA carries
    # the pieces' final states into the states entering them, and `chunk_fwd_enter` adds their part to the
    # later pieces' output in place. 0 switches it off.
    split_programs: int = 132
    split_min_chunks: int = 8
    # Calls with no initial state: the forward state passes get `h0` with no rows and start from zeros
    # themselves (`kernels.common.initial_state`), so XLA writes no `[N, H, K, V]` zeros for them; likewise
    # the reverse passes where the loss takes no final state (`dht` with no rows), and with no initial state
    # they write no `dh0` (`kernels.common.final_state`). XLA's zeros when off.
    zero_row_h0: bool = True
    zero_row_dht: bool = True
    # Dot precision of the XLA parts of the delta-rule backward (`_delta_local`'s VJP, `_wy_vjp`, with the
    # switches above off): three bf16 passes with float32 accumulation (about 16 mantissa bits; no TF32).
    vjp_precision: jax.lax.DotAlgorithmPreset | jax.lax.Precision = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    # Tests: every kernel writes into NaN-filled buffers (`_call`), so an output element that a kernel
    # leaves unwritten shows up as NaN.
    poison_outputs: bool = False
    # Built experiments in place of dispatched programs (`benchmarks/bench.py --experiments`, tests):
    # ((op, direction, program name), experiment name) pairs; where a variant has no such experiment its
    # own program runs. Empty: the dispatched programs only.
    experiments: tuple[tuple[tuple[str, str, str], str], ...] = ()

    def overrides(self) -> dict[tuple[str, str, str], str]:
        return dict(self.experiments)


DEFAULT = Config()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Configured(Problem):
    """A call as this backend runs it: the `Problem` and the `Config` (hashable: the custom VJP's static
    argument and the partitioned functions' cache key)."""

    cfg: Config = DEFAULT


def _cfg(p: Problem) -> Config:
    """The configuration of a call (the default for a bare `Problem`)."""
    return p.cfg if isinstance(p, Configured) else DEFAULT


def configured(p: Problem, cfg: Config | None = None) -> Configured:
    """`p` with the configuration `cfg` (the default where None)."""
    return Configured(op=p.op, delta=p.delta, chunk_size=p.chunk_size, dtype=p.dtype, cfg=cfg or DEFAULT)


def registered() -> list[str]:
    """The FFI targets this install registered (each program also has a `_aliased` twin)."""
    return [] if _ext is None else sorted(n for n in _ext.registrations() if not n.endswith("_aliased"))


def _call(p: Problem, target: str, results, *args, init=None, **attrs):
    """`ffi_call` of one kernel program of call `p`; with its `Config.poison_outputs` its outputs start as NaN.
    `init`: the outputs' contents before the call, for a program that updates them in place (never poisoned)."""
    single = not isinstance(results, tuple)
    results = (results,) if single else results
    if _cfg(p).poison_outputs or init is not None:
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


def unsupported(p: Problem, *, K: int, V: int, varlen: bool, grouped: bool, l2norm: bool, installed: bool = True) -> str | None:
    """Why the kernels cannot take this call, or None when they can (`cu_seqlens` is supported).
    `installed`: also where this install's extension lacks a program the call needs."""
    del varlen, grouped, l2norm  # grouped heads and l2 normalisation exist only for the delta rules
    if p.chunk_size != 64:
        return f"the kernels use chunk_size 64, got {p.chunk_size}"
    t = _tiling.tiling(p.op, K, V, HEAD_DIMS)
    if isinstance(t, str):
        return t
    op = "delta" if p.delta else p.op
    variants = [_find_variant(op, d, p.dtype, t.D, t.D) for d in ("fwd", "bwd")]
    if None in variants:
        return f"no kernel built for dtype {p.dtype} (built: bfloat16 and float16)"
    missing = sorted({v.target(prog) for v in variants for prog in v.programs} - set(registered())) if installed else ()
    if missing:
        return f"the built extension lacks {missing[0]} (and {len(missing) - 1} more): rebuild with `python build.py`"
    return None


def run(p: Problem, q, k, v, g, beta, h0, cu_seqlens, *, scale: float, l2norm: bool = False, config: Config | None = None):
    """`config`: how the kernels run it (`Config`; the default where None). Raw inputs (q, k, v in their dtype, not scaled, not normalised), as `_compute` hands them
    to this backend; `h0` None where the call has no initial state (the kernels then start from
    zero states, and XLA writes none for them).

    q and k are l2-normalised inside the op when asked (delta rules; `_op`). Tokens are laid
    out in chunk rows as for the xla backend (`fla_jax._layout`: every sequence starts at a chunk
    boundary, zeros in padding slots). The gates go in per step: the in-chunk cumulative sum is
    taken inside the op (`_op`), by XLA or by the kernel that reads them (`g_scan`)."""
    p = configured(p, config)
    T = q.shape[1]
    C = p.chunk_size
    t = tiling(p, q.shape[-1], v.shape[-1])
    q, k, v, g, beta, h0 = _tiling.fold(t, delta=p.delta, q=q, k=k, v=v, g=g, beta=beta, h0=h0)
    layout = _layout.make_layout(T, cu_seqlens, C)
    g32 = jnp.zeros(v.shape[:3], jnp.float32) if g is None else g.astype(jnp.float32)  # GLA: [B, T, H, K]
    if g32.ndim == 3:  # (a decay of zero, g = -inf, as the xla backend takes it: `xla.GATE_FLOOR`; fused into XLA's
        g32 = jnp.maximum(g32, xla.GATE_FLOOR)  # in-chunk sums. GLA's kernel clamps its per-channel gates itself)
    beta = beta.astype(jnp.float32) if p.delta else None
    q, k, v, g32, beta = (_layout.pack(x, layout) for x in (q, k, v, g32, beta))
    tables = () if cu_seqlens is None else _layout.chunk_ranges(cu_seqlens, C)
    tokens = (q, k, v, g32) + ((beta,) if p.delta else ())
    state = () if h0 is None else (h0.astype(jnp.float32),)
    o, ht = _op(p, float(scale), l2norm, h0 is not None, *tokens, *state, *tables)
    return _tiling.unfold(t, _layout.unpack(o, layout, T), ht)


def tiling(p: Problem, K: int, V: int) -> _tiling.Tiling:
    """How a call with head dims K and V runs on the square programs (`fla_jax._tiling`); only for a
    call that `unsupported` takes."""
    t = _tiling.tiling(p.op, K, V, HEAD_DIMS)
    assert not isinstance(t, str), t
    return t


def _in_chunk_cumsum(p: Problem, g, C: int, reverse: bool = False):
    """The cumulative sum of the per-step gates within each chunk of `C` rows (axis 1 of chunk rows
    `[B, NT * C, H]`, or axis 0 of flat ones `[NT * C, H]`); `reverse`: from each chunk's end (the
    sum's VJP). Under `Config.gate_sum_dot` a matrix product (`_in_chunk_rows`)."""
    if _cfg(p).gate_sum_dot:
        return jnp.swapaxes(_in_chunk_rows(g, C, reverse), -1, -2).reshape(g.shape)
    axis = 1 if g.ndim == 3 else 0
    x = g.reshape(*g.shape[:axis], -1, C, *g.shape[axis + 1 :])
    if reverse:
        return jnp.flip(jnp.cumsum(jnp.flip(x, axis + 1), axis=axis + 1), axis + 1).reshape(g.shape)
    return jnp.cumsum(x, axis=axis + 1).reshape(g.shape)


def _in_chunk_rows(g, C: int, reverse: bool = False):
    """`_in_chunk_cumsum` of `g` (`[..., NT * C, H]`) as per-chunk rows `[..., NT, H, C]` (`_gate_rows`'s
    layout): one float32 product with a triangle of ones, whose result has that layout."""
    x = g.reshape(*g.shape[:-2], -1, C, g.shape[-1])
    j, i = jnp.arange(C, dtype=jnp.int32)[:, None], jnp.arange(C, dtype=jnp.int32)[None]  # (iota: custom partitioning takes no constants)
    tri = ((j >= i) if reverse else (j <= i)).astype(jnp.float32)  # [j, i]: whether step j counts towards the sum at step i
    return jnp.einsum("...ch,ci->...hi", x.astype(jnp.float32), tri, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- use_qk_l2norm_in_kernel
# Inside the op's custom VJP, on the chunk rows. Where `Config.delta_l2norm_fused` (at K <= 128) the kernels
# normalise q and k themselves: without a gradient `inv_l2` and `fused_t_l2`, under one the WY
# kernel `wy_t_l2` (`_folds_l2norm`, `_folds_l2norm_h`). Elsewhere, without a gradient XLA's fused
# pass (the faster there: GDN forward 0.610 against 0.652 ms with the kernel, 4,4096,16,128, H200,
# 2026-12-03); under one a kernel per tensor (`norm`), which also keeps 1 / |x| for the backward (XLA
# took two passes per tensor there). The backward folds the normalisation's gradient into its
# consumer and WY VJP (`delta_l2norm_fused`), or runs `norm_bwd` per tensor after them.


@functools.cache
def _norm_partitioned(p: Problem):
    return _partition.batch_head_partitioned(functools.partial(_norm_forward, p), ("bthk", "bthk"), ("bthk", "bthk", "bth", "bth"))


def _norm_forward(p: Problem, q, k):
    """`(q / |q|, k / |k|, 1 / |q|, 1 / |k|)`, the norms' reciprocals in float32 `[B, T, H]`."""
    target = _targets(p, "fwd", q.shape[-1], q.shape[-1])["norm"]
    rows = lambda x: x.reshape(-1, *x.shape[2:])
    (qn, rq), (kn, rk) = (_call(p, target, (_like(rows(x)), jax.ShapeDtypeStruct(rows(x).shape[:2], jnp.float32)), rows(x)) for x in (q, k))
    return qn.reshape(q.shape), kn.reshape(k.shape), rq.reshape(q.shape[:3]), rk.reshape(k.shape[:3])


def _norm_backward(p: Problem, y, r, dy):
    """The raw x's gradient from the normalised `y [L, H, K]`, `r = 1 / |x|` `[L, H]` and the
    gradient of y."""
    return _call(p, _targets(p, "bwd", y.shape[-1], y.shape[-1])["norm_bwd"], _like(y), y, r, dy)


# Per-token arrays handed to the kernels' Python side (the delta rules add beta), with the axis
# letters of `fla_jax._partition`.
def _token_layouts(p: Problem) -> tuple[str, ...]:
    return ("bthk", "bthk", "bthv", "bthk" if p.op == "gla" else "bth") + (("bth",) if p.delta else ())


def _stored_layouts(p: Problem) -> tuple[str, ...]:
    """What the forward stores for the backward besides h: for the delta rules the WY
    preparation's w, u (per token) and T (per chunk), and v_new (per token); for GLA the
    intra-chunk matrix A (per chunk), the in-chunk cumulative gates G and q exp(G) (per token)."""
    return ("bthk", "bthv", "bchkv", "bthv") if p.delta else ("bchkv", "bthk", "bthk") if p.op == "gla" else ()


def _targets(p: Problem, direction: str, K: int, V: int) -> dict[str, str]:
    """{program name: FFI target} of one variant, each kind's the program that runs (`_program`):
    also a kind that only an experiment put in place by `Config.experiments` provides there."""
    variant = _find_variant("delta" if p.delta else p.op, direction, p.dtype, K, V)
    kinds = [prog.name for prog in variant.programs]
    kinds += [prog.of for prog in variant.experiments if prog.of not in kinds and _chosen(p, direction, prog)]
    return {prog.name: variant.target(prog) for prog in variant.experiments} | {
        kind: variant.target(_program(p, direction, K, kind)) for kind in kinds}


def _chosen(p: Problem, direction: str, prog) -> bool:
    """Whether `Config.experiments` puts experiment `prog` in its kind's place."""
    return _cfg(p).overrides().get(("delta" if p.delta else p.op, direction, prog.of)) == prog.name


def _program(p: Problem, direction: str, K: int, name: str):
    """The `fla_jax._variants.Program` of one kind that runs: the dispatched one, or the experiment
    that `Config.experiments` puts in its place (its config decides how its inputs are laid out)."""
    variant = _find_variant("delta" if p.delta else p.op, direction, p.dtype, K, K)
    chosen = next((prog for prog in variant.experiments if prog.of == name and _chosen(p, direction, prog)), None)
    return chosen or next(prog for prog in variant.programs if prog.name == name)


def _config(p: Problem, direction: str, K: int, name: str) -> dict:
    """The config of the program of one kind that runs (`_program`)."""
    return dict(_program(p, direction, K, name).config)


def _gate_rows(G, C: int):
    """The in-chunk cumulative gates `G [L, H]` as per-chunk rows `[NT, H, C]` (an XLA transpose)."""
    return G.reshape(-1, C, G.shape[-1]).transpose(0, 2, 1)


def _stores_gate_rows(p: Problem, K: int) -> bool:
    """Whether the forward under a gradient hands the backward G's per-chunk rows (`_gate_rows`, as
    `[B, NT_b, HV, C]`): simple GLA's and the delta rules' where both their forward storing h and
    their reverse pass load them by TMA (`g_rows`, K <= 128), so that they are formed once (by XLA's
    transpose, or by the delta rules' WY kernel where it sums the gates, `g_scan`)."""
    return p.op != "gla" and all(_config(p, d, K, name).get("g_rows", False) for d, name in (("fwd", "fused_h"), ("bwd", "dh")))


def _wy_name(store_h: bool, l2norm: bool) -> str:
    """The delta rules' WY kernel of the forward: under a gradient storing T (from the raw q and k
    with `l2norm`), else w and u alone."""
    return ("wy_t_l2" if l2norm else "wy_t") if store_h else "wy"


def _gates_for(p: Problem, direction: str, K: int, name: str, G, C: int, rows=None):
    """`G [L, H]` as program `name` takes it: as it is, or where it loads it by TMA (`g_rows`) as
    per-chunk rows `[NT, H, C]`: `rows` where already formed, else `_gate_rows`."""
    if not _config(p, direction, K, name).get("g_rows"):
        return G
    return _gate_rows(G, C) if rows is None else rows


def _steps_for(p: Problem, direction: str, K: int, name: str, C: int, *xs):
    """Per-step `[L, H]` arrays beside G (beta, `1 / |x|`) as program `name` takes them: as they
    are, or per-chunk rows `[NT, H, C]` where it loads G's by TMA (`g_rows`, `_gates_for`)."""
    return tuple(_gate_rows(x, C) for x in xs) if _config(p, direction, K, name).get("g_rows") else xs


def _value_parts(p: Problem, K: int, V: int) -> int:
    """In how many float32 parts the backward's consumer writes what sums over the key channels:
    1 (dv in the input dtype), or K / BK where it splits the key channels over programs (dv as
    `[parts, L, HV, V]`, and but for GLA, whose dg is per channel, dg as `[parts, L, HV]`)."""
    del V  # (variants have K = V)
    return K // _config(p, "bwd", K, "dqkvg").get("BK", K)


def _consumer(p: Problem, target: str, results, *args, scale):
    """The backward's consumer `(dq, dk, dv, dg)` (the delta rules' `(dq, dk, dg)`: their reverse
    pass stores dv, `no_dv`), summing the parts of dv (and dg) where it splits the key channels
    (`_value_parts`); `results` as the unsplit program writes them."""
    parts = _value_parts(p, args[0].shape[-1], args[2].shape[-1])
    if parts > 1:
        split = lambda r: jax.ShapeDtypeStruct((parts, *r.shape), jnp.float32)
        results = (*results[:2], *(split(r) for r in results[2:-1]), results[-1] if p.op == "gla" else split(results[-1]))
    out = _call(p, target, results, *args, scale=scale)
    if parts > 1:  # dv rounded once, as the unsplit program writes it
        out = (*out[:2], *(x.sum(axis=0).astype(r.dtype) for x, r in zip(out[2:-1], results[2:-1])),
               out[-1] if p.op == "gla" else out[-1].sum(axis=0))
    return out


def _flat(C, q, *rest, tables):
    """Chunk rows `[B, NT * C, H, .]` -> one flat row, and the (first chunk, chunk count) of
    each sequence: the dense rows' own, or the varlen tables."""
    B, Lr = q.shape[:2]
    if not tables:
        nt = Lr // C
        tables = (jnp.arange(B, dtype=jnp.int32) * nt, jnp.full((B,), nt, jnp.int32))
    flat = lambda x: x.reshape(B * Lr, *x.shape[2:])
    return tuple(flat(x) for x in (q, *rest)), tables


def _like(x, dtype=None, heads=None) -> jax.ShapeDtypeStruct:
    """The shape of `x` (with `heads` in axis 1 if given), in `dtype` or its own."""
    shape = x.shape if heads is None else (x.shape[0], heads, *x.shape[2:])
    return jax.ShapeDtypeStruct(shape, dtype or x.dtype)


def _forward(p: Problem, scale: float, store_h: bool, l2norm: bool, has_h0: bool, store_rows: bool, *arrays):
    """`(o, ht)`, or with `store_h` `(o, h, *wy, *sums, ht)`: h `[B, NT, HV, K, V]`, the state
    before each chunk, and for the backward wy: for the delta rules the WY preparation's `w, u`
    (rows like v), `T` (`[B, NT, HV, C, C]`) and `v_new` (rows like v), for GLA the intra-chunk
    matrix A (`[B, NT, H, C, C]`); but for GLA (whose wy holds them) sums: the in-chunk sums G
    (rows like the gates) and where `store_rows` (`_stores_gate_rows`) their per-chunk rows
    `[B, NT_b, HV, C]`. `arrays`: the token arrays (the gates per step), h0 where `has_h0`, the
    varlen tables. `l2norm`: q and k raw, normalised by the kernels (the forward from the inverse,
    `_folds_l2norm`; under a gradient the WY kernel `wy_t_l2`, `_folds_l2norm_h`, and then the
    normalised q, k and their `1 / |x|` follow wy among the results)."""
    cfg = _cfg(p)
    n = len(_token_layouts(p))
    tokens, h0, tables = arrays[:n], arrays[n] if has_h0 else None, arrays[n + has_h0 :]
    C = p.chunk_size
    B, Lr, _, K = tokens[0].shape
    flat, (cstart, ccount) = _flat(C, *tokens, tables=tables)
    qf, kf, vf, Gf = flat[:4]
    HV, V = vf.shape[1:]
    state = jax.ShapeDtypeStruct((cstart.shape[0], HV, K, V), jnp.float32)  # ht
    if h0 is None:  # no rows: the kernels start from zero states (`kernels.common.initial_state`)
        h0 = jnp.zeros((0 if cfg.zero_row_h0 else cstart.shape[0], HV, K, V), jnp.float32)
    graw = Gf  # the gates per step: their in-chunk sums by XLA where a kernel takes those
    # (under a gradient the delta rules' WY kernel may sum them and write G and its rows, `g_scan`)
    wy_scan = store_h and p.delta and _config(p, "fwd", K, _wy_name(store_h, l2norm)).get("g_scan", False)
    rows0 = None  # G's per-chunk rows straight from XLA's product (`gate_sum_dot`; the same product as Gf's)
    if p.op != "gla" and not wy_scan:
        Gf = _in_chunk_cumsum(p, graw, C)
        rows0 = _in_chunk_rows(graw, C) if cfg.gate_sum_dot else None
    gate_rows = lambda: _gate_rows(Gf, C) if rows0 is None else rows0
    dt = qf.dtype
    NT = qf.shape[0] // C
    wy, grows = (), rows0  # (G's rows where formed: for the programs that load them, and the backward's)
    if p.delta and K in cfg.delta_fwd_inverse and not store_h:  # T0, and a state pass that forms v_new from it
        targets = _targets(p, "fwd", K, V)
        t0 = jax.ShapeDtypeStruct((NT, HV, C, C), dt)
        rows = lambda R: jax.ShapeDtypeStruct((NT, HV, R, C), jnp.float32)
        inv = "inv_l2" if l2norm else "inv"
        gates = graw if _config(p, "fwd", K, inv).get("g_scan") else Gf  # (summed by the kernel, or by XLA)
        if l2norm:  # G, beta, 1 / |q|, 1 / |k| per chunk and value head, rows that the state pass loads
            t0, gr = _call(p, targets[inv], (t0, rows(4)), qf, kf, gates, flat[4])
        else:  # G and beta
            t0, gr = _call(p, targets[inv], (t0, rows(2)), kf, gates, flat[4])
        o, ht = _call(p, targets[_state_pass_t(cfg, targets, l2norm, cstart.shape[0], HV, V)], (_like(vf), state), qf, kf, vf, t0, gr,
                      h0, cstart, ccount, scale=np.float32(scale))
        return o.reshape(B, Lr, HV, V), ht
    assert not l2norm or store_h, "the forward with no gradient normalises q and k itself only from the inverse"
    norms = ()
    if p.delta:  # WY preparation kernel; the state pass reads w and u instead of v
        tm = (jax.ShapeDtypeStruct((NT, HV, C, C), jnp.float32),) if store_h else ()
        # (`g_scan`: from the gates per step, and G and its rows among its results)
        sum_shapes = (_like(graw), jax.ShapeDtypeStruct((NT, HV, C), jnp.float32)) if wy_scan else ()
        wy_name = _wy_name(store_h, l2norm)
        wy_target = _targets(p, "fwd", K, V)[wy_name]
        if _config(p, "fwd", K, wy_name).get("g_rows"):  # G's rows, also for the passes after it
            grows = gate_rows()
        gates = (graw if wy_scan else _gates_for(p, "fwd", K, wy_name, Gf, C, grows), *_steps_for(p, "fwd", K, wy_name, C, flat[4]))
        if l2norm:  # (`wy_t_l2`) from the raw q and k; their normalised y and 1 / |x| for the passes after it
            r = jax.ShapeDtypeStruct(qf.shape[:2], jnp.float32)
            wy = _call(p, wy_target, (_like(kf, dt, HV), _like(vf), *tm, _like(qf), _like(kf), r, r, *sum_shapes), qf, kf, vf, *gates)
        else:
            wy = _call(p, wy_target, (_like(kf, dt, HV), _like(vf), *tm, *sum_shapes), kf, vf, *gates)
        if wy_scan:
            wy, (Gf, grows) = wy[:-2], wy[-2:]
        if l2norm:
            *wy, qf, kf, rq, rk = wy
            norms = tuple(x.reshape(B, Lr, *x.shape[1:]) for x in (qf, kf, rq, rk))
        name = "fused_h" if store_h else "fused"
        if grows is None and store_rows:  # (XLA's transpose, for this pass and the backward's)
            grows = gate_rows()
        ins, extra = (qf, kf, *wy[:2], _gates_for(p, "fwd", K, name, Gf, C, grows)), (_like(vf),)  # extra result: v_new
        rows = lambda x, per_chunk: x.reshape(B, (NT if per_chunk else NT * C) // B, *x.shape[1:])
        wy = tuple(rows(x, i == 2) for i, x in enumerate(wy)) if store_h else ()
    elif p.op == "gla":  # the intra-chunk matrix, G (both kept) and q exp(G), k exp(G_C - G) for the state pass
        a, Gf, qg, kg = _call(p, _targets(p, "fwd", K, V)["a"], (jax.ShapeDtypeStruct((NT, HV, C, C), dt), _like(Gf), _like(qf),
                              _like(kf)), qf, kf, Gf, scale=np.float32(scale))
        ins, extra = (qg, kg, vf, Gf, a), ()
        wy = (a.reshape(B, NT // B, *a.shape[1:]), Gf.reshape(B, Lr, *Gf.shape[1:]), qg.reshape(B, Lr, *qg.shape[1:])) if store_h else ()
    else:  # simple GLA: G as per-chunk rows `[NT, H, C]` where the pass loads them by TMA (`g_rows`), the
        # gates per step where it sums them itself (`g_scan`)
        name = "fused_h" if store_h else "fused"
        scan = not store_h and _config(p, "fwd", K, name).get("g_scan")
        if store_rows:  # (for this pass and the backward's)
            grows = gate_rows()
        ins, extra = (qf, kf, vf, graw if scan else _gates_for(p, "fwd", K, name, Gf, C, grows)), ()
        pieces = 1 if store_h or tables else _pieces(cfg, B, HV, V, NT // B)
        if pieces > 1:
            return _split_forward(p, pieces, scale, _targets(p, "fwd", K, V), ins, h0, gate_rows(), B, C)
    h = (jax.ShapeDtypeStruct((NT, HV, K, V), dt),) if store_h else ()
    out = _call(
        p, _targets(p, "fwd", K, V)["fused_h" if store_h else "fused"],
        (_like(vf), *extra, *h, state), *ins, h0, cstart, ccount, scale=np.float32(scale),
    )
    h = tuple(x.reshape(B, NT // B, *x.shape[1:]) for x in out[1 + len(extra) : -1])
    if p.delta and wy:  # and v_new, for the backward's consumer kernel
        wy = (*wy, out[1].reshape(B, Lr, HV, V))
    sums = ()
    if store_h and p.op != "gla":  # G for the backward (and its rows where its reverse pass takes them)
        sums = (Gf.reshape(B, Lr, HV),) + ((grows.reshape(B, NT // B, HV, C),) if store_rows else ())
    return (out[0].reshape(B, Lr, HV, V), *h, *wy, *norms, *sums, out[-1])


def _state_pass_t(cfg: Config, targets: dict, l2norm: bool, N: int, HV: int, V: int) -> str:
    """The forward from the inverse: its state pass's program for N sequences, HV value heads
    (`Config.delta_narrow_programs`)."""
    name = "fused_t_l2" if l2norm else "fused_t"
    narrow = f"{name}_v32"
    return narrow if narrow in targets and 2 * _state_programs(N, HV, V) <= cfg.delta_narrow_programs else name


def _state_programs(N: int, H: int, V: int) -> int:
    """The forward state pass's programs: one per V block of 64, sequence and (value) head."""
    return N * H * max(1, V // 64)


def _pieces(cfg: Config, B: int, H: int, V: int, nt: int) -> int:
    """In how many pieces the forward's state pass walks each of B sequences of nt chunks
    (`Config.split_programs`): a power of two dividing nt."""
    programs, pieces = _state_programs(B, H, V), 1
    while programs * pieces * 2 <= cfg.split_programs and nt % (pieces * 2) == 0 and nt // (pieces * 2) >= cfg.split_min_chunks:
        pieces *= 2
    return pieces


def _split_forward(p: Problem, pieces: int, scale: float, targets: dict, ins, h0, rows, B: int, C: int):
    """Simple GLA's `(o, ht)` (dense, no gradient) with each sequence's chunks walked in `pieces`
    pieces at once by the state pass (`fused`, as `pieces * B` sequences, the first piece from h0,
    the others from zero states); then `enter` adds what the states entering the later pieces
    contribute to their output. `ins`: the pass's token inputs (q, k, v and the gates as it takes
    them), `h0` with no rows where there is none, `rows` the in-chunk sums as per-chunk rows `[NT, H, C]`."""
    q = ins[0]
    L, H, K = q.shape
    V = ins[2].shape[-1]
    nt = L // (B * C)
    m = nt // pieces  # chunks a piece
    ar = lambda n: jnp.arange(n, dtype=jnp.int32)  # (iota, not constants: custom partitioning takes none)
    first = (ar(B)[:, None] * nt + ar(pieces)[None] * m).reshape(-1)
    h0s = h0 if not h0.shape[0] else jnp.zeros((B, pieces, *h0.shape[1:]), jnp.float32).at[:, 0].set(h0).reshape(-1, *h0.shape[1:])
    s = np.float32(scale)
    o, ht = _call(p, targets["fused"], (jax.ShapeDtypeStruct((L, H, V), q.dtype), jax.ShapeDtypeStruct((B * pieces, H, K, V), jnp.float32)),
                  *ins, h0s, first, jnp.full_like(first, m), scale=s)
    chunk = rows[:, :, -1].reshape(B, pieces, m, H)  # a chunk's whole decay
    ht = ht.reshape(B, pieces, H, K, V)
    S, enter = jnp.zeros_like(ht[:, 0]), []  # the state entering each piece (piece 0's is in o already)
    for i in range(pieces):
        enter.append(S)
        S = jnp.exp(chunk[:, i].sum(1))[..., None, None] * S + ht[:, i]
    enter = jnp.stack(enter[1:], axis=1).reshape(-1, H, K, V).astype(q.dtype)  # [B (P - 1), H, K, V], as the pass takes S
    d = (jnp.cumsum(chunk[:, 1:], axis=2) - chunk[:, 1:]).reshape(-1, m, H)  # decay of the piece's chunks before
    o = _call(p, targets["enter"], _like(o), q, rows, d, enter, first.reshape(B, pieces)[:, 1:].reshape(-1), scale=s, init=(o,))
    return o.reshape(B, nt * C, H, V), S


def _backward(p: Problem, scale: float, l2norm: bool, has_h0: bool, store_rows: bool, has_dht: bool, *arrays):
    """Gradients of the token arrays (the gates' per step) and of h0, from (token arrays, h, *wy,
    *norms, G's rows where `store_rows`, tables, do, dht where `has_dht`: none where the loss takes
    no final state); wy as `_forward` stores it (delta rules and GLA), the token arrays with the
    gates' in-chunk sums G in place of the gates (but GLA's); with `l2norm` they hold the
    normalised q and k, `norms` their `1 / |x|` (`[B, T, H]` float32), and the gradients are the
    raw q's and k's; the call's `Config` says which programs run.
    h0's gradient only where `has_h0`."""
    cfg = _cfg(p)
    fused, wy_kernel, norm_fused, grads_kernel = cfg.delta_fused_bwd, cfg.delta_wy_bwd_kernel, cfg.delta_l2norm_fused, cfg.delta_grads_kernel
    n = len(_token_layouts(p))
    m = n + 1 + len(_stored_layouts(p)) + (2 if l2norm else 0) + store_rows
    ct = 1 + has_dht  # (do, and dht where the loss takes the final state)
    tokens, h, wy, tables, (do, *dht) = arrays[:n], arrays[n], arrays[n + 1 : m], arrays[m:-ct], arrays[-ct:]
    wy, grows = (wy[:-1], wy[-1].reshape(-1, *wy[-1].shape[2:])) if store_rows else (wy, None)  # (rows the forward formed)
    wy, norms = (wy[:-2], wy[-2:]) if l2norm else (wy, ())
    C = p.chunk_size
    B, Lr, _, K = tokens[0].shape
    flat, (cstart, ccount) = _flat(C, *tokens, tables=tables)
    qf, kf, vf, Gf = flat[:4]
    V = vf.shape[-1]
    dof = do.reshape(vf.shape)
    hf = h.reshape(-1, *h.shape[2:])
    s = np.float32(scale)
    bwd = _targets(p, "bwd", K, V)
    N, state = cstart.shape[0], hf.shape[1:]
    # none: the reverse passes start from zero states (no rows under `zero_row_dht`) and (with no h0 either)
    # write no dh0 (`kernels.common.initial_state`, `final_state`)
    dht = dht[0].astype(jnp.float32) if has_dht else jnp.zeros((0 if cfg.zero_row_dht else N, *state), jnp.float32)
    dh0_like = jax.ShapeDtypeStruct((0 if cfg.zero_row_dht and not has_h0 else N, *state), jnp.float32)
    rows = lambda x, dt: x.reshape(B, Lr, *x.shape[1:]).astype(dt)
    if not p.delta:  # simple GLA; GLA with the stored A, G and q exp(G) (its dqkvg returns the per-step gates' dg)
        qd = qf
        if p.op == "gla":
            wy, Gf, qd = wy[:1], wy[1].reshape(Gf.shape), wy[2].reshape(qf.shape)
        gates = Gf if p.op == "gla" else _gates_for(p, "bwd", K, "dh", Gf, C, grows)  # (simple GLA's as its reverse pass takes them)
        dh, dh0 = _call(p, bwd["dh"], (_like(hf), dh0_like), qd, dof, gates, dht, cstart, ccount, scale=s)
        a = tuple(x.reshape(-1, *x.shape[2:]) for x in wy)
        if p.op != "gla":  # (G as the consumer takes it)
            gates = _gates_for(p, "bwd", K, "dqkvg", Gf, C, grows)
        grads = _consumer(p, bwd["dqkvg"], (_like(qf), _like(kf), _like(vf), _like(Gf)), qf, kf, vf, gates, *a, hf, dof, dh, scale=s)
        if p.op != "gla":  # G's gradient -> the gates' per step
            grads = (*grads[:3], _in_chunk_cumsum(p, grads[3], C, reverse=True))
        return (*(rows(g, g.dtype) for g in grads), *((dh0,) if has_h0 else ()))
    # delta rules: the reverse state-gradient pass, then JAX's VJP of one chunk's forward given
    # its state (`_delta_local`) and the WY VJP given T (`_wy_vjp`), parallel over chunks
    wd, ud, Tm, vn = (x.reshape(-1, *x.shape[2:]) for x in wy)
    rq, rk = (x.reshape(-1, x.shape[-1]) for x in norms) if l2norm else (None, None)
    H, HV = qf.shape[1], vf.shape[1]
    # value heads -> q/k heads (nothing where they are the same)
    group_sum = lambda x: x if HV == H else x.astype(jnp.float32).reshape(-1, H, HV // H, K).sum(axis=2)
    # (with dv_new, `du`, the gradient of v_new that its chain forms)
    gates = _gates_for(p, "bwd", K, "dh", Gf, C, grows)
    dh, dh0, du = _call(p, bwd["dh"], (_like(hf), dh0_like, _like(vf)), qf, kf, wd, dof, gates, dht, cstart, ccount, scale=s)
    heads = lambda x: _like(x, None, HV)
    # with l2norm, which of dq and dk take the normalisation's gradient in the kernel that forms them
    q_norm = l2norm and norm_fused and fused and "dqkvg_l2" in bwd
    k_norm = l2norm and norm_fused and fused and wy_kernel
    name = "grads_l2" if q_norm and k_norm else "grads"
    if K in grads_kernel and fused and wy_kernel and name in bwd:  # the consumer and the WY VJP in one program
        gates, betas = _gates_for(p, "bwd", K, name, Gf, C, grows), _steps_for(p, "bwd", K, name, C, flat[4])
        rs = _steps_for(p, "bwd", K, name, C, rq, rk) if name == "grads_l2" else ()
        outs = (heads(qf), heads(kf), _like(vf), _like(Gf), _like(Gf))
        dq, dk, dv, dG, dbeta = _call(p, bwd[name], outs, qf, kf, vf, vn, gates, *betas, Tm, hf, dof, dh, du, *rs, scale=s)
        dq, dk = group_sum(dq), group_sum(dk)
        q_norm = k_norm = name == "grads_l2"  # (what the program has folded the norms' gradient into)
        dg = _in_chunk_cumsum(p, dG, C, reverse=True)  # G's gradient -> the gates' per step
    else:
        dq, dk, dv, dg, dbeta = _delta_two_programs(p, bwd, scale, qf, kf, vf, Gf, flat[4], wd, ud, Tm, vn, hf, dof, dh, du,
                                                    grows, rq, rk, q_norm, k_norm, group_sum)
    if l2norm and not q_norm:
        dq = _norm_backward(p, qf, rq, dq.astype(qf.dtype))
    if l2norm and not k_norm:
        dk = _norm_backward(p, kf, rk, dk.astype(kf.dtype))
    return (rows(dq, qf.dtype), rows(dk, kf.dtype), rows(dv, vf.dtype), rows(dg, jnp.float32),
            rows(dbeta, jnp.float32), *((dh0,) if has_h0 else ()))


def _delta_two_programs(p, bwd, scale, qf, kf, vf, Gf, beta, wd, ud, Tm, vn, hf, dof, dh, du, grows, rq, rk, q_norm, k_norm,
                        group_sum):
    """The delta rules' backward after the reverse pass in two programs (the consumer on v_new, then the WY VJP
    kernel) or in XLA (`_delta_local`'s VJP and `_wy_vjp`), as the call's `Config` picks: dq, dk, dv, dg (per step),
    dbeta; dq and dk before the norms' gradient where `q_norm` / `k_norm` are off."""
    fused, wy_kernel = _cfg(p).delta_fused_bwd, _cfg(p).delta_wy_bwd_kernel
    C, K, V, HV = p.chunk_size, qf.shape[-1], vf.shape[-1], vf.shape[1]
    s = np.float32(scale)
    f32 = lambda x: x.astype(jnp.float32)  # the VJP in float32, on the inputs as the kernels saw them
    heads = lambda x: _like(x, None, HV)
    if fused:  # one chunk's forward is simple GLA's on v_new: its consumer kernel, less dv (du)
        name, rqs = ("dqkvg_l2", (rq,)) if q_norm else ("dqkvg", ())
        rqs, gates = _steps_for(p, "bwd", K, name, C, *rqs), _gates_for(p, "bwd", K, name, Gf, C, grows)
        dq, dkv, dG = _consumer(p, bwd[name], (heads(qf), heads(kf), _like(Gf)), qf, kf, vn, gates, hf, dof, dh, *rqs, scale=s)
        dq, dk = group_sum(dq), 0.0  # dk per value head (dkv) goes on to the WY VJP
    else:
        _, local_vjp = jax.vjp(lambda *a: _delta_local(p, C, scale, *a), f32(qf), f32(kf), f32(wd), f32(ud), Gf, hf)
        dq, dk, dw, du, dG, _ = local_vjp((f32(dof), f32(dh)))
        dkv = jnp.zeros(heads(kf).shape, kf.dtype)
    summed = False  # whether the WY VJP kernel returns the gates' gradient per step (`dg_sum`)
    if wy_kernel:  # it forms dw = -du h^T itself (v_new = u - w h) and adds dkv to its dk
        outs = (heads(kf), _like(vf), _like(Gf), _like(Gf))
        name, rks = ("wy_bwd_l2", (rk,)) if k_norm else ("wy_bwd", ())
        summed = _config(p, "bwd", K, name).get("dg_sum", False)  # (then it takes the consumer's dG, and adds it)
        # G, beta (and r) as it takes them (G's rows as the forward kept them)
        sums, rks = (_gates_for(p, "bwd", K, name, Gf, C, grows), *_steps_for(p, "bwd", K, name, C, beta)), _steps_for(p, "bwd", K, name, C, *rks)
        dk2, dv, dG2, dbeta = _call(p, bwd[name], outs, kf, vf, *sums, Tm, hf, du.astype(kf.dtype), dkv, *((dG,) if summed else ()), *rks)
        dk2 = group_sum(dk2)
    else:
        if fused:  # the XLA WY VJP takes dw = -du h^T
            NT = hf.shape[0]
            dw = -jnp.einsum("nchv,nhkv->nchk", du.reshape(NT, C, HV, V), hf, preferred_element_type=jnp.float32).reshape(-1, HV, K)
            dk = group_sum(f32(dkv))
        dk2, dv, dG2, dbeta = _wy_vjp(p, C, Tm, kf, vf, Gf, beta, dw, f32(du))
    dk = dk2 if fused and wy_kernel else dk + dk2  # (the WY VJP kernel has added the consumer's dk)
    dg = dG2 if summed else _in_chunk_cumsum(p, dG + dG2, C, reverse=True)  # G's gradient -> the gates' per step
    return dq, dk, dv, dg, dbeta


def _partitioned(p: Problem, scale: float, direction: str, varlen: bool, l2norm: bool = False, has_h0: bool = True,
                 store_rows: bool = False, has_dht: bool = True):
    """The forward (`fwd`, `fwd_h`: with stored states) or backward as one custom-partitioned
    function: split along batch and heads like its operands, T, K and V whole on every device
    (see `fla_jax._partition`). Varlen calls (one row) carry the per-sequence tables and initial
    states whole. `p` carries the call's `Config` (a key of the cache).
    `l2norm`: the backward takes the norms' reciprocals and returns the raw q's and k's gradients;
    the forward (`fwd`, where `_folds_l2norm`) takes the raw q and k and normalises them itself.
    `has_h0`: initial states among the arrays (and their gradient among the backward's results).
    `store_rows` (`fwd_h`, `bwd`): G's per-chunk rows among the forward's results and the
    backward's arrays (`_stores_gate_rows`). `has_dht` (`bwd`): the final state's cotangent among
    the arrays (none where the loss takes no final state)."""
    return _partitioned_with(p, scale, direction, varlen, l2norm, has_h0, store_rows, has_dht)


@functools.cache
def _partitioned_with(p: Problem, scale: float, direction: str, varlen: bool, l2norm: bool, has_h0: bool, store_rows: bool,
                      has_dht: bool):
    state, tables = ("nhkv", ("n", "n")) if varlen else ("bhkv", ())
    tokens = _token_layouts(p)
    rows = ("bchr",) if store_rows else ()  # G's per-chunk rows [B, NT_b, HV, C]
    if direction == "bwd":
        norms = ("bth", "bth") if l2norm else ()
        ins, outs = tokens + ("bchkv",) + _stored_layouts(p) + norms + rows + tables + ("bthv",) + (state,) * has_dht, tokens + (state,) * has_h0
        fn = functools.partial(_backward, p, scale, l2norm, has_h0, store_rows, has_dht)
    else:
        ins = tokens + (state,) * has_h0 + tables
        norms = ("bthk", "bthk", "bth", "bth") if l2norm else ()  # (fwd_h from the raw q, k: their y and 1 / |x|)
        sums = () if p.op == "gla" else ("bth",) + rows  # (fwd_h: G, and its rows)
        outs = ("bthv", "bchkv") + _stored_layouts(p) + norms + sums + (state,) if direction == "fwd_h" else ("bthv", state)
        fn = functools.partial(_forward, p, scale, direction == "fwd_h", l2norm, has_h0, store_rows)
    return _partition.batch_head_partitioned(fn, ins, outs)


def _folds_l2norm(p: Problem, K: int) -> bool:
    """Whether the forward with no gradient normalises q and k in its kernels (the inverse and the
    state pass from it, `inv_l2`, `fused_t_l2`), rather than after XLA's pass."""
    return p.delta and K in _cfg(p).delta_fwd_inverse and _cfg(p).delta_l2norm_fused and "inv_l2" in _targets(p, "fwd", K, K)


def _folds_l2norm_h(p: Problem, K: int) -> bool:
    """Whether the forward under a gradient normalises q and k in its WY kernel (`wy_t_l2`, which
    also writes them normalised and their `1 / |x|` for the backward), rather than by a `norm`
    pass each before it."""
    return p.delta and _cfg(p).delta_l2norm_fused and "wy_t_l2" in _targets(p, "fwd", K, K)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _op(p, scale, l2norm, has_h0, *arrays):
    """`(o, ht)` from (token arrays, h0 where `has_h0`, varlen tables); gradients by the backward
    kernels. The gates per step (their in-chunk sums are taken inside the forward and backward,
    `_forward` / `_backward`: by XLA, or by the kernel that reads them). With `l2norm` q and k (the first two arrays) are l2-normalised first:
    by the kernels where `_folds_l2norm`, else by XLA."""
    n = len(_token_layouts(p))
    folded = l2norm and _folds_l2norm(p, arrays[0].shape[-1])
    if l2norm and not folded:
        arrays = (*(l2_normalise(x.astype(jnp.float32)).astype(x.dtype) for x in arrays[:2]), *arrays[2:])
    return _partitioned(p, scale, "fwd", len(arrays) > n + has_h0, folded, has_h0)(*arrays)


def _op_fwd(p, scale, l2norm, has_h0, *arrays):
    arrays = tuple(a.value for a in arrays)  # (`symbolic_zeros`: each a `CustomVJPPrimal`)
    n = len(_token_layouts(p))
    norms = ()
    folded = l2norm and _folds_l2norm_h(p, arrays[0].shape[-1])
    if l2norm and not folded:  # the normalised q, k in place of the raw ones, and 1 / |q|, 1 / |k| for the backward
        qn, kn, *norms = _norm_partitioned(p)(*arrays[:2])
        arrays = (qn, kn, *arrays[2:])
    store_rows = _stores_gate_rows(p, arrays[0].shape[-1])
    o, h, *wy, ht = _partitioned(p, scale, "fwd_h", len(arrays) > n + has_h0, folded, has_h0, store_rows)(*arrays)
    rows = (wy.pop(),) if store_rows else ()
    if p.op != "gla":  # the in-chunk sums G in place of the gates per step (GLA's are among wy)
        arrays = (*arrays[:3], wy.pop(), *arrays[4:])
    if folded:  # (the WY kernel normalised them)
        *wy, qn, kn, rq, rk = wy
        arrays, norms = (qn, kn, *arrays[2:]), (rq, rk)
    return (o, ht), (arrays[:n], h, (*wy, *norms, *rows), arrays[n + has_h0 :])


def _op_bwd(p, scale, l2norm, has_h0, res, ct):
    tokens, h, wy, tables = res
    do, dht = ct  # (`symbolic_zeros`: a `SymbolicZero` for an output the loss does not take)
    zero = lambda x: isinstance(x, jax.custom_derivatives.SymbolicZero)
    do = jnp.zeros(do.aval.shape, tokens[0].dtype) if zero(do) else do.astype(tokens[0].dtype)
    dht = () if zero(dht) else (dht,)  # (then the reverse passes start from zeros themselves)
    store_rows = _stores_gate_rows(p, tokens[0].shape[-1])  # (as `_op_fwd` decided it)
    grads = _partitioned(p, scale, "bwd", bool(tables), l2norm, has_h0, store_rows, bool(dht))(*tokens, h, *wy, *tables, do, *dht)
    return (*grads, *(None for _ in tables))


# `symbolic_zeros`: the backward learns which outputs the loss takes (most training losses take o alone)
_op.defvjp(_op_fwd, _op_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------- delta rules
# chunk_delta_rule / chunk_gated_delta_rule: the WY preparation and the sequential passes are kernels
# (`kernels/delta/`), the chunk-parallel VJPs are XLA.


def _wy_vjp(p: Problem, C: int, Tm, k, v, G, beta, dw, du):
    """VJP of the WY preparation (`kernels/delta/wy.py`) given its `T = (I + A)^{-1}`
    `[NT, HV, C, C]` (float32): `dk, dv, dG, dbeta` from `dw, du`. `w = T (k s)`, `u = T (v beta)`
    with `s = beta exp(G)`, `A = tril(Diag(beta) (K K^T * exp(G_i - G_j)), -1)`; the solve's
    gradient is `dA = -T^T dT T^T` (strictly lower part). Flat layout as `_delta_local`."""
    L, H, K = k.shape
    HV = v.shape[1]
    NT = L // C
    f32 = jnp.float32
    ein = functools.partial(jnp.einsum, precision=_cfg(p).vjp_precision)
    ch = lambda x: x.astype(f32).reshape(NT, C, *x.shape[1:])
    kc, vc, Gc, bc, dwc, duc = ch(jnp.repeat(k, HV // H, axis=1)), ch(v), ch(G), ch(beta), ch(dw), ch(du)
    eg = jnp.exp(Gc)  # [NT, C, HV]
    s = bc * eg
    dkb = ein("nhij,nihk->njhk", Tm, dwc)  # T^T dw
    dvb = ein("nhij,nihv->njhv", Tm, duc)
    dT = ein("nihk,njhk->nhij", dwc, kc * s[..., None]) + ein("nihv,njhv->nhij", duc, vc * bc[..., None])
    dA = -ein("nhji,nhjl,nhml->nhim", Tm, dT, Tm)  # -T^T dT T^T
    i, j = jnp.arange(C)[:, None], jnp.arange(C)[None, :]
    Gh = jnp.moveaxis(Gc, 1, 2)  # [NT, HV, C]
    E = jnp.where(i > j, jnp.exp(jnp.where(i > j, Gh[..., :, None] - Gh[..., None, :], 0.0)), 0.0)
    kk = ein("nihk,njhk->nhij", kc, kc)
    bh = jnp.moveaxis(bc, 1, 2)
    dkk = dA * E * bh[..., :, None]  # gradient of K K^T, strictly lower
    P = dkk * kk  # dA * A
    kb_dot = jnp.sum(dkb * kc, axis=-1)  # [NT, C, HV]
    dk = dkb * s[..., None] + ein("nhij,njhk->nihk", dkk, kc) + ein("nhij,nihk->njhk", dkk, kc)
    dv = dvb * bc[..., None]
    dbeta = kb_dot * eg + jnp.sum(dvb * vc, axis=-1) + jnp.moveaxis(jnp.sum(dA * E * kk, axis=-1), 1, 2)
    dG = kb_dot * s + jnp.moveaxis(jnp.sum(P, axis=-1) - jnp.sum(P, axis=-2), 1, 2)
    dk = dk.reshape(L, H, HV // H, K).sum(axis=2)
    return dk, dv.reshape(L, HV, -1), dG.reshape(L, HV), dbeta.reshape(L, HV)


def _delta_local(p: Problem, C: int, scale: float, q, k, w, u, G, h):
    """One chunk of the delta-rule forward, every chunk at once, given the state before it:
    `(o, state after)`. Flat layout; q, k `[L, H, K]`, w `[L, HV, K]`, u `[L, HV, V]`,
    G `[L, HV]`, h `[NT, HV, K, V]`. Differentiated by JAX for the parallel part of the backward."""
    L, H, K = q.shape
    HV, V = u.shape[1:]
    NT = L // C
    prec = _cfg(p).vjp_precision
    f32 = jnp.float32
    ch = lambda x: x.astype(f32).reshape(NT, C, *x.shape[1:])
    qc, kc = (ch(jnp.repeat(x, HV // H, axis=1)) for x in (q, k))
    wc, uc, Gc, hf = ch(w), ch(u), ch(G), h.astype(f32)
    vn = uc - jnp.einsum("nchk,nhkv->nchv", wc, hf, precision=prec)
    i, j = jnp.arange(C)[:, None, None], jnp.arange(C)[None, :, None]
    decay = jnp.exp(jnp.where(i >= j, Gc[:, :, None, :] - Gc[:, None, :, :], -jnp.inf))  # [NT, i, j, HV]
    A = jnp.einsum("nihk,njhk->nijh", qc, kc, precision=prec) * decay * scale
    o = scale * jnp.einsum("nchk,nhkv->nchv", qc * jnp.exp(Gc)[..., None], hf, precision=prec)
    o = o + jnp.einsum("nijh,njhv->nihv", A, vn, precision=prec)
    glast = Gc[:, -1]  # [NT, HV]
    kd = kc * jnp.exp(glast[:, None] - Gc)[..., None]
    after = jnp.exp(glast)[..., None, None] * hf + jnp.einsum("nchk,nchv->nhkv", kd, vn, precision=prec)
    return o.reshape(L, HV, V), after

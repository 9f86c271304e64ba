"""Token layout shared by the pure-JAX backends.

Every backend works on rows of chunks: a row is a run of `NT * C` token slots, split into `NT`
chunks of `C` tokens. A chunk belongs to exactly one sequence, so the state recurrence only has
to know, per chunk, whether the state starts afresh there (`reset`) and from which initial state
(`seq`).

* Dense input `[B, T, ...]`: B rows, one sequence each, the tail of the last chunk zero-padded.
* Varlen input `[1, T, ...]` with `cu_seqlens [N+1]`: one row in which every sequence starts at
  a chunk boundary. The number of chunks is bounded statically by `ceil((T + N (C-1)) / C)`,
  so `cu_seqlens` may be a traced array: only its length fixes shapes.

Padding slots hold zeros (k = v = 0, gates 0, beta 0): they change no state, so the state after a
sequence's last chunk is its final state. Chunks past the last sequence point at the zero
initial state stored in row `S` of the initial-state table.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Layout(NamedTuple):
    """Where tokens live in the chunked rows and how chunks map to sequences.

    Attributes:
      slot: `[T]` int32 slot of each token in the single varlen row, or None for dense input.
      length: static padded row length `NT * C`.
      reset: `[NT]` bool, the state is replaced by the sequence's initial state before this chunk.
      seq: `[NT]` int32 sequence of each chunk in `[0, S]`; `S` marks padding chunks.
      last: `[S]` int32 index of each sequence's last chunk (meaningless where empty).
      nonempty: `[S]` bool, the sequence has at least one token.
    """

    slot: jax.Array | None
    length: int
    reset: jax.Array
    seq: jax.Array
    last: jax.Array
    nonempty: jax.Array

    @property
    def num_seqs(self) -> int:
        return self.last.shape[0]

    @property
    def seg(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The per-chunk arrays a backend core takes."""
        return self.reset, self.seq, self.last, self.nonempty


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_layout(T: int, cu_seqlens: jax.Array | None, chunk: int) -> Layout:
    """Builds the layout of `T` tokens (per row) in chunks of `chunk` slots."""
    if cu_seqlens is None:
        nt = cdiv(T, chunk)
        c = jnp.arange(nt, dtype=jnp.int32)
        return Layout(
            slot=None,
            length=nt * chunk,
            reset=c == 0,
            seq=jnp.zeros((nt,), jnp.int32),
            last=jnp.full((1,), nt - 1, jnp.int32),
            nonempty=jnp.ones((1,), bool),
        )
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    first, nchunks = chunk_ranges(cu, chunk)
    start = jnp.concatenate([first, first[-1:] + nchunks[-1:]])
    nt = packed_chunks(T, n, chunk)
    t = jnp.arange(T, dtype=jnp.int32)
    sid = token_sequences(cu, T)
    slot = start[sid] * chunk + (t - cu[sid])
    c = jnp.arange(nt, dtype=jnp.int32)
    cseq = jnp.searchsorted(start, c, side="right").astype(jnp.int32) - 1
    cseq = jnp.clip(cseq, 0, n)
    reset = (cseq == n) | (c == start[cseq])
    return Layout(
        slot=slot,
        length=nt * chunk,
        reset=reset,
        seq=cseq,
        last=jnp.maximum(start[:-1] + nchunks - 1, 0),
        nonempty=nchunks > 0,
    )


def packed_chunks(T: int, n: int, chunk: int) -> int:
    """The chunks of a packed row of T tokens in n sequences, each starting at a chunk boundary (at most)."""
    return cdiv(T + n * (chunk - 1), chunk)


def token_sequences(cu_seqlens: jax.Array, T: int) -> jax.Array:
    """`[T]` int32 sequence of each token of the packed row (empty sequences hold none)."""
    t = jnp.arange(T, dtype=jnp.int32)
    return jnp.clip(jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1, 0, cu_seqlens.shape[0] - 2)


def chunk_ranges(cu_seqlens: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """`[N]` int32 first chunk and `[N]` int32 chunk count of each sequence in the varlen row."""
    cu = cu_seqlens.astype(jnp.int32)
    nchunks = (cu[1:] - cu[:-1] + chunk - 1) // chunk
    return jnp.cumsum(nchunks, dtype=jnp.int32) - nchunks, nchunks


def pack(x: jax.Array | None, layout: Layout) -> jax.Array | None:
    """`[B, T, ...]` tokens -> `[B, length, ...]` slots (zeros in padding)."""
    if x is None:
        return None
    if layout.slot is None:
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, layout.length - x.shape[1])
        return jnp.pad(x, pad)
    out = jnp.zeros((x.shape[0], layout.length, *x.shape[2:]), x.dtype)
    return out.at[:, layout.slot].set(x, unique_indices=True, indices_are_sorted=True)


def unpack(y: jax.Array, layout: Layout, T: int) -> jax.Array:
    """`[B, length, ...]` slots -> `[B, T, ...]` tokens."""
    if layout.slot is None:
        return y[:, :T]
    return jnp.take(y, layout.slot, axis=1, unique_indices=True, indices_are_sorted=True)


def _varying_axes(x: jax.Array) -> tuple[str, ...]:
    """The manual mesh axes `x` varies over inside `shard_map` (none outside)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return tuple(sorted(manual.varying if manual is not None else getattr(t, "vma", ())))


def varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """`x`, inside `shard_map` made varying over the mesh axes `ref` varies over: a scan's initial carry must
    have its output's type, and a value made inside (zeros) is replicated."""
    axes = tuple(a for a in _varying_axes(ref) if a not in _varying_axes(x))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def state_table(h0: jax.Array, layout: Layout) -> jax.Array:
    """`[N, H, K, V]` initial states -> `[rows, S + 1, H, K, V]`, row `S` all zeros (padding)."""
    if layout.slot is None:
        rows = h0[:, None]
    else:
        rows = h0[None]
    zero = jnp.zeros_like(rows[:, :1])
    return jnp.concatenate([rows, zero], axis=1)


def final_states(ht: jax.Array, layout: Layout) -> jax.Array:
    """`[rows, S, H, K, V]` -> `[N, H, K, V]`."""
    if layout.slot is None:
        return ht[:, 0]
    return ht[0]

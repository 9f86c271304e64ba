"""Trains a small language model with gated-delta-rule (or GLA) layers on synthetic tokens, then samples.

    python -m fla_jax.demo [--steps 300] [--layer gdn|gla] [--backend auto] ...

The tokens come from a fixed sparse Markov chain (each token has a handful of likely successors),
so the loss falls from log(vocab) towards the chain's entropy, which is printed as the floor. Each row
packs documents of random lengths (`--docs-per-row` on average, each restarting the chain from a random
token) with `segment_ids`, as JAX training stacks pack them: the layers restart at every document, and the
loss leaves out the unpredictable first token of each.
Training is data parallel over every local device (`jit` with the batch sharded on a mesh);
`--heads-parallel N` also splits the attention heads over N devices (projections sharded by head,
output projection by rows), and the linear-attention ops partition themselves along heads.
After training it continues four prompts of different lengths (`--sample` tokens each): the prompts
prefilled in one packed call, then token by token through the layers' caches in one jitted loop.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import fla_jax
from fla_jax._backends import resolve_name
from fla_jax._problem import Problem
from fla_jax.layers import GatedDeltaNet, GatedLinearAttention


class Block(nnx.Module):
    def __init__(self, d: int, layer: str, heads: int, head_dim: int, backend: str, *, dtype=None, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs), nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        cls = GatedDeltaNet if layer == "gdn" else GatedLinearAttention
        self.attn = cls(d, heads, head_dim, backend=backend, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, 2 * 2 * d, use_bias=False, dtype=dtype, rngs=rngs)  # SwiGLU, hidden 2 d
        self.down = nnx.Linear(2 * d, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache=None, *, cu_seqlens=None, segment_ids=None, return_cache=False):
        """`x` -> the block's output; with a `cache` (or `return_cache`), `(output, cache)` (see the layers)."""
        if cache is None and not return_cache:
            x, cache = x + self.attn(self.norm1(x), segment_ids=segment_ids), None
        else:
            y, cache = self.attn(self.norm1(x), cache=cache, cu_seqlens=cu_seqlens, return_cache=return_cache and cache is None)
            x = x + y
        a, b = jnp.split(self.up(self.norm2(x)), 2, axis=-1)
        return x + self.down(jax.nn.silu(a) * b), cache


class LanguageModel(nnx.Module):
    """Parameters in float32; activations in `dtype` (None: float32)."""

    def __init__(
        self, vocab: int, d: int, layers: int, layer: str, heads: int, head_dim: int, backend: str, *, dtype=None, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab, d, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(d, layer, heads, head_dim, backend, dtype=dtype, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens, caches=None, *, cu_seqlens=None, segment_ids=None, return_cache=False):
        """Logits of `tokens [B, T]` (packed documents with `segment_ids [B, T]`); with `caches` (one a block, or
        `return_cache` to start them, one row a sequence of `cu_seqlens`), `(logits, caches)`: generation."""
        x = self.embed(tokens)
        new = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, None if caches is None else caches[i], cu_seqlens=cu_seqlens, segment_ids=segment_ids,
                         return_cache=return_cache)
            new.append(c)
        logits = self.head(self.norm(x))
        return (logits, tuple(new)) if caches is not None or return_cache else logits


def generate(model: LanguageModel, prompts: list[np.ndarray], steps: int, key):
    """Continues each prompt by `steps` sampled tokens: the prompts (of any lengths) prefilled in one packed
    call (`cu_seqlens`, the chunk ops), then every continuation at once, one token a step through the layers'
    caches (the recurrent ops) in one jitted loop. `(tokens [len(prompts), steps], seconds of the loop)`,
    the loop timed on its second run (the first compiles it)."""
    lens = [len(p) for p in prompts]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    packed = jnp.asarray(np.concatenate(prompts))[None]
    logits, caches = nnx.jit(lambda m, t, cu: m(t, cu_seqlens=cu, return_cache=True))(model, packed, cu)
    last = logits[0, cu[1:] - 1].astype(jnp.float32)  # each prompt's next-token logits

    @nnx.jit(static_argnames="steps")
    def decode(model, caches, logits, key, steps):
        def step(carry, k):
            caches, logits = carry
            tok = jax.random.categorical(k, logits)
            logits, caches = model(tok[:, None], caches)
            return (caches, logits[:, 0].astype(jnp.float32)), tok
        _, toks = jax.lax.scan(step, (caches, logits), jax.random.split(key, steps))
        return toks.T

    jax.block_until_ready(decode(model, caches, last, key, steps=steps))
    t0 = time.perf_counter()
    toks = jax.block_until_ready(decode(model, caches, last, key, steps=steps))
    return np.asarray(toks), time.perf_counter() - t0


def param_sharding(mesh, path) -> NamedSharding:
    """Megatron-style head parallelism: projections into heads split by columns, the output
    projection by rows, per-head vectors by heads; everything else replicated."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if "attn" in names:
        layer = names[names.index("attn") + 1]
        if layer in ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj", "gk_up"):
            return NamedSharding(mesh, P(None, "model") if names[-1] == "kernel" or "kernel" in names else P("model"))
        if layer == "o_proj":
            return NamedSharding(mesh, P("model", None))
        if layer in ("q_conv", "k_conv", "v_conv"):
            return NamedSharding(mesh, P(None, "model"))
        if layer in ("A_log", "dt_bias"):
            return NamedSharding(mesh, P("model"))
    return NamedSharding(mesh, P())


def place(mesh, module: nnx.Module) -> None:
    """Puts `module`'s state on `mesh` as `param_sharding` says of each path (an optimizer's moments
    carry their parameters' paths, so they follow them)."""
    state = nnx.state(module)
    nnx.update(module, jax.device_put(state, jax.tree_util.tree_map_with_path(lambda path, _: param_sharding(mesh, path), state)))


def markov_chain(vocab: int, successors: int, seed: int):
    """A sparse transition matrix and its entropy rate (nats per token)."""
    rng = np.random.default_rng(seed)
    P_ = np.zeros((vocab, vocab))
    for i in range(vocab):
        nxt = rng.choice(vocab, successors, replace=False)
        P_[i, nxt] = rng.dirichlet(np.ones(successors))
    # stationary distribution by power iteration
    pi = np.full(vocab, 1 / vocab)
    for _ in range(200):
        pi = pi @ P_
    with np.errstate(divide="ignore", invalid="ignore"):
        H = -np.nansum(pi[:, None] * P_ * np.where(P_ > 0, np.log(P_), 0))
    return jnp.asarray(np.log(P_ + 1e-30), jnp.float32), float(H)


def sample(key, logP, batch: int, T: int, docs: float = 1.0):
    """`(tokens, segment_ids)`, both `[batch, T]`: rows of documents drawn from the chain, a new document (from a
    uniformly drawn token) starting at each step with probability `(docs - 1) / T` (`docs` a row on average)."""
    k0, k1, k2 = jax.random.split(key, 3)
    V = logP.shape[0]
    first = jax.random.randint(k0, (batch,), 0, V)
    starts = jax.random.bernoulli(k2, (docs - 1) / T, (T - 1, batch))

    def step(tok, x):
        k, start = x
        ka, kb = jax.random.split(k)
        nxt = jnp.where(start, jax.random.randint(ka, tok.shape, 0, V), jax.random.categorical(kb, logP[tok]))
        return nxt, nxt

    _, rest = jax.lax.scan(step, first, (jax.random.split(k1, T - 1), starts))
    seg = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(starts.T, axis=1, dtype=jnp.int32)], axis=1)
    return jnp.concatenate([first[:, None], rest.T], axis=1), seg


def _at_least(low: int):
    """An argparse type: an int >= `low`."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=_at_least(1), default=300, help="training steps")
    ap.add_argument("--batch", type=_at_least(1), default=8, help="global batch (sequences per step)")
    ap.add_argument("--seq-len", type=_at_least(1), default=128, help="tokens per row")
    ap.add_argument("--docs-per-row", type=_positive_float, default=4.0,
                    help="documents packed in a row, on average (segment_ids; 1: one document a row)")
    ap.add_argument("--vocab", type=_at_least(4), default=128, help="vocabulary of the Markov chain (each token has 4 successors)")
    ap.add_argument("--d-model", type=_at_least(1), default=64, help="model width")
    ap.add_argument("--layers", type=_at_least(1), default=2, help="attention + MLP blocks")
    ap.add_argument("--heads", type=_at_least(1), default=2, help="attention heads")
    ap.add_argument("--head-dim", type=_at_least(1), default=None,
                    help="head dim (K = V); default 64 where the TileLang kernels run (they take 64, 128, 256), else 32")
    ap.add_argument("--layer", choices=("gdn", "gla"), default="gdn", help="attention layer")
    ap.add_argument("--heads-parallel", type=_at_least(1), default=1, help="devices to split the heads over")
    ap.add_argument("--backend", default="auto", choices=("auto", "xla", "reference", "tilelang"), help="the ops' backend")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                    help="activations' dtype (parameters stay float32); auto: bfloat16 where the TileLang kernels run, else float32")
    ap.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    ap.add_argument("--log-every", type=_at_least(1), default=25, help="steps between log lines")
    ap.add_argument("--seed", type=int, default=0, help="seed of the data and the parameters")
    ap.add_argument("--sample", type=_at_least(0), default=64, help="tokens to generate after training for each of 4 prompts (0: none)")
    ap.add_argument("--out", default="fla_jax_demo", help="folder for the loss curve (loss.png) and the summary line (summary.txt)")
    args = ap.parse_args(argv)
    if args.docs_per_row < 1:
        ap.error(f"argument --docs-per-row: must be a number >= 1, got {args.docs_per_row}")
    return args


class Setup(NamedTuple):
    mesh: jax.sharding.Mesh
    model: LanguageModel
    optimizer: nnx.Optimizer
    train_step: Callable  # (model, optimizer, (tokens, segment_ids) [batch, seq_len + 1]) -> loss; updates both in place
    make_batch: Callable  # key -> (tokens, segment_ids), sharded over the data axis
    floor: float  # the chain's entropy rate: the lowest loss reachable
    backend: str  # the backend the ops resolve to
    logP: jax.Array  # the chain's log transition matrix [vocab, vocab]


def setup(args: argparse.Namespace) -> Setup:
    """The mesh, the model and optimizer placed on it, the jitted step and the data."""
    devices = jax.devices()
    tp = args.heads_parallel
    if len(devices) % tp or args.heads % tp:
        raise SystemExit(f"--heads-parallel {tp} must divide the {len(devices)} devices and the {args.heads} heads")
    dp = len(devices) // tp
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {dp} data-parallel devices")
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((dp, tp), ("data", "model"), axis_types=(auto, auto))
    data_sharding = NamedSharding(mesh, P("data"))
    op = "gated_delta_rule" if args.layer == "gdn" else "gla"
    if args.head_dim is None:
        args.head_dim = 64 if fla_jax.backends()["tilelang"].usable and args.backend in ("auto", "tilelang") else 32
    call = {"K": args.head_dim, "V": args.head_dim, "varlen": False, "grouped": False, "l2norm": args.layer == "gdn"}
    dtype = args.dtype
    if dtype == "auto":
        kernels = Problem(op=op, delta=args.layer == "gdn", chunk_size=64, dtype="bfloat16")
        takes = args.backend == "tilelang" or (args.backend == "auto" and resolve_name("auto", kernels, **call) == "tilelang")
        dtype = "bfloat16" if takes else "float32"  # (named, the kernels' own error says why they cannot run)
    problem = Problem(op=op, delta=args.layer == "gdn", chunk_size=64, dtype=dtype)
    backend = resolve_name(args.backend, problem, **call)
    print(f"fla_jax demo: {args.layers} x {args.layer} layers, d_model {args.d_model}, {args.heads} heads of {args.head_dim}, "
          f"activations in {dtype}")
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}), {dp} data x {tp} heads parallel; "
          f"op backend: {backend}")
    for status in fla_jax.backends().values():
        print(f"  backend {status}")
    if backend == "tilelang":  # the kernel programs a layer's training step launches
        B, H, K = args.batch // dp, args.heads // tp, args.head_dim
        x, gates = jax.ShapeDtypeStruct((B, args.seq_len, H, K), dtype), (B, args.seq_len, H) + ((K,) if op == "gla" else ())
        g = jax.ShapeDtypeStruct(gates, jnp.float32)
        e = (fla_jax.explain(fla_jax.chunk_gated_delta_rule, x, x, x, g, g, use_qk_l2norm_in_kernel=True) if op == "gated_delta_rule"
             else fla_jax.explain(fla_jax.chunk_gla, x, x, x, g))
        print(f"  kernels of a layer's training step: {', '.join(e.training)}")

    logP, floor = markov_chain(args.vocab, 4, args.seed)
    print(f"data: sparse Markov chain over {args.vocab} tokens, {args.docs_per_row:g} documents a row on average (segment_ids); "
          f"loss starts near {math.log(args.vocab):.2f}, floor {floor:.2f} nats")

    model = LanguageModel(
        args.vocab, args.d_model, args.layers, args.layer, args.heads, args.head_dim, args.backend,
        dtype=jnp.dtype(dtype), rngs=nnx.Rngs(args.seed),
    )
    place(mesh, model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(50, args.steps // 5 + 1), max(args.steps, 2))
    optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
    # the moments follow their parameters; the counts go onto the mesh too (left uncommitted, the
    # second step would see them come back sharded and compile the step again)
    place(mesh, optimizer)

    @nnx.jit
    def train_step(model, optimizer, batch):
        tokens, seg = batch

        def loss_fn(model):  # (the first token of each document, drawn at random, is no target)
            logits = model(tokens[:, :-1], segment_ids=seg[:, :-1])
            nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
            same = (seg[:, 1:] == seg[:, :-1]).astype(jnp.float32)
            return jnp.sum(nll * same) / jnp.maximum(jnp.sum(same), 1.0)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    make_batch = jax.jit(lambda key: sample(key, logP, args.batch, args.seq_len + 1, args.docs_per_row),
                         out_shardings=(data_sharding, data_sharding))
    return Setup(mesh, model, optimizer, train_step, make_batch, floor, backend, logP)


def main(argv=None):
    args = parse(argv)
    mesh, model, optimizer, train_step, make_batch, floor, backend, logP = setup(args)
    devices = mesh.devices.size
    key = jax.random.key(args.seed + 1)
    tokens_per_step = args.batch * args.seq_len
    t_start = time.perf_counter()
    step_times, first_loss, loss, losses = [], None, None, []
    for step in range(1, args.steps + 1):
        key, sub = jax.random.split(key)
        batch = jax.block_until_ready(make_batch(sub))  # sampling the chain (a scan over time) is not timed
        t0 = time.perf_counter()
        loss = float(train_step(model, optimizer, batch))
        losses.append(loss)
        if first_loss is None:
            first_loss = loss  # the first step includes compilation
            print(f"step {step:4d}  loss {loss:.3f}  (compiled in {time.perf_counter() - t_start:.1f}s)", flush=True)
            continue
        step_times.append(time.perf_counter() - t0)
        if step % args.log_every == 0 or step == args.steps:  # (the speed over the steps since the last line)
            window = step_times[-(step % args.log_every or args.log_every):]
            print(f"step {step:4d}  loss {loss:.3f}  {_speed(window, tokens_per_step, devices)}", flush=True)
    total = time.perf_counter() - t_start
    print(f"done: loss {first_loss:.3f} -> {loss:.3f} (floor {floor:.2f}) in {total:.1f}s with backend {backend}")
    if not math.isfinite(loss):
        raise SystemExit(f"the loss is {loss}: training diverged")
    speed = _speed(step_times, tokens_per_step, devices) if step_times else "one step: no speed measured"
    if step_times:
        print(f"training steps: {speed}")
    generated = ""
    if args.sample > 0:  # continuations of prompts drawn from the chain, of different lengths
        key, k0, k1 = jax.random.split(key, 3)
        chain = np.asarray(sample(k0, logP, 4, args.seq_len)[0])
        prompts = [chain[i, : max(1, args.seq_len * (i + 1) // 4)] for i in range(4)]
        toks, secs = generate(model, prompts, args.sample, k1)
        allowed = np.asarray(logP) > -60  # the chain's transitions (each token has 4 successors; log(1e-30) elsewhere)
        prev = np.concatenate([[p[-1] for p in prompts], toks[:, :-1].T.ravel()]).reshape(-1, 4)
        legal = float(np.mean(allowed[prev.T.ravel(), toks.ravel()]))
        for p, t in zip(prompts, toks):
            print(f"  prompt [{len(p):3d} tokens] ...{' '.join(map(str, p[-6:]))} | {' '.join(map(str, t[:16]))}{' ...' if len(t) > 16 else ''}")
        generated = (f"generation: {len(prompts)} x {args.sample} tokens in {secs * 1e3:.1f} ms ({len(prompts) * args.sample / secs:,.0f} "
                     f"tokens/s, one jitted loop), {legal:.0%} of the sampled transitions are the chain's")
        print(generated)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = (f"fla_jax demo: {args.layers} x {args.layer}, backend {backend}, {args.steps} steps of {tokens_per_step} tokens "
               f"on {devices} device(s): loss {first_loss:.3f} -> {loss:.3f} (floor {floor:.2f}), {speed}"
               + (f"; {generated}" if generated else ""))
    (out / "summary.txt").write_text(summary + "\n")
    write_loss_png(out / "loss.png", losses, floor)
    print(f"wrote {out / 'loss.png'} and {out / 'summary.txt'}")
    return first_loss, loss


def write_loss_png(path, losses: list[float], floor: float, size: tuple[int, int] = (480, 240)) -> None:
    """The loss per step as a line on white (the chain's entropy floor a grey line), a PNG written with
    zlib alone: the demo needs no plotting library."""
    import struct
    import zlib

    W, H = size
    img = np.full((H, W), 255, np.uint8)
    img[[8, H - 9], 8 : W - 8] = img[8 : H - 8, [8, W - 9]] = 0  # the frame
    lo, hi = min(min(losses), floor), max(losses)
    y = lambda v: np.round((H - 12) - (v - lo) / max(hi - lo, 1e-9) * (H - 24)).astype(int)
    img[y(floor), 9 : W - 9 : 2] = 150
    xs = np.linspace(9, W - 10, len(losses)) if len(losses) > 1 else np.array([W / 2])
    fine = np.linspace(0, len(losses) - 1, 4 * W)  # the polyline, sampled densely
    img[y(np.interp(fine, np.arange(len(losses)), losses)), np.round(np.interp(fine, np.arange(len(losses)), xs)).astype(int)] = 0
    rows = b"".join(b"\x00" + r.tobytes() for r in img)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 0, 0, 0, 0))
                           + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def _speed(step_times: list[float], tokens_per_step: int, devices: int) -> str:
    """Tokens/s over the steps given (each step from its dispatch to its loss on the host), per device,
    and the median step."""
    rate = len(step_times) * tokens_per_step / sum(step_times)
    return f"{rate:,.0f} tokens/s ({rate / devices:,.0f} per device), median step {1e3 * float(np.median(step_times)):.1f} ms"


if __name__ == "__main__":
    main()

"""The device side of the server: a fixed table of S decoding rows (slots) and the two jitted programs over it.

  slots = empty_slots(model, S)                                     # every row free
  slots = admit(model, params, slots, tokens, lengths, rows, ...)   # prefill Bp prompts [Bp, T] into rows [Bp]
  tokens, count, slots, scores = decode_chunk(model, params, slots, active, steps=N, stop_tokens=...)   # [S, N]
  ... decode_chunk(model, params, slots, active, limit, ...)   # at most `limit` <= N of the steps, same program
  ... decode_chunk(model, params, slots, active, limit, True, ...)   # also each token's logprob and top tokens
  ... decode_chunk(..., on_step=f)       # also calls f(token [S], drawing [S], *scores) on the host every step

Chunked prefill feeds long prompts in pieces to L prefill lanes, a Decoding of L rows apart from the slots (so decode
chunks never touch a half-fed prompt), then places each fed lane into its row:

  lanes = empty_lanes(model, L)
  lanes = feed_lanes(model, params, lanes, tokens, lengths, fresh)    # one piece [L, P] per lane (0 tokens: idle)
  slots = place(slots, lanes, rows, key_data, budget, ...)            # lanes -> rows, as admit writes them

Every row carries its own state, next-token logits, position, sampling settings and PRNG key, so what a row samples
does not depend on the other rows: its i-th token is drawn with fold_in(key, i) from its own logits, exactly as
`LanguageModel.generate` draws the i-th token of a single prompt from the same seed. Rows are independent in the
model too: every layer treats the batch rows separately (left padding is masked), so a request's greedy tokens are
those of the request alone, up to float rounding of the batched matmuls.

A free row keeps running (its token is its last one, repeated): the decode batch has a fixed shape, so one compiled
program serves every mix of requests. `admit` overwrites a row's whole state, so whatever a free row computed is
never read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from ltm_jax import latent as latent_lib
from ltm_jax import model as model_lib
from ltm_jax.inference import generate as generation
from ltm_jax.inference.quantize import dequantize_params
from ltm_jax.ops import sampling


class Slots(NamedTuple):
  """S decoding rows. decoding: where the rows stand (`generation.Decoding` of S rows: the model's per-layer state in
  the `model.init_state` layout, next-token logits, positions, last tokens, done [S] for rows that stopped or are
  free), with generated [S] int32 per row, the tokens it drew since it was admitted (the index of its next key);
  budget [S] int32, tokens it may still draw; keys [S] PRNG keys; temperature [S] float32 (0: greedy); top_k [S]
  int32 (0: off); top_p [S] float32 (1: off); latents [S, latent layers, n_per_layer, d_model] for latent models, else
  None."""
  decoding: generation.Decoding
  budget: jax.Array
  keys: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  latents: jax.Array | None


def empty_slots(model: model_lib.LM, rows: int) -> Slots:
  """S free rows: empty states, done, with zero budgets."""
  cfg, latent = model.cfg, model_lib.uses_latents(model.latent)
  zeros = lambda dtype: jnp.zeros((rows,), dtype)
  latents = None if latent is None else jnp.zeros(model_lib.latent_shape(cfg, latent, rows), jnp.float32)
  decoding = generation.Decoding(model_lib.init_state(cfg, rows, model.cache_capacity),
                                 jnp.zeros((rows, cfg.vocab_size), jnp.float32), zeros(jnp.int32), zeros(jnp.int32),
                                 jnp.ones((rows,), bool), zeros(jnp.int32))
  slots = Slots(decoding, zeros(jnp.int32), jax.random.split(jax.random.key(0), rows), zeros(jnp.float32),
                zeros(jnp.int32), jnp.ones((rows,), jnp.float32), latents)
  # A buffer of its own per leaf (empty states share their zeros), as the programs donate every leaf; committed to
  # the device, as the programs' outputs are when the parameters are (a restored checkpoint's): otherwise the first
  # call of each program would compile again for committed inputs.
  device = jax.devices()[0]
  return jax.tree.map(lambda leaf: jax.device_put(jnp.array(leaf, copy=True), device), slots)


def empty_lanes(model: model_lib.LM, lanes: int) -> generation.Decoding:
  """L empty prefill lanes (a Decoding of L rows, as `feed_lanes` carries them)."""
  cfg = model.cfg
  decoding = generation.Decoding(model_lib.init_state(cfg, lanes, model.cache_capacity),
                                 jnp.zeros((lanes, cfg.vocab_size), jnp.float32), jnp.zeros((lanes,), jnp.int32),
                                 jnp.zeros((lanes,), jnp.int32), jnp.zeros((lanes,), bool),
                                 jnp.zeros((lanes,), jnp.int32))
  device = jax.devices()[0]
  return jax.tree.map(lambda leaf: jax.device_put(jnp.array(leaf, copy=True), device), decoding)


def _where_rows(mask: jax.Array, new, old, axes):
  """Per leaf, `new`'s rows where mask [B] holds, else `old`'s (rows along each leaf's batch axis `axes`)."""
  def pick(a, b, axis):
    shape = [1] * a.ndim
    shape[axis] = mask.shape[0]
    return jnp.where(mask.reshape(shape), a, b.astype(a.dtype))
  return jax.tree.map(pick, new, old, axes)


def state_batch_axes(model: model_lib.LM):
  """The batch axis of every leaf of the model's state (0 for separate layers, 1 under the scanned layers' leading
  [units] axis), found by comparing the state's shapes for two batch sizes."""
  one, two = (jax.eval_shape(lambda b=b: model_lib.init_state(model.cfg, b, model.cache_capacity)) for b in (1, 2))
  return jax.tree.map(lambda a, b: next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n), one, two)


def sample_rows(keys: jax.Array, logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array) -> jax.Array:
  """One token per row [S] int32 from logits [S, V], each row with its own key and settings, filtered in the order
  of `ops.sample_logits` (temperature, top-k, top-p): a row's token is the one `sample_logits` draws from the same
  key for that row alone. top_k is traced here, so top-k keeps every logit >= the row's k-th largest (ties stay, as
  there); a top_p of 1 skips the nucleus filter, as top_p=None does. The sorts behind top-k and top-p run only in
  steps where some row asks for them."""
  vocab = logits.shape[-1]
  per_row = lambda f, *args: jax.vmap(lambda row, *a: f(row[None], *a)[0])(*args)
  x = per_row(lambda row, t: sampling.filter_logits(row, temperature=t), logits, temperature)  # Greedy: one left.

  def keep_top_k(x):
    k = jnp.clip(jnp.where(top_k > 0, top_k, vocab), 1, vocab)
    kth = jnp.take_along_axis(jnp.sort(x, axis=-1), (vocab - k)[:, None], axis=-1)
    return jnp.where(x >= kth, x, -jnp.inf)

  def keep_top_p(x):
    nucleus = per_row(lambda row, p: sampling.filter_logits(row, temperature=1.0, top_p=p), x, top_p)
    return jnp.where((top_p < 1)[:, None], nucleus, x)

  x = jax.lax.cond(jnp.any(top_k > 0), keep_top_k, lambda x: x, x)
  x = jax.lax.cond(jnp.any(top_p < 1), keep_top_p, lambda x: x, x)
  return per_row(lambda row, key: jax.random.categorical(key, row, axis=-1), x, keys).astype(jnp.int32)


def _put_rows(table, new, rows: jax.Array, axes=0):
  """`table` with its rows `rows` [Bp] (along each leaf's batch axis `axes`) replaced by `new`'s Bp rows; an index
  equal to the number of rows (padding) is dropped."""
  def put(leaf, value, axis):
    index = (slice(None),) * axis + (rows,)
    return leaf.at[index].set(value.astype(leaf.dtype), mode="drop")
  if isinstance(axes, int):
    return jax.tree.map(lambda leaf, value: put(leaf, value, axes), table, new)
  return jax.tree.map(put, table, new, axes)


def _fit_latents(model: model_lib.LM, params, tokens: jax.Array, lengths: jax.Array, keys: jax.Array) -> jax.Array:
  """z [Bp, latent layers, n_per_layer, d_model] for left-padded prompts [Bp, T]: the posterior mean the inner loop fits to
  each prompt with its own key (a prompt of one token has no target to fit: z ~ N(0, I) from that key instead), so a
  prompt's z does not depend on the prompts it is prefilled with."""
  latent_shape = model_lib.latent_shape(model.cfg, model.latent, 1)
  params = dequantize_params(params, jnp.dtype(model.cfg.dtype))

  def one(row, length, key):
    row, length = row[None], length[None]
    valid, _ = generation.prompt_mask(length, row.shape[1])
    fitted, _ = latent_lib.infer(model, params, row[:, :-1], row[:, 1:], key, valid=valid[:, :-1])
    prior = jax.random.normal(key, latent_shape, jnp.float32)
    return jnp.where(length[0] >= 2, fitted.posterior.mu, prior)[0]

  return jax.vmap(one)(tokens, lengths, keys)


@functools.partial(jax.jit, static_argnames=("model", "axes"), donate_argnames=("slots",))
def admit(model: model_lib.LM, params, slots: Slots, tokens: jax.Array, lengths: jax.Array, rows: jax.Array,
          key_data: jax.Array, budget: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *,
          axes) -> Slots:
  """Prefills Bp left-padded prompts tokens [Bp, T] of `lengths` [Bp] from empty states and writes them into the
  rows `rows` [Bp] of `slots` (an index of S drops a padding prompt). key_data [Bp, ...]: each request's PRNG key
  data (`jax.random.key_data(jax.random.key(seed))`), split as `LanguageModel.generate` splits it into a sampling key
  and a latent key. budget, temperature, top_k, top_p [Bp]: as in `Slots`. `axes`: `state_batch_axes(model)`, as a
  hashable tree (a tuple)."""
  keys = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data))
  sample_keys, latent_keys = keys[:, 0], keys[:, 1]
  latents = None
  if model_lib.uses_latents(model.latent) is not None:
    latents = _fit_latents(model, params, tokens, lengths, latent_keys)
  d = generation.prefill(model, params, tokens, lengths, latents)
  batch = tokens.shape[0]
  new = Slots(d._replace(state=None, generated=jnp.zeros((batch,), jnp.int32)),
              budget, sample_keys, temperature, top_k, top_p, latents)
  state = _put_rows(slots.decoding.state, d.state, rows, axes)
  rest = _put_rows(slots._replace(decoding=slots.decoding._replace(state=None)), new, rows)
  return rest._replace(decoding=rest.decoding._replace(state=state))


@functools.partial(jax.jit, static_argnames=("model", "axes"), donate_argnames=("lanes",))
def feed_lanes(model: model_lib.LM, params, lanes: generation.Decoding, tokens: jax.Array, lengths: jax.Array,
               fresh: jax.Array, *, axes) -> generation.Decoding:
  """Runs one piece per lane, tokens [L, P] left-padded to `lengths` [L], through the model from each lane's state
  (from empty where `fresh` [L]) -> the lanes after it: state, the next-token logits, positions (tokens fed so far)
  and last token. A lane of length 0 is idle and unchanged. Feeding a prompt in pieces this way gives the state and
  logits of prefilling it whole (`generation.prefill`), up to float rounding. Not for latent models (z is fitted
  to the whole prompt)."""
  batch, length = tokens.shape
  empty = model_lib.init_state(model.cfg, batch, model.cache_capacity)
  state = _where_rows(fresh, empty, lanes.state, axes)
  valid, _ = generation.prompt_mask(lengths, length)
  logits, after = generation.run_model(model, params, tokens, state, None, None, valid, True)
  busy = lengths > 0
  positions = jnp.where(fresh, 0, lanes.positions) + lengths
  return generation.Decoding(_where_rows(busy, after, state, axes),
                             jnp.where(busy[:, None], logits[:, -1].astype(jnp.float32), lanes.logits),
                             positions, jnp.where(busy, tokens[:, -1], lanes.last_token), lanes.done,
                             lanes.generated)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("slots",))
def place(slots: Slots, lanes: generation.Decoding, rows: jax.Array, key_data: jax.Array, budget: jax.Array,
          temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, *, axes) -> Slots:
  """Writes every lane into the row `rows` [L] names (an index of S: the lane is not placed), with its request's
  settings as `admit` takes them, ready to decode."""
  keys = jax.vmap(jax.random.split)(jax.random.wrap_key_data(key_data))
  count = rows.shape[0]
  d = lanes._replace(state=None, done=jnp.zeros((count,), bool), generated=jnp.zeros((count,), jnp.int32))
  new = Slots(d, budget, keys[:, 0], temperature, top_k, top_p, None)
  state = _put_rows(slots.decoding.state, lanes.state, rows, axes)
  rest = _put_rows(slots._replace(decoding=slots.decoding._replace(state=None)), new, rows)
  return rest._replace(decoding=rest.decoding._replace(state=state))


MAX_LOGPROBS = 20  # The most alternatives a token's logprobs name (OpenAI's chat limit, vLLM's default).


class Scores(NamedTuple):
  """What a decode chunk's steps scored, per row and step: logprob [S, steps] float32, the drawn token's log
  probability under the model's distribution (log_softmax of its logits, before temperature, top-k and top-p), and
  the K = min(MAX_LOGPROBS, vocabulary) most likely tokens: ids [S, steps, K] int32 and their logprobs
  [S, steps, K] float32, most likely first. Zeros where nothing was scored."""
  logprob: jax.Array
  ids: jax.Array
  top: jax.Array


def _score(logits: jax.Array, token: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logprob [S] of token [S], top ids [S, k], their logprobs [S, k]) under logits [S, V]."""
  lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top, ids = jax.lax.top_k(lp, k)
  return jnp.take_along_axis(lp, token[:, None], axis=-1)[:, 0], ids.astype(jnp.int32), top


@functools.partial(jax.jit, static_argnames=("model", "steps", "stop_tokens", "on_step"), donate_argnames=("slots",))
def decode_chunk(model: model_lib.LM, params, slots: Slots, active: jax.Array, limit: jax.Array | None = None,
                 scored: jax.Array | bool = False, *, steps: int, stop_tokens: tuple[int, ...],
                 on_step: Callable[..., None] | None = None) -> tuple[jax.Array, jax.Array, Slots, Scores]:
  """Draws up to `steps` tokens in every row -> (tokens [S, steps] int32, steps run [] int32, slots after them,
  `Scores`). `limit` (an int32 scalar, traced; None: `steps`) runs at most that many of the steps, so shorter chunks
  need no program of their own. `scored` (a bool scalar, traced): whether the steps score their tokens (the top-k
  over the vocabulary costs a sort a step); unscored, `Scores` are zeros, from the same program.

  Rows not `active` [S] are marked done first. A row is done once it draws a stop token or its budget runs out;
  a done row repeats its last token. The loop ends early once every row is done (then the columns past `count` are
  each row's last token). `on_step` (hashable; None: off) is called on the host, in step order, with each step's
  tokens [S] int32, which rows drew them [S] bool and the step's scores (logprob [S], ids [S, K], top [S, K]) while
  the loop goes on: tokens reach the host as they are drawn, not once the chunk ends (for a few hundred
  microseconds of host round trip a step on CPU)."""
  stops = jnp.asarray(stop_tokens, jnp.int32)
  slots = slots._replace(decoding=slots.decoding._replace(done=slots.decoding.done | ~active))
  params = generation.model_params(model, params)  # Once, ahead of the token loop (as generation.decode does).
  rows, k = active.shape[0], min(MAX_LOGPROBS, slots.decoding.logits.shape[-1])
  unscored = lambda logits, token: (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, k), jnp.int32),
                                    jnp.zeros((rows, k), jnp.float32))

  def draw(carry) -> tuple[tuple, jax.Array]:
    s, step, scores = carry
    d = s.decoding
    keys = jax.vmap(jax.random.fold_in)(s.keys, d.generated)
    token = sample_rows(keys, d.logits, s.temperature, s.top_k, s.top_p)
    token = jnp.where(d.done, d.last_token, token)
    drawing = ~d.done
    budget = s.budget - drawing
    done = d.done | jnp.isin(token, stops) | (budget <= 0)
    now = jax.lax.cond(scored, functools.partial(_score, k=k), unscored, d.logits, token)
    if on_step is not None:
      io_callback(on_step, None, token, drawing, *now, ordered=True)
    scores = Scores(*(table.at[:, step].set(value) for table, value in zip(scores, now)))
    s = s._replace(decoding=generation.feed(model, params, d, token, done, s.latents, drawing), budget=budget)
    return (s, step + 1, scores), token

  empty = Scores(jnp.zeros((rows, steps), jnp.float32), jnp.zeros((rows, steps, k), jnp.int32),
                 jnp.zeros((rows, steps, k), jnp.float32))
  tokens, count, (slots, _, scores) = generation.token_loop(draw, (slots, jnp.zeros((), jnp.int32), empty), steps,
                                                            lambda c: c[0].decoding, limit)
  return tokens, count, slots, scores


def host_key_data(seed: int) -> np.ndarray:
  """The key data of jax.random.key(seed) on the host (uint32 words), as `admit` takes it."""
  return np.asarray(jax.random.key_data(jax.random.key(seed)))

"""On-device token sampling: greedy, temperature, top-k, top-p with per-request seeds.

Sampling is a pure function of (logits, per-row parameters, seed, output position): the
PRNG key of a row is `fold_in(key(seed), position)` where `position` is the index of the
output token being sampled. A request therefore draws the same random numbers whatever
else shares its batch, whether its prefix came from the cache, and after a preemption.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class SamplingArrays(NamedTuple):
    """Per-row sampling parameters of one step (host numpy, moved with the step inputs).

    Rows follow `StepInputs.logits_indices` (caller order); padding rows are greedy.

    Attributes:
      temperature: f32[S]; 0 means greedy.
      top_k: i32[S]; 0 disables.
      top_p: f32[S]; 1 disables.
      seeds: u32[S] per-request seeds.
      output_positions: i32[S] index of the output token each row samples.
    """

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    output_positions: np.ndarray

    @classmethod
    def build(cls, rows: list[tuple[float, int, float, int, int]], num_rows: int
              ) -> "SamplingArrays":
        """Packs (temperature, top_k, top_p, seed, output_position) rows, padded to num_rows."""
        n = len(rows)
        if n > num_rows:
            raise ValueError(f"{n} sampling rows do not fit in {num_rows}")
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        positions = np.zeros(num_rows, np.int32)
        if n:
            t, k, p, s, o = zip(*rows)
            temperature[:n] = t
            top_k[:n] = k
            top_p[:n] = p
            seeds[:n] = s
            positions[:n] = o
        return cls(temperature, top_k, top_p, seeds, positions)


def sample(logits: jax.Array, params: SamplingArrays, *, all_greedy: bool) -> jax.Array:
    """Samples one token per row.

    Args:
      logits: f32 (or bf16)[S, vocab] next-token logits.
      params: SamplingArrays of device arrays, each [S].
      all_greedy: static; True skips the sort (every row is greedy).

    Returns:
      i32[S] token ids.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        return greedy
    vocab = logits.shape[-1]
    temperature = params.temperature
    is_greedy = temperature <= 0.0
    scaled = logits / jnp.where(is_greedy, 1.0, temperature)[:, None]

    def draw(seed, position, row):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.categorical(key, row)

    # NOTE: a row that truncates nothing (top_k 0, top_p 1) draws from its logits in
    # vocabulary order, with no sort; rows that truncate draw from their kept tokens in
    # sorted order. The sort over the full vocabulary ([S, V] argsort: 147 CPU ms of a
    # 235 ms SmolLM2 decode step at batch 8 on CPU) then runs only when some row
    # truncates (`lax.cond`); a row's draw depends on its own parameters alone, whatever
    # else shares its batch.
    plain = jax.vmap(draw)(params.seeds, params.output_positions, scaled).astype(jnp.int32)
    truncates = ~is_greedy & ((params.top_k > 0) | (params.top_p < 1.0))

    def with_truncation(_):
        order = jnp.argsort(-scaled, axis=-1, stable=True)  # [S, V] most likely first
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        ranks = jnp.arange(vocab, dtype=jnp.int32)[None, :]
        k = jnp.where(params.top_k > 0, params.top_k, vocab)
        drop = ranks >= k[:, None]
        probs = jax.nn.softmax(jnp.where(drop, -jnp.inf, sorted_logits), axis=-1)
        # NOTE: keep a token while the mass of the tokens before it is below top_p, so
        # the most likely token is always kept.
        before = jnp.cumsum(probs, axis=-1) - probs
        drop = drop | (before >= params.top_p[:, None])
        masked = jnp.where(drop, -jnp.inf, sorted_logits)
        choice = jax.vmap(draw)(params.seeds, params.output_positions, masked)
        picked = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        return jnp.where(truncates, picked.astype(jnp.int32), plain)

    sampled = jax.lax.cond(jnp.any(truncates), with_truncation, lambda _: plain, None)
    return jnp.where(is_greedy, greedy, sampled)

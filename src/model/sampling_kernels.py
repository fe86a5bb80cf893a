"""Batched sampling kernels on [R, V] logits: penalties, warpers, one draw per row.

Array code only; ``sampler.py`` turns the requests into the arrays used here.
Every function takes its array module as ``xp`` (NumPy by default) and uses
only calls CuPy also has: ``exp``, ``where``, ``cumsum``, ``max``/``sum``/
``argmax`` along an axis, ``argpartition``, ``sort``/``argsort`` (on unique
keys, or with ``kind="stable"``, CuPy's only kind), ``take_along_axis``,
``nonzero``, ``view`` and integer shifts, and fancy indexing and assignment
on (row, column) pairs that are unique within one call (no ``add.at``). No
``searchsorted``: the inverse CDF counts ``cdf <= target``. A CUDA backend can
run the same code on device arrays; the host-side control flow (which rows
take which path, whether a retry pass is needed) costs a few small syncs.

Conventions, in the order ``sampler.sample`` applies them:

- logit bias, then min_tokens bans (``-inf``), then the repetition penalty
  of CTRL (Keskar et al. 2019) as Hugging Face implements it (divide positive
  logits of seen tokens, multiply negative ones), then presence/frequency
  penalties as the OpenAI API reference defines them
  (``logit -= presence * (count > 0) + frequency * count`` over output tokens).
  All in float32, each request's values rounded to float32 first.
- Random rows: temperature, then top-k, top-p (Holtzman et al. 2019: keep the
  smallest most-likely set whose mass reaches top_p; the token crossing the
  threshold stays), then min-p (Nguyen et al. 2024: drop tokens below
  min_p x the largest kept probability), each seeing the mass the previous
  one left (Hugging Face's warper order, ``_FILTERS``). Probabilities are
  float64 ``exp(x / T - max(x / T))`` of the float32 logits.

Ranking: descending logit, ties broken by the lower token id, so the kept set
is unique. Every filter keeps a prefix of that ranking. The draw is an
inverse CDF over the kept tokens in ascending token-id order with one uniform
``u`` in [0, 1) per row (``u x kept mass``, first token whose cumulative mass
exceeds it, clamped to the last kept token).

Top-k/top-p rows do not sort the vocabulary: ``argpartition`` takes each
row's K best candidates (K = ``CANDIDATES``, or top_k when larger), only those
are sorted (by a unique int64 key, so any sort kind gives the same order),
and a row whose kept set might reach past its candidates (top-p mass not
reached within them, or logits tied across the boundary) is redone with 4x
more candidates, at worst the whole row. The result equals the full-sort
definition.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

Array = Any  # numpy.ndarray or cupy.ndarray

#: Candidates per row in the first top-k/top-p pass (4x per retry): enough
#: for top_p 0.95 over 49,152 logits drawn as N(0, 9) at temperature 0.8.
CANDIDATES = 2048
#: Rows per block of whole-row float64 work (temporaries of 8 x V stay in cache).
_BLOCK = 8


# ---------------------------------------------------------------- penalties


def apply_penalties(logits: Array, bias: tuple[Array, Array, Array],
                    banned: tuple[Array, Array], repetition: tuple[Array, Array, Array],
                    counts: tuple[Array, Array, Array, Array, Array],
                    xp: ModuleType = np) -> None:
    """Penalize float32[R, V] ``logits`` in place from concatenated index arrays.

    Args:
        bias: (rows int64[B], token ids int64[B], bias float32[B]).
        banned: (rows int64[N], token ids int64[N]) set to ``-inf`` (min_tokens).
        repetition: (rows int64[S], seen token ids int64[S], penalty float32[S]);
            a (row, token) pair at most once.
        counts: (rows int64[C], output token ids int64[C], count float32[C],
            presence float32[C], frequency float32[C]); pairs at most once.
    """
    rows, ids, values = bias
    logits[rows, ids] += values
    rows, ids = banned
    logits[rows, ids] = -np.inf
    rows, ids, pen = repetition
    vals = logits[rows, ids]
    logits[rows, ids] = xp.where(vals > 0, vals / pen, vals * pen)
    rows, ids, count, presence, frequency = counts
    logits[rows, ids] -= presence + frequency * count


# ---------------------------------------------------------------- filters


@dataclass(frozen=True)
class Warpers:
    """Per-row settings of random rows.

    ``temperature`` float64[R] > 0; ``top_k`` int64[R], 0 when off (callers map
    -1 and k >= V to 0); ``top_p`` float64[R] in (0, 1], 1 when off; ``min_p``
    float64[R] in [0, 1], 0 when off.
    """

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array

    def take(self, rows: Array) -> Warpers:
        return Warpers(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                       self.min_p[rows])


class _Prefix:
    """Kept prefix of each row's candidates, sorted by descending weight.

    ``w``/``cum``: float64[R, K] weights and their running sums; ``n``:
    int64[R] kept count; ``mass``: float64[R] mass of the kept set;
    ``open``: bool[R], the kept set may reach past the K candidates.
    """

    def __init__(self, w: Array, mass: Array, open_: Array, xp: ModuleType) -> None:
        self.xp = xp
        self.w, self.cum = w, xp.cumsum(w, axis=1)
        self.n = xp.full(w.shape[0], w.shape[1], dtype=np.int64)
        self.mass, self.open = mass, open_
        self.pos = xp.arange(w.shape[1])[None, :]

    def cut(self, active: Array, keep: Array) -> None:
        """In ``active`` rows keep the leading tokens where ``keep`` holds
        (bool[R, K], true on a prefix of the ranking)."""
        xp = self.xp
        if not active.any():
            return
        n = (keep & (self.pos < self.n[:, None])).sum(axis=1)
        self.n = xp.where(active, n, self.n)
        last = xp.take_along_axis(self.cum, (self.n - 1)[:, None], axis=1)[:, 0]
        self.mass = xp.where(active, last, self.mass)


def _top_k(f: _Prefix, warp: Warpers) -> None:
    """Keep the ``top_k`` best tokens (the caller made K >= top_k)."""
    active = warp.top_k > 0
    f.cut(active, f.pos < warp.top_k[:, None])
    f.open &= ~active


def _top_p(f: _Prefix, warp: Warpers) -> None:
    """Keep a token while the mass strictly before it is below ``top_p`` x the
    kept mass, so the token crossing the threshold stays."""
    active = warp.top_p < 1.0
    threshold = (warp.top_p * f.mass)[:, None]
    f.cut(active, f.cum - f.w < threshold)
    f.open &= ~(active & (f.cum[:, -1] >= threshold[:, 0]))


def _min_p(f: _Prefix, warp: Warpers) -> None:
    """Drop tokens below ``min_p`` x the largest kept weight."""
    active = warp.min_p > 0.0
    threshold = (warp.min_p * f.w[:, 0])[:, None]
    f.cut(active, f.w >= threshold)
    f.open &= ~(active & (f.w[:, -1] < threshold[:, 0]))


#: Warpers applied after temperature, in order (Hugging Face's order).
_FILTERS = (_top_k, _top_p, _min_p)


# ---------------------------------------------------------------- draw


def _weights(x: Array, temperature: Array, scaled_max: Array, xp: ModuleType) -> Array:
    """float64[R, N] ``exp(x / T - max(x / T))`` of float32[R, N] ``x`` (a new array)."""
    w = x.astype(np.float64)
    w /= temperature[:, None]
    w -= scaled_max[:, None]
    return xp.exp(w, out=w)


def _rank_order(vals: Array, ids: Array, xp: ModuleType) -> Array:
    """int64[R, K] permutation of each row: descending float32 ``vals``, ties by
    lower ``ids`` (int64[R, K]). The key is unique, so any sort kind agrees."""
    bits = (vals + np.float32(0.0)).view(np.int32).astype(np.int64)  # -0.0 ranks as 0.0
    monotone = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integers in the floats' order
    return xp.argsort((-monotone << 32) | ids, axis=1)


def _inverse_cdf(w: Array, keep: Array | None, u: Array, xp: ModuleType) -> Array:
    """int64[R]: column drawn by ``u`` (float64[R]) among the ``keep`` columns
    (None: all) of float64[R, N] ``w``, walked in column order. Overwrites
    ``w`` with the running sums (a second [R, N] temporary costs more than
    the sums themselves on the CPU)."""
    if keep is not None:
        xp.multiply(w, keep, out=w)
    cdf = xp.cumsum(w, axis=1, out=w)
    col = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    if keep is None:
        return xp.minimum(col, w.shape[1] - 1)
    last = keep.shape[1] - 1 - xp.argmax(keep[:, ::-1], axis=1)
    return xp.minimum(col, last)


def _select_full(x: Array, warp: Warpers, scaled_max: Array, xp: ModuleType
                 ) -> tuple[Array, Array | None]:
    """Rows without top-k/top-p: (weights float64[R, V], kept bool[R, V] after
    min-p, or None when no row has min-p: all kept)."""
    w = _weights(x, warp.temperature, scaled_max, xp)
    if not (warp.min_p > 0.0).any():
        return w, None
    return w, w >= (warp.min_p * w.max(axis=1))[:, None]


def _candidates(x: Array, k: int, xp: ModuleType) -> tuple[Array, Array]:
    """Token ids int64[R, k] of each row's k largest values, ascending, and
    those values; k <= V."""
    rows, vocab = x.shape
    if k < vocab:
        ids = xp.sort(xp.argpartition(x, vocab - k, axis=1)[:, vocab - k:], axis=1)
    else:
        ids = xp.broadcast_to(xp.arange(vocab), (rows, vocab))
    return ids, xp.take_along_axis(x, ids, axis=1)


def _select_candidates(x: Array, k: int, warp: Warpers, scaled_max: Array, mass: Array,
                       xp: ModuleType) -> tuple[Array, Array, Array, Array]:
    """One pass over k candidates per row: (candidate ids int64[R, k] ascending,
    their weights float64[R, k], kept bool[R, k], exact bool[R]).

    ``mass``: float64[R] weight of the whole row (read by top-p without
    top-k). Rows not ``exact`` must be redone with more candidates.
    """
    ids, vals = _candidates(x, k, xp)                          # by id
    order = _rank_order(vals, ids, xp)                         # by rank, ties by id
    ranked = xp.take_along_axis(vals, order, axis=1)
    f = _Prefix(_weights(ranked, warp.temperature, scaled_max, xp), mass,
                xp.full(x.shape[0], k < x.shape[1]), xp)
    for step in _FILTERS:
        step(f, warp)
    last = (f.n - 1)[:, None]
    last_val = xp.take_along_axis(ranked, last, axis=1)
    last_id = xp.take_along_axis(xp.take_along_axis(ids, order, axis=1), last, axis=1)
    exact = ~f.open
    if k < x.shape[1]:  # kept set ends on a logit tied with tokens outside the candidates?
        tied = xp.nonzero(exact & (last_val[:, 0] == ranked[:, -1]))[0]
        if tied.size:
            exact[tied] = (x[tied] >= ranked[tied, -1:]).sum(axis=1) <= k
    keep = (vals > last_val) | ((vals == last_val) & (ids <= last_id))
    return ids, _weights(vals, warp.temperature, scaled_max, xp), keep, exact


def _rows(x: Array, rows: Array, xp: ModuleType) -> Array:
    """``x[rows]``, a view (no copy) when ``rows`` are consecutive ascending."""
    if rows.size and int(rows[-1]) - int(rows[0]) == rows.size - 1 and \
            bool((rows[1:] > rows[:-1]).all()):
        return x[int(rows[0]):int(rows[-1]) + 1]
    return x[rows]


def _row_mass(x: Array, rows: Array, warp: Warpers, scaled_max: Array, xp: ModuleType
              ) -> Array:
    """float64[R]: total weight of each of ``rows`` (read by top-p without
    top-k), 0 elsewhere; in blocks of ``_BLOCK`` rows."""
    mass = xp.zeros(x.shape[0])
    for start in range(0, rows.size, _BLOCK):
        block = rows[start:start + _BLOCK]
        mass[block] = _weights(x[block], warp.temperature[block], scaled_max[block],
                               xp).sum(axis=1)
    return mass


def _select(x: Array, warp: Warpers, candidates: int | None, xp: ModuleType
            ) -> Iterator[tuple[Array, Array | None, Array, Array | None]]:
    """The kept tokens of every row of float32[R, V] ``x``, in groups of rows,
    each produced when the caller asks for it: (row indices int64[G], token
    ids int64[G, N] ascending or None for ``arange(V)``, weights float64[G, N],
    kept bool[G, N] or None for all)."""
    x = x.astype(np.float32, copy=False)  # the rank key reads float32 bits
    rows, vocab = x.shape
    scaled_max = x.max(axis=1).astype(np.float64) / warp.temperature
    ranked = (warp.top_k > 0) | (warp.top_p < 1.0)
    full = xp.nonzero(~ranked)[0]
    for start in range(0, full.size, _BLOCK):  # row blocks: float64 temporaries stay in cache
        block = full[start:start + _BLOCK]
        yield block, None, *_select_full(_rows(x, block, xp), warp.take(block),
                                         scaled_max[block], xp)
    todo = xp.nonzero(ranked)[0]
    mass = _row_mass(x, todo[warp.top_k[todo] == 0], warp, scaled_max, xp)
    k = min(candidates or CANDIDATES, vocab)
    while todo.size:
        fits = warp.top_k[todo] <= k
        now, later = todo[fits], todo[~fits]
        ids, w, keep, exact = _select_candidates(_rows(x, now, xp), k, warp.take(now),
                                                 scaled_max[now], mass[now], xp)
        yield now[exact], ids[exact], w[exact], keep[exact]
        todo = xp.concatenate([later, now[~exact]])
        k = min(4 * k, vocab)


def sample_random(x: Array, warp: Warpers, u: Array, xp: ModuleType = np,
                  candidates: int | None = None) -> Array:
    """Token ids int64[R], one per row of processed float32[R, V] logits ``x``
    (not modified), from uniform draws ``u`` float64[R] in [0, 1).
    ``candidates``: first-pass K (default ``CANDIDATES``)."""
    tokens = xp.zeros(x.shape[0], dtype=np.int64)
    for rows, ids, w, keep in _select(x, warp, candidates, xp):
        col = _inverse_cdf(w, keep, u[rows], xp)
        tokens[rows] = col if ids is None else xp.take_along_axis(ids, col[:, None], axis=1)[:, 0]
    return tokens


def kept_mask(x: Array, warp: Warpers, xp: ModuleType = np,
              candidates: int | None = None) -> Array:
    """bool[R, V]: the tokens each row may draw (the support ``sample_random`` uses)."""
    mask = xp.zeros(x.shape, dtype=bool)
    for rows, ids, w, keep in _select(x, warp, candidates, xp):
        if ids is None:
            mask[rows] = True if keep is None else keep
        else:
            mask[rows[:, None], ids] = keep
    return mask


def warped_probs(x: Array, warp: Warpers, xp: ModuleType = np,
                 candidates: int | None = None) -> Array:
    """float64[R, V]: the distribution ``sample_random`` draws each row of
    processed float32[R, V] logits ``x`` from (temperature, then the kept
    set of ``kept_mask``, normalized); what rejection sampling compares
    (``kvserve.model.spec_verify``)."""
    keep = kept_mask(x, warp, xp, candidates)
    w = _weights(x, warp.temperature, x.max(axis=1).astype(np.float64) / warp.temperature, xp)
    w *= keep
    w /= w.sum(axis=1, keepdims=True)
    return w


# ---------------------------------------------------------------- logprobs


def log_softmax(x: Array, xp: ModuleType = np) -> Array:
    """float64[R, V] log-softmax of float32[R, V] rows."""
    shifted = x.astype(np.float64) - x.max(axis=1, keepdims=True)
    return shifted - xp.log(xp.exp(shifted).sum(axis=1, keepdims=True))


def top_values(values: Array, k: int, xp: ModuleType = np) -> tuple[Array, Array]:
    """The k largest of each row of [R, V] ``values``, descending, ties by
    lower id: (ids int64[R, k], values[R, k]); 0 < k <= V."""
    ids, vals = _candidates(values, k, xp)  # which of values tied at k-th place: unspecified
    order = xp.argsort(-vals, axis=1, kind="stable")
    return xp.take_along_axis(ids, order, axis=1), xp.take_along_axis(vals, order, axis=1)

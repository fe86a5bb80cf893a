"""KV-cache groups: which layers share a block table, for models that mix
full and sliding-window attention (Gemma 3: five sliding layers of every six).

A sliding-window layer needs only the last ``window`` tokens' K/V, so the
blocks a long request holds for it can be freed as it advances, while a
full-attention layer keeps every block. Following vLLM's hybrid KV-cache
manager (``vllm/v1/core/kv_cache_utils.py``, "unify hybrid kv cache spec"),
layers are partitioned into *groups* of one attention type and an equal
number ``k`` of layers; a group has its own block table per request, and all
groups allocate from one pool whose blocks hold ``k`` layers' K/V. So one
block id is a page of ``k`` layer buffers, and freeing it for one group
frees memory usable by any group. ``k`` is the greatest common divisor of
the counts of each type (vLLM pads to the smallest count instead; the gcd
needs no padding): Gemma 3 270M's 3 full and 15 sliding layers give ``k =
3``, one full group and five sliding groups. A model with one attention type
is one group of all its layers: exactly the single block table of before.

Layer ``l`` belongs to group ``layer_group[l]`` and keeps its K/V in buffer
``layer_slot[l]`` (0 .. k-1) at the block ids of that group's table: the
backend allocates ``k`` buffers, not one per layer.

Pure logic; no backend, no asyncio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table: ``window`` tokens of sliding-window
    attention (a query at position p sees keys p - window < j <= p), or
    None for full attention; ``layers`` in increasing order."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups of a model's layers and where each layer's K/V lives.

    Attributes:
        groups: full-attention groups first (so that group 0 of a model with
            any full layer is a full one, whose block hashes are the plain ones).
        group_size: layers per group, ``k``: the buffers the backend allocates
            and the layers one block id holds.
        layer_group, layer_slot: per layer, its group and its buffer (0 .. k-1).
    """

    groups: tuple[KVCacheGroup, ...]
    group_size: int
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        """Block tables per request (G)."""
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention)."""
        return tuple(group.window for group in self.groups)

    @property
    def is_hybrid(self) -> bool:
        """Whether some group has a sliding window (its blocks are freed as a
        request advances)."""
        return any(window is not None for window in self.windows)

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """Most block ids one request of ``num_tokens`` tokens holds at once,
        computing at most ``chunk_tokens`` tokens a step: a full group needs
        a block per ``block_size`` tokens; a sliding group needs the blocks
        of the window behind a step's first token and of the step's tokens,
        ``ceil((window - 1 + chunk_tokens) / block_size) + 1`` (the +1: the
        window may start inside a block), never more than the full count.
        """
        full = -(-num_tokens // block_size)
        total = 0
        for window in self.windows:
            if window is None:
                total += full
            else:
                total += min(full, -(-(window - 1 + chunk_tokens) // block_size) + 1)
        return total


def kv_cache_layout(layer_types: Sequence[str], sliding_window: int | None) -> KVCacheLayout:
    """Group layers by attention type (see the module docstring).

    Args:
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"``
            (Hugging Face's ``layer_types``).
        sliding_window: tokens a sliding layer sees; None or 0 makes every
            layer full (a checkpoint whose window is off).

    Raises:
        ValueError: no layers, an unknown layer type, or a non-positive window.
    """
    if not layer_types:
        raise ValueError("a model needs at least one layer")
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"unknown layer types {unknown} (expected {FULL_ATTENTION!r} or "
                         f"{SLIDING_ATTENTION!r})")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if not sliding_window:
        layer_types = [FULL_ATTENTION] * len(layer_types)
    by_type = {kind: [i for i, t in enumerate(layer_types) if t == kind]
               for kind in (FULL_ATTENTION, SLIDING_ATTENTION)}
    size = math.gcd(*(len(layers) for layers in by_type.values() if layers))
    groups: list[KVCacheGroup] = []
    for kind, layers in by_type.items():
        window = sliding_window if kind == SLIDING_ATTENTION else None
        groups += [KVCacheGroup(window, tuple(layers[i:i + size]))
                   for i in range(0, len(layers), size)]
    layer_group = [0] * len(layer_types)
    layer_slot = [0] * len(layer_types)
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            layer_group[layer], layer_slot[layer] = g, slot
    return KVCacheLayout(tuple(groups), size, tuple(layer_group), tuple(layer_slot))


def model_kv_layout(model: ModelConfig) -> KVCacheLayout:
    """The layout of a checkpoint's layers (``layer_types``, ``sliding_window``)."""
    return kv_cache_layout(model.layer_types, model.sliding_window)


def single_group(num_layers: int) -> KVCacheLayout:
    """The layout of a model whose layers all use full attention."""
    return kv_cache_layout([FULL_ATTENTION] * num_layers, None)

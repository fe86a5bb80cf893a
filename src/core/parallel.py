"""Model-parallel layouts: which layers each pipeline stage holds, which
heads each tensor-parallel worker holds.

Pure arithmetic (standard library only), shared by ``kvserve plan`` and the
engine, so that the figures the plan prints are the ones the workers use.

Pipeline parallelism (vLLM's ``--pipeline-parallel-size``) splits the
decoder layers into contiguous stages. The default split is vLLM's
``get_pp_indices``: every stage gets ``L // P`` layers and the remainder
goes one layer each to the stages just before the last one (the last stage
also runs the final norm and the LM head, so it is kept lighter). A
partition may be given instead (vLLM reads it from ``VLLM_PP_LAYER_PARTITION``;
kvserve from ``--pp-layer-partition``).

Tensor parallelism (``--tensor-parallel-size``) splits attention by KV
head: worker w holds a contiguous range of KV heads and the query heads of
their GQA groups. vLLM requires T to divide the KV heads (or the KV heads
to divide T, and then replicates each KV head on T / nkv workers); kvserve
also takes a T that does neither by giving the workers uneven ranges
(3 KV heads over 2 workers: 2 and 1), so the KV cache is still sharded
and no KV head is stored twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def pp_layer_ranges(num_layers: int, pipeline_parallel_size: int,
                    partition: Sequence[int] | None = None) -> list[range]:
    """The decoder layers of each pipeline stage, in order.

    Args:
        num_layers: the model's decoder layers (``num_hidden_layers``).
        pipeline_parallel_size: stages P >= 1.
        partition: layers per stage (P positive integers summing to
            ``num_layers``), or None for vLLM's even split
            (``vllm.distributed.utils.get_pp_indices``).

    Returns:
        P contiguous ``range`` s covering ``0 .. num_layers - 1``.

    Raises:
        ValueError: P < 1, more stages than layers, or a partition of the
            wrong length, with a part < 1, or not summing to the layers.
    """
    p = pipeline_parallel_size
    if p < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {p}")
    if p > num_layers:
        raise ValueError(f"--pipeline-parallel-size {p} is more stages than the model's "
                         f"{num_layers} layers")
    if partition is None:
        sizes = [num_layers // p] * p
        for i in range(2, num_layers % p + 2):  # the stages before the last get the rest
            sizes[-i] += 1
    else:
        sizes = list(partition)
        if len(sizes) != p or min(sizes) < 1 or sum(sizes) != num_layers:
            raise ValueError(f"--pp-layer-partition {','.join(map(str, sizes))} must be "
                             f"{p} positive layer counts summing to {num_layers}")
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def parse_partition(text: str) -> tuple[int, ...]:
    """``"16,14"`` -> ``(16, 14)``; ``ValueError`` for anything else."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--pp-layer-partition must be comma-separated layer counts, "
                         f"got {text!r}") from None


@dataclass(frozen=True)
class HeadShard:
    """The heads one tensor-parallel worker holds.

    ``kv_heads``: its KV heads (global indices, contiguous); ``q_heads``:
    the query heads of their GQA groups (``num_heads // num_kv_heads`` per
    KV head, contiguous). With more workers than KV heads, a KV head is
    replicated (``replicated`` True) and the worker holds a share of its
    group's query heads.
    """

    rank: int
    q_heads: range
    kv_heads: range
    replicated: bool = False


def tp_head_shards(num_heads: int, num_kv_heads: int,
                   tensor_parallel_size: int) -> list[HeadShard]:
    """Each tensor-parallel worker's query and KV heads.

    T <= nkv: worker w gets KV heads ``[w * nkv // T, (w + 1) * nkv // T)``
    (uneven when T does not divide nkv) and their query heads. T > nkv
    (vLLM's replication): T must be a multiple of nkv; worker w holds KV
    head ``w // (T // nkv)`` and an equal share of its group's query heads,
    which must divide evenly.

    Raises:
        ValueError: T < 1, heads not a multiple of the KV heads, more
            workers than query heads, or a replication that does not divide.
    """
    t = tensor_parallel_size
    if t < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {t}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not groups of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if t > num_heads:
        raise ValueError(f"--tensor-parallel-size {t} is more workers than the model's "
                         f"{num_heads} attention heads")
    if t <= num_kv_heads:
        shards = []
        for w in range(t):
            lo, hi = w * num_kv_heads // t, (w + 1) * num_kv_heads // t
            shards.append(HeadShard(w, range(lo * group, hi * group), range(lo, hi)))
        return shards
    per_kv = t // num_kv_heads
    if t % num_kv_heads or group % per_kv:
        raise ValueError(f"--tensor-parallel-size {t} with {num_kv_heads} KV heads: more workers "
                         f"than KV heads must be a multiple of them whose share divides the "
                         f"{group} query heads of a group")
    share = group // per_kv
    return [HeadShard(w, range(w * share, (w + 1) * share), range(w // per_kv, w // per_kv + 1),
                      replicated=True) for w in range(t)]


def tp_column_split(size: int, tensor_parallel_size: int) -> list[range]:
    """A dimension (the MLP's intermediate size) split into T contiguous
    ranges, the first ``size % T`` one longer (Megatron-LM's column split,
    uneven where T does not divide it)."""
    t = tensor_parallel_size
    base, extra = divmod(size, t)
    ranges, start = [], 0
    for w in range(t):
        n = base + (1 if w < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges

"""Mutation check: does the fast suite fail when the numerics are wrong?

Each mutant is a deliberate small fault (a wrong attention scale, RoPE
direction, norm epsilon, residual, sampler filter, penalty sign, block-hash
link, slot offset ...). For each one the tool copies ``src/`` and ``tests/``
into a temporary folder, applies the fault there (the checkout is never
touched), and runs the mutant's fast tests (``-m "not model"``: no default
model, no shared folder) with ``kvserve`` imported from the copy. A mutant is
*killed* when a test fails (a run past ``--timeout``, or one in which no test
ran, e.g. every test of the mutant marked ``model``, is a survivor); every
mutant must be killed. An unmutated baseline
runs first and must pass, so a broken copy cannot pass for a kill.

Usage::

    python tools/mutation_check.py            # all mutants, table at the end
    python tools/mutation_check.py --list     # names and what each one breaks
    python tools/mutation_check.py --only attention_scale rope_direction

Exit status: 0 when every mutant was killed, 1 otherwise, 2 when a mutant no
longer applies (its text is not found the expected number of times) or the
baseline fails.

Adding a mutant: append a ``Mutant`` to ``MUTANTS`` with a name, the file
under ``src/``, one or more ``(old, new)`` edits (``old`` must occur exactly
``count`` times in that file; keep it to one line where you can), the test
paths that should kill it, and one line on what it breaks. Run
``--only NAME``: if it survives, the suite has a hole -- write the test that
kills it, do not weaken the mutant. When a refactor moves the mutated text,
the tool stops with exit 2 naming the mutant; update its ``old`` text.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SAMPLER_TESTS = ("tests/model/test_sampler.py", "tests/model/test_sampler_batched.py")
FORWARD_TESTS = ("tests/model/test_forward_reference.py",)
#: The ops every backend must get right, run over each registered backend.
CONFORMANCE_TESTS = ("tests/backends/test_ops_conformance.py",)
KERNEL_TESTS = ("tests/cpu/test_kernels.py",) + CONFORMANCE_TESTS + FORWARD_TESTS
CUDA_TESTS = ("tests/cuda/test_cuda_ops_routes.py",) + CONFORMANCE_TESTS
INT8_TESTS = ("tests/cpu/test_int8.py", "tests/model/test_quantization.py")
BLOCK_DOT_TESTS = ("tests/cpu/test_block_dot.py",)
FUSED_DECODE_TESTS = ("tests/cpu/test_decode_layer.py",)
BATCH_INVARIANCE_TESTS = ("tests/engine/test_batch_invariance.py",)
GEMMA_FORWARD_TESTS = ("tests/model/test_gemma_forward.py",)
KV_GROUP_TESTS = ("tests/core/test_core_kv_groups.py", "tests/engine/test_sliding_window.py")


@dataclass(frozen=True)
class Mutant:
    """One deliberate fault.

    ``file`` is relative to ``src/``; each ``(old, new)`` edit replaces all
    ``count`` occurrences of ``old`` (exactly that many must exist);
    ``tests`` are pytest paths relative to the repository root.
    """

    name: str
    file: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]
    breaks: str
    count: int = 1


MUTANTS: tuple[Mutant, ...] = (
    Mutant("threads_round_half_busy", "cpu/threads.py",
           (("taken = math.floor(self.mean + 1.0 - self.busy_fraction)",
             "taken = round(self.mean)"),),
           ("tests/cpu/test_thread_hysteresis.py",),
           "a core counts as taken at half-time runnable (the flapping moving average)"),
    Mutant("threads_no_dwell", "cpu/threads.py",
           (("if now - self._last_change < self.min_dwell:", "if False:"),),
           ("tests/cpu/test_thread_hysteresis.py",),
           "thread changes without the minimum dwell between them"),
    Mutant("threads_restore_at_once", "cpu/threads.py",
           (("if waited < (self.restore_after if up else self.drop_after):",
             "if waited < (0.0 if up else self.drop_after):"),),
           ("tests/cpu/test_thread_hysteresis.py",),
           "threads come back as soon as the window allows, not after restore_after"),
    Mutant("attention_scale", "config.py",
           (("return self.head_dim ** -0.5", "return self.head_dim ** -0.45"),),
           FORWARD_TESTS, "softmax scale hd^-0.45 instead of hd^-0.5"),
    Mutant("rope_theta", "model/llama.py",
           (("            config.rope, config.head_dim, config.max_position_embeddings))",
             "            type(config.rope)(config.rope_theta * 2), config.head_dim,\n"
             "            config.max_position_embeddings))"),),
           FORWARD_TESTS, "RoPE base frequency doubled"),
    Mutant("rope_direction", "cpu/kernels.py",
           (("x[t, h, i] = x1 * c - x2 * s", "x[t, h, i] = x1 * c + x2 * s"),
            ("x[t, h, half + i] = x2 * c + x1 * s", "x[t, h, half + i] = x2 * c - x1 * s")),
           KERNEL_TESTS, "rotation by -angle instead of +angle"),
    Mutant("prefill_causal_mask", "cpu/prefill_attention.py",
           (("upper = np.triu(np.full((nq, nq), -np.inf, dtype=_F32), k=1)",
             "upper = np.triu(np.full((nq, nq), -np.inf, dtype=_F32), k=2)"),),
           KERNEL_TESTS, "BLAS prefill attention lets each query see the next token"),
    Mutant("rms_norm_eps_placement", "cpu/kernels.py",
           (("inv = np.float32(1.0 / np.sqrt(ss / H + eps))",
             "inv = np.float32(1.0 / (np.sqrt(ss / H) + eps))"),),
           KERNEL_TESTS, "1/(sqrt(mean)+eps) instead of 1/sqrt(mean+eps)", count=2),
    Mutant("residual_order", "model/llama.py",
           (("ops.fused_add_rms_norm(x, residual, layer.post_norm, eps,",
             "ops.fused_add_rms_norm(residual, x, layer.post_norm, eps,"),),
           FORWARD_TESTS, "attention output and residual stream swapped"),
    Mutant("slot_mapping_offset", "model/input_batch.py",
           (("block_index, offset = positions // bs, positions % bs",
             "block_index, offset = positions // bs, (positions + 1) % bs"),),
           FORWARD_TESTS, "each token's K/V written one slot off"),
    Mutant("input_batch_block_delta", "model/input_batch.py",
           (("self.block_table[row, start:start + len(block_ids)] = block_ids",
             "self.block_table[row, start:start + len(block_ids)] = block_ids[::-1]"),),
           ("tests/model/test_input_batch.py",) + FORWARD_TESTS,
           "the persistent batch appends a step's new blocks in the wrong order"),
    Mutant("block_hash_parent_link", "core/block_hash.py",
           (("parent_hash = hash_block_tokens(parent_hash, block, keys)",
             "parent_hash = hash_block_tokens(None, block, keys)"),),
           ("tests/core/test_core_kv_cache_manager.py",) + FORWARD_TESTS,
           "a block's hash ignores its prefix (two prompts share a block after different prefixes)"),
    Mutant("sliding_window_frees_a_block_early", "core/kv_cache_manager.py",
           (("return max(0, num_computed - self.window + 1) // self.block_size",
             "return max(0, num_computed - self.window + 1 + self.block_size) // self.block_size"),),
           KV_GROUP_TESTS, "a sliding group frees the oldest block its window still sees"),
    Mutant("sliding_window_hit_ignores_window", "core/kv_cache_manager.py",
           (("if all(block is not None for g in self._sliding_groups for block in found[g][first:n]):",
             "if True:"),),
           KV_GROUP_TESTS, "a prefix hit is taken without the sliding blocks its window needs"),
    Mutant("kv_groups_interleave", "model/input_batch.py",
           (("tables = [np.ascontiguousarray(tables[:, g::groups]) for g in range(groups)]",
             "tables = [np.ascontiguousarray(tables[:, g * (tables.shape[1] // groups):"
             "(g + 1) * (tables.shape[1] // groups)]) for g in range(groups)]"),),
           KV_GROUP_TESTS, "the runner reads the groups' block tables as consecutive runs"),
    Mutant("top_p_drops_crossing_token", "model/sampling_kernels.py",
           (("f.cut(active, f.cum - f.w < threshold)", "f.cut(active, f.cum < threshold)"),),
           SAMPLER_TESTS, "top-p drops the token whose probability crosses the threshold"),
    Mutant("min_p_before_top_p", "model/sampling_kernels.py",
           (("_FILTERS = (_top_k, _top_p, _min_p)", "_FILTERS = (_top_k, _min_p, _top_p)"),),
           SAMPLER_TESTS, "min-p applied before top-p (the documented order is HF's)"),
    Mutant("penalty_sign", "model/sampling_kernels.py",
           (("logits[rows, ids] -= presence + frequency * count",
             "logits[rows, ids] += presence + frequency * count"),),
           SAMPLER_TESTS, "presence/frequency penalties raise seen tokens instead of lowering them"),
    Mutant("repetition_penalty_direction", "model/sampling_kernels.py",
           (("xp.where(vals > 0, vals / pen, vals * pen)",
             "xp.where(vals > 0, vals * pen, vals / pen)"),),
           SAMPLER_TESTS, "repetition penalty multiplies positive logits instead of dividing"),
    Mutant("gqa_head_mapping", "cpu/kernels.py",
           (("qbuf[qi * group + g, d] = q[t0 + qi, kvh * group + g, d] * scale",
             "qbuf[qi * group + g, d] = q[t0 + qi, kvh + g * group, d] * scale"),),
           KERNEL_TESTS, "query head h reads the wrong KV head (interleaved instead of grouped)"),
    Mutant("cuda_gqa_head_mapping", "cuda/decode_kernels.py",
           (("kvh = h // (q.shape[1] // kv_cache.shape[3])", "kvh = h % kv_cache.shape[3]"),),
           CUDA_TESTS, "CUDA decode attention: query head h reads KV head h mod nkv, not h // "
           "group"),
    Mutant("cuda_prefill_gqa_head_mapping", "cuda/prefill_kernels.py",
           (("kvh = h // (q.shape[1] // kv_cache.shape[3])", "kvh = h % kv_cache.shape[3]"),),
           CUDA_TESTS, "CUDA prefill attention: query head h reads KV head h mod nkv, not h // "
           "group"),
    Mutant("cuda_split_k_rescale", "cuda/decode_kernels.py",
           (("w = exp_sums[i, h, p] * math.exp(max_logits[i, h, p] - m_all)",
             "w = exp_sums[i, h, p]"),),
           CUDA_TESTS, "split-K reduction forgets to rescale each partition by exp(m_p - M)"),
    Mutant("cuda_w8a8_group_scale", "cuda/gemv_kernels.py",
           (("acc[t] += float32(iacc[t]) * x_scales[t, g]",
             "acc[t] += float32(iacc[t]) * x_scales[t, 0]"),
            ("total += float32(iacc) * x_scales[row, g]",
             "total += float32(iacc) * x_scales[row, 0]")),
           ("tests/cuda/test_cuda_w8a8.py",),
           "CUDA w8a8 GEMV and tiled kernels scale every group by the first group's scale"),
    Mutant("structured_bit_order", "constraints/masks.py",
           (('allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")',
             'allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="big")'),),
           ("tests/model/test_structured_masks.py",),
           "structured-output masks read each byte's bits in the wrong order"),
    Mutant("constraint_child_forked", "constraints/compiler.py",
           (('    popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,',
             '    return await asyncio.create_subprocess_exec(\n'
             '        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,\n'
             '        stderr=asyncio.subprocess.PIPE, limit=limit)\n'
             '    popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,'),),
           ("tests/model/test_structured_spawn.py",),
           "the constraint compiler's child is forked by uvloop (OpenBLAS's atfork handler "
           "deadlocks against a step's matrix product)"),
    Mutant("structured_replay", "constraints/masks.py",
           (("if output_token_ids and not matcher.consume_tokens(",
             "if False and not matcher.consume_tokens("),),
           ("tests/model/test_structured_masks.py",),
           "a preempted constrained request restarts its grammar from the beginning"),
    Mutant("tool_stream_partial_tag", "api/tool_calls.py",
           (("        if marker.startswith(text[-size:]):\n            return size",
             "        if marker.startswith(text[-size:]):\n            return 0"),),
           ("tests/api/test_api_tools.py",),
           "a streamed <tool_call> tag cut between deltas leaks into the content"),
    Mutant("router_prefix_gap", "core/router.py",
           (("            if block_hash not in held:\n                break",
             "            if block_hash not in held:\n                continue"),),
           ("tests/core/test_core_router.py",),
           "the router counts cached blocks after a gap as part of the prefix"),
    Mutant("int8_weight_rounding", "model/quantization.py",
           (("np.clip(np.rint(w / scales[:, None]), -INT8_MAX, INT8_MAX)",
             "np.clip(np.trunc(w / scales[:, None]), -INT8_MAX, INT8_MAX)"),),
           INT8_TESTS, "int8 weights truncated toward zero instead of rounded"),
    Mutant("int8_tile_channel_scale", "cpu/quant_kernels.py",
           (("s0, s1, s2, s3 = scales[n0], scales[n1], scales[n2], scales[n3]",
             "s0, s1, s2, s3 = scales[n0], scales[n2], scales[n1], scales[n3]"),),
           ("tests/cpu/test_quant_kernels.py",) + INT8_TESTS,
           "the int8 4x4 tile scales channels n+1 and n+2 by each other's scale"),
    Mutant("q4_nibble_order", "cpu/block_kernels.py",
           (("w[o + j] = np.float32(np.int32(q & _LOW)) * db + mb",
             "w[o + j] = np.float32(np.int32(q >> _SHIFT)) * db + mb"),
            ("w[o + half + j] = np.float32(np.int32(q >> _SHIFT)) * db + mb",
             "w[o + half + j] = np.float32(np.int32(q & _LOW)) * db + mb")),
           ("tests/cpu/test_block_ops.py",),
           "the q4 kernels read a block's high nibbles as its first 16 channels"),
    Mutant("q4_0_offset", "model/ggml_blocks.py",
           (("m = d * np.float32(-8.0)", "m = d * np.float32(-7.0)"),),
           ("tests/model/test_ggml_blocks.py",),
           "Q4_0 blocks are read with a code offset of 7 instead of 8"),
    Mutant("f32_gemv_channel", "cpu/kernels.py",
           (("        a3 += xk * w[n3, k]\n", "        a3 += xk * w[n2, k]\n"),),
           ("tests/cpu/test_kernels.py",),
           "the float32 GEMV tile computes its fourth channel from the third's weights"),
    Mutant("f32_gemv_second_row", "cpu/kernels.py",
           (("        b3 += xb * w3\n    _store4(", "        b3 += xa * w3\n    _store4("),),
           ("tests/cpu/test_kernels.py",),
           "the float32 GEMV 2 x 4 tile computes the second row's fourth channel from the first row"),
    Mutant("attention_serial_share", "cpu/kernels.py",
           (("_attend_share(0, 1, plan, q, kv_cache, block_tables, scale, out, window, kv_scales)",
             "_attend_share(0, 2, plan, q, kv_cache, block_tables, scale, out, window, kv_scales)"),),
           KERNEL_TESTS, "the serial attention driver runs only half of the work items"),
    Mutant("spec_accept_all_drafts", "model/spec_verify.py",
           (("    while accepted < len(drafts) and targets[accepted] == drafts[accepted]:",
             "    while accepted < len(drafts):"),),
           ("tests/model/test_spec_verify.py",),
           "speculative verification accepts every draft, right or wrong"),
    Mutant("spec_uniforms_per_row", "model/spec_verify.py",
           (("    generator.random(len(emitted))  # one uniform per emitted token",
             "    generator.random(rows)"),),
           ("tests/model/test_spec_verify.py",),
           "a speculative step draws a uniform per scored row, not per emitted token"),
    Mutant("spec_rejection_accepts_by_p", "model/spec_verify.py",
           (("        if generator.random() * draft_probs[i, x] < p[i, x]:",
             "        if generator.random() < p[i, x]:"),),
           ("tests/model/test_spec_verify.py",),
           "rejection sampling accepts a draft with probability p(x), ignoring q"),
    Mutant("spec_rejection_residual_is_p", "model/spec_verify.py",
           (("        residual = np.maximum(p[i] - draft_probs[i], 0.0)",
             "        residual = p[i].copy()"),),
           ("tests/model/test_spec_verify.py",),
           "a rejected draft is replaced by a draw from p, not from max(p - q, 0)"),
    Mutant("draft_catch_up_latest_only", "model/drafter.py",
           (("            start, end = self._computed.get(rid, 0), input_batch.num_tokens_of(rid)",
             "            end = input_batch.num_tokens_of(rid)\n"
             "            start = max(self._computed.get(rid, 0), end - 1)"),),
           ("tests/model/test_drafter.py",),
           "the draft model computes only each request's latest token (its cache has holes)"),
    Mutant("draft_lookahead_none", "core/scheduler.py",
           (("        return max(0, min(spec.num_speculative_tokens, limit - end))",
             "        return 0"),),
           ("tests/core/test_core_spec_decode.py", "tests/model/test_drafter.py"),
           "the scheduler never asks the draft model for drafts"),
    Mutant("stop_keeps_speculative_tail", "actors/detokenizer.py",
           (("            _drop_tokens_after(sample, text.stop_end, len(delta.new_token_ids))",
             "            pass"),),
           ("tests/actors/test_detokenizer_stop_in_a_speculative_step.py",),
           "tokens a speculative step accepted after a stop string are counted as output"),
    Mutant("spec_rollback_off_by_one", "core/scheduler.py",
           (("            request.num_computed_tokens -= num_draft - num_accepted",
             "            request.num_computed_tokens -= max(0, num_draft - num_accepted - 1)"),),
           ("tests/core/test_core_spec_decode.py",),
           "the K/V slot of one rejected draft counts as computed"),
    Mutant("tier_lookup_chain_gap", "kv_offload/host_tier.py",
           (("                slot = self._find(block_hash)\n                if slot < 0:\n"
             "                    break",
             "                slot = self._find(block_hash)\n                if slot < 0:\n"
             "                    continue"),),
           ("tests/engine/test_host_tier.py",),
           "the offload tier counts blocks after a missing one as part of the prefix"),
    Mutant("import_rows_in_load_order", "kv_offload/kv_connector.py",
           (("            rows = [imported.hashes[b.block_hash] for b in blocks]",
             "            rows = list(range(len(blocks)))"),),
           ("tests/engine/test_kv_connector.py",),
           "an import's blocks are loaded by position, not by hash"),
    Mutant("w8a8_group_scale", "cpu/int8.py",
           (("total += np.float32(acc) * x_scales[m, g]",
             "total += np.float32(acc) * x_scales[m, 0]"),),
           INT8_TESTS, "w8a8 decode kernel scales every group by the first group's scale"),
    Mutant("stall_clock_not_restarted", "core/stall.py",
           (("        if self._since is not None:\n            self._since = now",
             "        if self._since is not None:\n            pass"),),
           ("tests/core/test_core_stall.py",),
           "a finished step does not restart the stall clock (a busy engine reads as stalled)"),
    Mutant("stall_clock_kept_while_idle", "core/stall.py",
           (("        if not has_work:\n            self._since = None",
             "        if not has_work:\n            pass"),),
           ("tests/core/test_core_stall.py",),
           "an idle engine keeps its stall clock running (idle reads as stalled)"),
    Mutant("message_bound_off_by_one", "actors/tokenizer.py",
           (("    if num_messages * per > max_model_len:",
             "    if num_messages * per >= max_model_len:"),),
           ("tests/api/test_api_hostile_bodies.py",),
           "a chat of exactly as many minimal messages as the context holds is refused"),
    Mutant("cuda_word_sign_extension", "cuda/gemv_kernels.py",
           (("out[j] = int32((((word >> (8 * j)) & 0xFF) ^ 0x80) - 0x80)",
             "out[j] = int32((word >> (8 * j)) & 0xFF)"),),
           ("tests/cuda/test_cuda_gemv.py",),
           "CUDA GEMVs read each byte of a weight word unsigned (-1 becomes 255)"),
    Mutant("cuda_shuffle_tree_offset", "cuda/gemv_kernels.py",
           (("    delta = cuda.blockDim.x // 2\n", "    delta = cuda.blockDim.x // 4\n"),),
           ("tests/cuda/test_cuda_gemv.py",),
           "CUDA warp reduction (GPU's shuffle tree) starts at a quarter of the lanes"),
    Mutant("cuda_shared_lane_fold", "cuda/gemv_kernels.py",
           (("total += posts[i, tid + lane]", "total += posts[i, tid]"),),
           ("tests/cuda/test_cuda_gemv.py",),
           "CUDA lane reduction (simulator path) adds the first lane's sum once per lane"),
    Mutant("cuda_w8a8_word_activation_row", "cuda/gemv_kernels.py",
           (("_unpack_sbytes(xq_words[t, i], xb)", "_unpack_sbytes(xq_words[0, i], xb)"),),
           ("tests/cuda/test_cuda_gemv.py",),
           "CUDA W8A8 GEMV multiplies every row's weights with the first row's activations"),
    Mutant("cuda_q4_nibble_order", "cuda/gemv_kernels.py",
           (("w[j] = scale * float32(int32((word >> (8 * j)) & 0xF)) + low",
             "w[j] = scale * float32(int32((word >> (8 * j + 4)) & 0xF)) + low"),
            ("w[4 + j] = scale * float32(int32((word >> (8 * j + 4)) & 0xF)) + low",
             "w[4 + j] = scale * float32(int32((word >> (8 * j)) & 0xF)) + low")),
           ("tests/cuda/test_cuda_q4.py",),
           "CUDA Q4 blocks: low and high nibbles swapped (channel j read as j + 16)"),
    Mutant("cuda_q4_1_min", "cuda/gemv_kernels.py",
           (("w[j] = scale * float32(int32((word >> (8 * j)) & 0xF)) + low",
             "w[j] = scale * float32(int32((word >> (8 * j)) & 0xF))"),),
           ("tests/cuda/test_cuda_q4.py",),
           "CUDA Q4_1 / Q4_0 blocks: the low nibbles' weights lose the block minimum m"),
    Mutant("cuda_q8_block_scale", "cuda/gemv_kernels.py",
           (("scale = d[n, i // Q8_BLOCK_WORDS]", "scale = d[n, 0]"),),
           ("tests/cuda/test_cuda_q4.py",),
           "CUDA Q8_0 blocks: every block scaled by the row's first block scale"),
    Mutant("cuda_q4_row_gather", "cuda/gemv_kernels.py",
           (("            n = rows[r]\n", "            n = r\n"),),
           ("tests/cuda/test_cuda_q4.py",),
           "CUDA block embedding / panels dequantize row r instead of rows[r]"),
    Mutant("cuda_q4_panel_rows", "cuda/quantized_linear.py",
           (("rows = self.xp.arange(lo, min(lo + step, n_out), dtype=np.int64)",
             "rows = self.xp.arange(0, min(step, n_out - lo), dtype=np.int64)"),),
           ("tests/cuda/test_cuda_q4.py",),
           "CUDA many-row q4 product: every panel dequantizes the weight's first rows"),
    Mutant("fused_decode_gqa_map", "cuda/decode_kernels.py",
           (("            j = e - h * half\n"
             "            base = (g * group + h) * hd if h < group else (num_heads + g) * hd",
             "            j = e - h * half\n"
             "            base = (g + h) * hd if h < group else (num_heads + g) * hd"),),
           ("tests/cuda/test_cuda_step.py",),
           "the fused decode kernel reads KV head g's query rows from the wrong heads"),
    Mutant("fused_decode_rope_sign", "cuda/decode_kernels.py",
           (("            q_s[h * hd + j] = x1 * c - x2 * sn",
             "            q_s[h * hd + j] = x1 * c + x2 * sn"),),
           ("tests/cuda/test_cuda_step.py",),
           "the fused decode kernel rotates the queries the wrong way"),
    Mutant("fused_decode_split_in_place", "cuda/decode_kernels.py",
           (("    single = cuda.gridDim.z == 1", "    single = ctx <= partition_size"),),
           ("tests/cuda/test_cuda_step.py",),
           "a captured graph's short contexts are written in place, then overwritten by the "
           "split-K reduction"),
    Mutant("graph_padding_writes_kv", "cuda/graphs.py",
           (('"slot_mapping": pad(batch.slot_mapping, -1, i64),',
             '"slot_mapping": pad(batch.slot_mapping, 0, i64),'),),
           ("tests/cuda/test_cuda_step.py",),
           "a graph bucket's padding rows write their K/V over slot 0 of the cache"),
    Mutant("panel_nibble_half", "cpu/panel_kernels.py",
           (("(builder.lshr(both, four), 16 + 4 * g)]", "(builder.lshr(both, four), 12 + 4 * g)]"),),
           ("tests/cpu/test_panels.py",),
           "the panels multiply a block's high-nibble codes by the wrong activations"),
    Mutant("fused_panel_xsum", "cpu/decode_layer.py",
           (("panel_q8_range(xq8[0], xq8[1], xq8[2], w[4], w[2],",
             "panel_q8_range(xq8[0], xq8[1], xq8[1], w[4], w[2],"),),
           ("tests/cpu/test_decode_layer.py",),
           "the fused step's panels take the activation scales for their block sums"),
    Mutant("panel_q8_offset", "cpu/panel_kernels.py",
           (("code + 128 if q8 else code)", "code + 127 if q8 else code)"),),
           ("tests/cpu/test_panels.py",),
           "the Q8_0 panels store codes offset by 127 while m takes back 128"),
    Mutant("panel_avx2_drops_pairs", "cpu/panel_kernels.py",
           (("[pairs, ir.Constant(v16s, [1] * 16)]", "[pairs, ir.Constant(v16s, [1, 0] * 8)]"),),
           ("tests/cpu/test_panels.py",),
           "the AVX2 dot product of the panels keeps every other pair of products"),
    Mutant("panel_pack_order", "cpu/panel_kernels.py",
           (("code = np.int32(qs[n, width * b + 4 * g + t])", "code = np.int32(qs[n, width * b + 4 * t + g])"),),
           ("tests/cpu/test_panels.py",),
           "the packing interleaves a channel's bytes in the wrong order"),
    Mutant("kquant_q6k_offset", "cpu/kquant_kernels.py",
           (("off = builder.mul(self.bsum(r, s, j, 1), _i32(32))",
             "off = builder.mul(self.bsum(r, s, j, 1), _i32(31))"),),
           ("tests/cpu/test_kquant.py",),
           "Q6_K products take back 31, not 32, times each sub-block's activation sum"),
    Mutant("kquant_min_sign", "model/gguf_weights.py",
           (("dd[:, :, 1, :] = -dmin.reshape", "dd[:, :, 1, :] = dmin.reshape"),),
           ("tests/cpu/test_kquant.py",),
           "Q4_K / Q5_K panels add the mins term instead of subtracting it"),
    Mutant("kquant_q4k_nibble_subblock", "cpu/kquant_kernels.py",
           (("self.scale_sub(Q4_K, s, 2 * k, lo_sums, isum, msum)\n"
             "            self.scale_sub(Q4_K, s, 2 * k + 1, hi_sums, isum, msum)",
             "self.scale_sub(Q4_K, s, 2 * k + 1, lo_sums, isum, msum)\n"
             "            self.scale_sub(Q4_K, s, 2 * k, hi_sums, isum, msum)"),),
           ("tests/cpu/test_kquant.py",),
           "Q4_K's low and high nibbles take each other's sub-block scales"),
    Mutant("kquant_q5k_high_bit", "cpu/kquant_kernels.py",
           (("lo += ((high >> (2 * c)) & 1) << 4", "lo += ((high >> c) & 1) << 4"),),
           ("tests/cpu/test_kquant.py",),
           "Q5_K takes the fifth bit of its low-nibble codes from the wrong qh bit"),
    Mutant("q8_k_scale_sign", "cpu/kquant_kernels.py",
           (("iscale = np.float32(-127.0) / vmax", "iscale = np.float32(127.0) / vmax"),),
           ("tests/cpu/test_kquant.py",),
           "Q8_K maps the largest value to +127 instead of llama.cpp's -127"),
    Mutant("panel_min_term", "cpu/panel_kernels.py",
           (("builder.store(builder.call(fmuladd, [mvec, xs_b, acc]), accs[r])",
             "builder.store(acc, accs[r])"),),
           ("tests/cpu/test_panels.py",),
           "the panels drop Q4_1's m * xsum term (and Q4_0's offset)"),
    Mutant("block_dot_q8_rounding", "cpu/block_dot_kernels.py",
           (("q = min(max(np.rint(x[m, o + j] * inv), -_CODE_MAX), _CODE_MAX)",
             "q = min(max(np.floor(x[m, o + j] * inv + 0.5), -_CODE_MAX), _CODE_MAX)"),),
           BLOCK_DOT_TESTS, "Q8 activation codes round ties up instead of to even"),
    Mutant("block_dot_q4_nibble_order", "cpu/block_dot_kernels.py",
           (("codes = builder.shuffle_vector(low, high, concat)",
             "codes = builder.shuffle_vector(high, low, concat)"),),
           BLOCK_DOT_TESTS, "the AVX2 Q4 dot products read a block's high nibbles first"),
    Mutant("block_dot_q4_0_offset", "cpu/block_dot_kernels.py",
           (("codes = builder.sub(codes, _splat(_i8, 32, 8))",
             "codes = builder.sub(codes, _splat(_i8, 32, 7))"),),
           BLOCK_DOT_TESTS, "the AVX2 Q4_0 dot product subtracts 7 from the codes"),
    Mutant("block_dot_q4_1_min_row", "cpu/block_dot_kernels.py",
           (("builder.load(builder.gep(xsum_rows[r], [b])),",
             "builder.load(builder.gep(xsum_rows[0], [b])),"),),
           BLOCK_DOT_TESTS, "the Q4_1 row tile adds its first row's block sums to every row"),
    Mutant("block_dot_q8_0_sign", "cpu/block_dot_kernels.py",
           (("xv = builder.call(psign, [xv, signs])", "xv = builder.call(psign, [xv, codes])"),),
           BLOCK_DOT_TESTS, "Q8_0 / Q4_0 dot products take the sign of |c| (never negative)"),
    Mutant("block_dot_row_tile", "cpu/block_dot_kernels.py",
           (("ms = [builder.add(m, m.type(r)) for r in range(rows)]",
             "ms = [builder.add(m, m.type(min(r, 2))) for r in range(rows)]"),),
           BLOCK_DOT_TESTS, "the 4-row tile computes its third row twice, never the fourth"),
    Mutant("block_dot_pair_tile", "cpu/block_dot_kernels.py",
           (("pair = M - tiled >= 2", "pair = M - tiled > 2"),),
           BLOCK_DOT_TESTS, "a remainder of exactly 2 rows is never computed", count=3),
    Mutant("block_dot_parallel_chunks", "cpu/block_dot_kernels.py",
           (("a, b = _chunk(c, n_chunks, 0, qs.shape[0])",
             "a, b = _chunk(c, n_chunks, 0, qs.shape[0] - 1)"),),
           BLOCK_DOT_TESTS, "the parallel Q8-activation kernels leave the last channel unwritten",
           count=3),
    Mutant("block_dot_loop_nibble", "cpu/block_dot_kernels.py",
           (("s = _I32(s + _I32(_I32(_I32(q >> _SHIFT) - offset) * _I32(xq[m, o + half + j])))",
             "s = _I32(s + _I32(_I32(_I32(q & _LOW) - offset) * _I32(xq[m, o + half + j])))"),),
           BLOCK_DOT_TESTS, "the portable Q4 loop reads the low nibble for channel j + 16"),
    Mutant("block_dot_loop_q8_0", "cpu/block_dot_kernels.py",
           (("s = _I32(s + _I32(_I32(qs[n, o + j]) * _I32(xq[m, o + j])))",
             "s = _I32(s + _I32(_I32(qs[n, o + j]) * _I32(xq[m, o + j - 1])))"),),
           BLOCK_DOT_TESTS, "the portable Q8_0 loop pairs each weight with the previous code"),
    Mutant("block_dot_q4_0_dispatch", "cpu/block_dot_ops.py",
           (('elif w.ggml_type == "Q4_0":', 'elif w.ggml_type == "Q4_1":'),),
           BLOCK_DOT_TESTS, "Q4_1 weights take the Q4_0 kernel (offset 8, no m)"),
    Mutant("fused_rope_direction", "cpu/decode_layer.py",
           (("q[s, h, i] = q1 * c - q2 * sn", "q[s, h, i] = q1 * c + q2 * sn"),),
           FUSED_DECODE_TESTS, "the fused decode rotates queries the wrong way"),
    Mutant("fused_k_rope", "cpu/decode_layer.py",
           (("kv_cache[b, 0, o, kvh, half + i] = k2 * c + k1 * sn",
             "kv_cache[b, 0, o, kvh, half + i] = k2 * c - k1 * sn"),),
           FUSED_DECODE_TESTS, "the fused decode writes keys rotated the wrong way"),
    Mutant("fused_kv_slot", "cpu/decode_layer.py",
           (("o = slot - b * bs", "o = bs - 1 - (slot - b * bs)"),),
           FUSED_DECODE_TESTS, "the fused decode writes K/V at the mirrored offset of its block"),
    Mutant("fused_v_source", "cpu/decode_layer.py",
           (("kv_cache[b, 1, o, kvh, i] = qkv[s, voff + i]",
             "kv_cache[b, 1, o, kvh, i] = qkv[s, koff + i]"),),
           FUSED_DECODE_TESTS, "the fused decode stores the key as the value"),
    Mutant("fused_attention_scale", "cpu/decode_path.py",
           (("self.scale = np.float32(model.scale)", "self.scale = np.float32(model.scale * 1.1)"),),
           FUSED_DECODE_TESTS, "the fused decode's softmax scale is 10% too large"),
    Mutant("fused_attention_context", "cpu/decode_layer.py",
           (("seq_lens[s] - 1, kvh", "seq_lens[s] - 2, kvh"),),
           FUSED_DECODE_TESTS, "the fused decode's query does not see its own new token"),
    Mutant("fused_post_residual", "cpu/decode_layer.py",
           (("_add_rms_norm(x, residual, post_norm, eps, True, xn)",
             "_add_rms_norm(x, residual, post_norm, eps, False, xn)"),),
           FUSED_DECODE_TESTS, "the fused decode drops the attention output from the residual"),
    Mutant("fused_silu", "cpu/decode_layer.py",
           (("a / (np.float32(1.0) + exp_f32(-a))", "a / (np.float32(1.0) + exp_f32(a))"),),
           FUSED_DECODE_TESTS, "the fused decode's SiLU uses exp(a) for exp(-a)"),
    Mutant("fused_qkv_bias", "cpu/decode_layer.py",
           (("qkv[t, n] += qkv_bias[n]", "qkv[t, n] -= qkv_bias[n]"),),
           FUSED_DECODE_TESTS, "the fused decode subtracts the q/k/v bias"),
    Mutant("w4a8_float_activations", "cpu/decode_path.py",
           (("act_q8 = prep.act_q8 and (S <= Q8_MAX_ROWS or panels)",
             "act_q8 = False and (S <= Q8_MAX_ROWS or panels)"),),
           FUSED_DECODE_TESTS, "w4a8's fused decode keeps float activations"),
    Mutant("w4a8_q8_operand", "cpu/decode_layer.py",
           (("q4_1_q8_gemv_range(xq8[0], xq8[1], xq8[2], w[3], w[5], w[6], out, lo, hi)",
             "q4_1_q8_gemv_range(xq8[0], xq8[1], xq8[1], w[3], w[5], w[6], out, lo, hi)"),),
           FUSED_DECODE_TESTS, "w4a8's Q4 products take the block scales for the block sums"),
    Mutant("w4a8_op_path_float", "cpu/ops.py",
           (('if weight.activations == "q8" and not self.batch_invariant',
             'if weight.activations == "q9" and not self.batch_invariant'),),
           FUSED_DECODE_TESTS, "w4a8's op-path products keep float activations"),
    Mutant("batch_invariant_blas", "cpu/ops.py",
           (("(x.shape[0] <= DENSE_GEMV_MAX_ROWS or self.batch_invariant)",
             "(x.shape[0] <= DENSE_GEMV_MAX_ROWS)"),),
           BATCH_INVARIANCE_TESTS, "--batch-invariant products above 12 rows go to BLAS"),
    Mutant("batch_invariant_pair_tile", "cpu/ops.py",
           (("rows = self.batch_invariant", "rows = False"),),
           BATCH_INVARIANCE_TESTS, "--batch-invariant products take the 2-row tile"),
    Mutant("batch_invariant_prefill_attention", "cpu/ops.py",
           (("self.prefill_min_queries = 2**62 if batch_invariant else",
             "self.prefill_min_queries = PREFILL_MIN_QUERIES if batch_invariant else"),),
           BATCH_INVARIANCE_TESTS, "--batch-invariant long chunks take the BLAS prefill attention"),
    # Gemma 3 (issue 30): the GGUF converter and tokenizer, the model's pieces,
    # windowed attention on both backends.
    Mutant("gguf_gemma_norms_kept_shifted", "model/gguf_convert.py",
           (("            arr = arr - shift\n", "            arr = arr\n"),),
           ("tests/model/test_gguf_convert.py",),
           "gemma3 norms keep llama.cpp's 1 + w (the model would scale by 2 + w)"),
    Mutant("gguf_gemma_qk_permuted", "model/gguf_convert.py",
           (('    if meta["arch"] != "llama":\n        return None\n', ""),),
           ("tests/model/test_gguf_convert.py",),
           "gemma3 q/k rows un-permuted as if llama.cpp had permuted them"),
    Mutant("gguf_spm_merges_worst_first", "model/gguf_tokenizer.py",
           (("ranked.extend((-float(score), idx, left, right)",
             "ranked.extend((float(score), idx, left, right)"),),
           ("tests/model/test_gemma_tokenizer.py",),
           "SentencePiece merges ranked lowest score first"),
    Mutant("gguf_spm_no_byte_fallback", "model/gguf_tokenizer.py",
           (("unk_token=unk, fuse_unk=True, byte_fallback=True)",
             "unk_token=unk, fuse_unk=True, byte_fallback=False)"),),
           ("tests/model/test_gemma_tokenizer.py",),
           "characters outside the vocabulary become <unk> instead of their bytes"),
    Mutant("gguf_user_defined_normalized", "model/gguf_tokenizer.py",
           (("    plain = [AddedToken(t, special=False, normalized=False)",
             "    plain = [AddedToken(t, special=False, normalized=True)"),),
           ("tests/model/test_gemma_tokenizer.py",),
           "user-defined tokens (Gemma's runs of spaces) no longer match the raw text"),
    Mutant("gguf_spm_bytes_keep_underline", "model/tokenizer.py",
           (('return token.replace("\\u2581", " ").encode("utf-8")',
             'return token.encode("utf-8")'),),
           ("tests/model/test_gemma_tokenizer.py",),
           "incremental detokenization shows '▁' for spaces on SentencePiece models"),
    Mutant("gguf_q5_0_high_bit", "model/gguf_weights.py",
           (("    hi = (qs >> 4) | (((qh >> (bit + 16)) & 1).astype(np.int16) << 4)",
             "    hi = (qs >> 4) | (((qh >> (bit + 15)) & 1).astype(np.int16) << 4)"),),
           ("tests/model/test_gguf_convert.py", "tests/cpu/test_kquant.py"),
           "Q5_0 blocks take the fifth bit of their high codes from the wrong qh bit"),
    Mutant("gguf_fused_parts_unordered", "model/gguf_weights.py",
           (("    return [sorted(group, key=lambda item: rank.get(item[0], 0)) "
             "for group in groups.values()]",
             "    return list(groups.values())"),),
           ("tests/model/test_gguf_weights.py",),
           "a layer's q/k/v panels are written in the file's (sorted) order, not q, k, v"),
    Mutant("verify_last_tile_dropped", "cpu/decode_layer.py",
           (("n_tiles = tiles.shape[0] - 1 if rows_share else 0",
             "n_tiles = tiles.shape[0] - 2 if rows_share else 0"),),
           ("tests/cpu/test_decode_layer.py",),
           "a fused verification step's last sequence never attends"),
    Mutant("verify_tile_from_last_row", "cpu/decode_layer.py",
           (("    _attend_tile(q, kv_cache, block_tables[t0], scale, t0, t1 - t0, positions[t0], kvh,",
             "    _attend_tile(q, kv_cache, block_tables[t0], scale, t0, t1 - t0, positions[t1 - 1], kvh,"),),
           ("tests/cpu/test_decode_layer.py",),
           "a verification tile's causal mask starts at its last row's position, not its first"),
    Mutant("exp_polynomial_term_dropped", "cpu/vector_math.py",
           (("    p = p * r + np.float32(4.1665795894e-2)\n", ""),),
           ("tests/cpu/test_vector_math.py", "tests/cpu/test_kernels.py"),
           "exp_f32 loses its r**4 term (an error of 1e-4 near ln2 / 2)"),
    Mutant("attention_values_fourth_key_repeats", "cpu/kernels.py",
           (("                          + p3 * np.float32(vc[j + 3, kvh, d]))",
             "                          + p3 * np.float32(vc[j + 2, kvh, d]))"),),
           ("tests/cpu/test_kernels.py",),
           "the attention's four-key value pass weighs the third key's value twice"),
    Mutant("attention_scores_fourth_key_repeats", "cpu/kernels.py",
           (("            s3 += qd * np.float32(kc[j + 3, kvh, d])",
             "            s3 += qd * np.float32(kc[j + 2, kvh, d])"),),
           ("tests/cpu/test_kernels.py",),
           "the attention's four-key score pass scores the third key twice"),
    Mutant("gemv_4x4_last_row_repeats", "cpu/kernels.py",
           (("        xe = x[m + 3, k]", "        xe = x[m + 2, k]"),),
           ("tests/cpu/test_kernels.py",),
           "the float32 product's 4-row tile computes its third row twice"),
    Mutant("fused_window_literal", "cpu/decode_layer.py",
           (("    _attend_tile(q, kv_cache, block_tables[s], scale, s, 1, seq_lens[s] - 1, kvh, nh // nkv, att,\n"
             "                 window, kv_scales)",
             "    _attend_tile(q, kv_cache, block_tables[s], scale, s, 1, seq_lens[s] - 1, kvh, nh // nkv, att,\n"
             "                 0, kv_scales)"),),
           ("tests/cpu/test_decode_layer.py",),
           "the fused decode step attends with a literal window 0, and LLVM's specialized tile "
           "rounds unlike the op path's"),
    Mutant("kernel_cache_stamp_own_file_only", "cpu/__init__.py",
           (("            todo.extend(_imported_modules(folder / f\"{name}.py\", folder))\n", ""),),
           ("tests/cpu/test_kernel_cache.py",),
           "a kernel's cache stamp ignores the modules it inlines (stale fused attention)"),
    Mutant("rope_theta_top_level_only", "model/rope.py",
           (('theta = float(params.get("rope_theta", theta) or default_theta)',
             'theta = float(theta or default_theta)'),),
           ("tests/model/test_rope.py", "tests/model/test_families.py"),
           "transformers 5's rope_parameters.rope_theta is ignored (a Qwen2 served with base 10,000)"),
    Mutant("rope_llama3_smoothing_swapped", "model/rope.py",
           (("smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled",
             "smoothed = smooth * scaled / spec.factor + (1 - smooth) * scaled"),),
           ("tests/model/test_rope.py", "tests/model/test_families.py"),
           "llama3 RoPE blends its medium frequencies the wrong way round"),
    Mutant("rope_attention_factor_dropped", "model/rope.py",
           (("    if spec.attention_factor != 1.0:  # the rotary pairs only",
             "    if False:  # the rotary pairs only"),),
           ("tests/model/test_rope.py", "tests/model/test_families.py"),
           "yarn / longrope tables leave out cos and sin's attention factor"),
    Mutant("phi3_gate_up_swapped", "model/loader.py",
           (('out.update({f"{stem}gate_proj.weight": arr[:inter],\n'
             '                        f"{stem}up_proj.weight": arr[inter:]})',
             'out.update({f"{stem}gate_proj.weight": arr[inter:],\n'
             '                        f"{stem}up_proj.weight": arr[:inter]})'),),
           ("tests/model/test_families.py",),
           "Phi-3's gate_up_proj split with up first"),
    Mutant("gguf_rope_freqs_dropped", "model/gguf_convert.py",
           (('        out["rope_freq_factors"] = meta["rope_freqs"]',
             '        pass'),),
           ("tests/model/test_families.py",),
           "a Llama 3 GGUF's rope_freqs tensor is not carried into the config"),
    Mutant("reasoning_split_tag_not_held", "api/reasoning.py",
           (("keep = _partial_suffix(text, END)", "keep = 0"),),
           ("tests/api/test_reasoning.py",),
           "a </think> split across stream pieces leaks into the streamed thought"),
    Mutant("tool_llama3_bare_json_missed", "api/tool_calls.py",
           (('"llama3_json": ToolFormat("llama3_json", "<|python_tag|>", None, "parameters",\n'
             '                              bare_json=True),',
             '"llama3_json": ToolFormat("llama3_json", "<|python_tag|>", None, "parameters",\n'
             '                              bare_json=False),'),),
           ("tests/api/test_tool_formats.py",),
           "a Llama 3 answer that is a bare JSON call is not parsed as a call"),
    Mutant("gguf_split_rows_from_the_end", "model/gguf_weights.py",
           (("out.append((part, shapes[part], np.arange(start, start + n)))",
             "out.append((part, shapes[part], np.arange(shape[0] - start - n, shape[0] - start)))"),),
           ("tests/model/test_families.py",),
           "Phi-3's fused GGUF tensors split into parts taken from the wrong end"),
    Mutant("graph_replay_off_current_stream", "cuda/graphs.py",
           (("self.graph.launch(stream=self.cupy.cuda.get_current_stream())",
             "self.graph.launch()"),),
           ("tests/cuda/test_cuda_streams.py",),
           "a CUDA graph replays on another stream than the step's copy and sampler"),
    Mutant("numpy_row_stack_not_restored", "cuda/__init__.py",
           (("    np.row_stack = np.vstack\n", "    pass\n"),),
           ("tests/cuda/test_cuda_streams.py",),
           "NumPy 2.5 left without row_stack, which numba-cuda compiles through"),
    Mutant("launch_signature_unrecorded", "cuda/ops.py",
           (("                     x, weight, np.float32(eps), out)",
             "                     x, weight, eps, out)"),),
           ("tests/cuda/test_cuda_step.py",),
           "a kernel launched with argument types that no PTX compile has checked (a float64 eps)"),
    Mutant("sandwich_norm_weight_dropped", "cuda/row_kernels.py",
           (("        x[t, i] = float32(x[t, i]) * inv * float32(x_weight[i])\n",
             "        x[t, i] = float32(x[t, i]) * inv\n"),),
           ("tests/cuda/test_cuda_step.py::test_the_sandwich_norm_add_and_next_norm_are_one_launch",),
           "Gemma 3's post-block norm in the fused add + norm kernel forgets its weight"),
    Mutant("fused_decode_skips_qk_norm", "cuda/decode_kernels.py",
           (("        normed = q_norm.shape[0] == hd\n", "        normed = False\n"),),
           ("tests/cuda/test_cuda_step.py",),
           "the fused decode kernel rotates Qwen3's / Gemma 3's q and k without their norms"),
    Mutant("decode_path_ignores_the_off_switch", "cpu/decode_path.py",
           (('    if mode == "0":\n        return DecodePath("ops", f"{ENV}=0")',
             '    if False:\n        return DecodePath("ops", f"{ENV}=0")'),),
           ("tests/cpu/test_decode_path_choice.py",),
           "KVSERVE_CPU_FUSED_DECODE=0 leaves the model on the fused decode step"),
    Mutant("block_scheme_quantizing_nothing_unsaid", "startup.py",
           (("    if scheme in BLOCK_SCHEMES and saved <= 0:", "    if False:"),),
           ("tests/test_plan.py::test_a_block_scheme_that_quantized_nothing_says_so",),
           "-q w4a8 on a float checkpoint quantizes nothing and says only 0.0 MiB saved"),
    Mutant("gguf_header_string_count_unchecked", "model/gguf_convert.py",
           (("                if count * 8 > size - pos:", "                if False:"),),
           ("tests/model/test_gguf_hostile.py",),
           "a GGUF's string array of 2^62 items is walked item by item"),
    Mutant("chat_content_always_placeholders", "model/tokenizer.py",
           (('        if not any(isinstance(m.get("content"), str) and self._holds_special(m["content"])',
             '        if False and not any(isinstance(m.get("content"), str) and '
             'self._holds_special(m["content"])'),),
           ("tests/api/test_chat_template.py",),
           "a template that transforms content acts on a placeholder, not the message"),
    Mutant("chat_template_recursion_uncaught", "model/tokenizer.py",
           (("        except RecursionError:\n", "        except ZeroDivisionError:\n"),),
           ("tests/api/test_chat_template.py",),
           "a recursive chat-template macro ends in a RecursionError traceback"),
    Mutant("chat_template_check_skipped", "startup.py",
           (("    tokenizer.check_chat_template()  # before serving, off the event loop\n", ""),),
           ("tests/api/test_chat_template.py::test_start_up_refuses_a_looping_template_before_serving",),
           "start-up serves a chat template that loops, wedging the event loop"),
    Mutant("min_tokens_bans_a_finished_grammar", "model/sampler.py",
           (("            if p.structured_outputs is None or _others_allowed(logits, r, stops, xp):",
             "            if True:"),),
           ("tests/model/test_sampler.py",),
           "min_tokens bans EOS after a grammar finished: no token left, the sampler takes id 0"),
    Mutant("constraint_detail_logged", "core/structured_outputs.py",
           (("        if at >= 0:\n            return message[:at + len(mark)] + DETAIL_NOT_LOGGED",
             "        if False:\n            return message[:at + len(mark)] + DETAIL_NOT_LOGGED"),),
           ("tests/api/test_api_refusal_log.py",),
           "a refused constraint's text reaches the log without --log-prompts"),
    Mutant("tool_defs_pointers_not_moved", "api/tool_calls.py",
           (('            return f"#/$defs/{prefix}{ref[len(base):]}"',
             '            return ref'),),
           ("tests/api/test_api_tools.py",),
           "a forced tool call's nested-model pointers still point at definitions that moved"),
    Mutant("prefill_not_left_open", "model/tokenizer.py",
           (("                prompt = prompt[:end + len(final)]\n", "                pass\n"),),
           ("tests/api/test_chat_template.py",),
           "continue_final_message renders the assistant turn closed: nothing to continue"),
    Mutant("unsupported_field_ignored", "api/serving.py",
           (('        return name, f"{name}: {why}"', '        continue'),),
           ("tests/api/test_chat_template.py",),
           "a vLLM field kvserve does not implement is silently ignored (a 200)"),
    Mutant("responses_instructions_dropped", "api/responses.py",
           (('        messages.insert(0, {"role": "system", "content": str(data["instructions"])})',
             '        pass'),),
           ("tests/api/test_api_responses.py",),
           "a Responses request's instructions never reach the model"),
    Mutant("metric_names_alias_missing", "observability/metrics.py",
           (('VLLM_ALIASES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}',
             'VLLM_ALIASES = {}'),),
           ("tests/observability/test_obs_metric_names.py",),
           "vLLM's dashboard finds no vllm:gpu_cache_usage_perc"),
    Mutant("analyze_reads_nothing_silently", "observability/analysis.py",
           (("    if data.num_events == 0:\n", "    if False:\n"),),
           ("tests/observability/test_obs_analyzer.py",),
           "kvserve analyze reports 0 requests on a log it could not read"),
    Mutant("partial_rotary_pairs_misplaced", "model/rope.py",
           (("    order = np.concatenate([np.arange(rhalf), first, np.arange(rhalf, rotary_dim), second])",
             "    order = np.concatenate([np.arange(rotary_dim), first, second])"),),
           ("tests/model/test_families.py",),
           "a partial rotary's pairs (j, j + rotary_dim / 2) not where the kernels rotate"),
    Mutant("every_sample_scores_the_prompt", "actors/tokenizer.py",
           (("            prompt_logprobs = params.prompt_logprobs if index == 0 else None",
             "            prompt_logprobs = params.prompt_logprobs"),),
           ("tests/api/test_api_extras.py",),
           "n samples with echo and logprobs each score the whole prompt again"),
    Mutant("metrics_fail_with_a_replica_down", "distributed/client.py",
           (("        texts = await asyncio.gather(*(one(r) for r in self.replicas), "
             "return_exceptions=True)",
             "        texts = await asyncio.gather(*(one(r) for r in self.replicas))"),),
           ("tests/observability/test_obs_replica_metrics.py",),
           "/metrics is a 500 while one data-parallel replica is down"),
    Mutant("ray_init_takes_the_signal_handlers", "distributed/ray_start.py",
           (("        with kept_signal_handlers():", "        with contextlib.nullcontext():"),),
           ("tests/test_ray_start.py",),
           "ray.init's handlers replace the server's drain: SIGTERM kills a Ray server"),
    Mutant("slow_template_renders_on_the_loop", "actors/tokenizer.py",
           (("                    self._admit(message, self._tokenize(message, INLINE_RENDER_BUDGET_S))",
             "                    self._admit(message, self._tokenize(message))"),),
           ("tests/actors/test_actors_slow_template.py",),
           "a slow chat template renders on the event loop (/health waits behind it)"),
    Mutant("gguf_cache_key_ignores_mtime", "model/gguf_model.py",
           (('f"{CONVERTER_VERSION}:{stat.st_size}:{stat.st_mtime_ns}:".encode())',
             'f"{CONVERTER_VERSION}:{stat.st_size}:".encode())'),),
           ("tests/model/test_gguf_convert.py",),
           "a GGUF changed in place (same size and header) is not converted again"),
    Mutant("gguf_named_sha256_unchecked", "model/gguf_model.py",
           (("    if digest.hexdigest() != expected:\n", "    if False:\n"),),
           ("tests/model/test_gguf_convert.py",),
           "an assembled GGUF with a wrong sha256 is converted and served"),
    Mutant("chat_template_missing_not_400", "api/serving.py",
           (("        check_chat_template(engine)\n", ""),),
           ("tests/api/test_chat_template.py",),
           "a chat request to a model without a template reaches the engine"),
    Mutant("gelu_tanh_no_cubic", "cpu/kernels.py",
           (("    kappa = np.float32(0.044715)", "    kappa = np.float32(0.0)"),),
           CONFORMANCE_TESTS + GEMMA_FORWARD_TESTS,
           "gelu_tanh_and_mul drops the 0.044715 a^3 term (not PyTorch's tanh GELU)"),
    Mutant("attention_window_one_too_wide", "cpu/kernels.py",
           (("j0 = pos0 + r // group - window + 1 - kstart", "j0 = pos0 + r // group - window - kstart"),),
           CONFORMANCE_TESTS + GEMMA_FORWARD_TESTS,
           "the Numba attention kernel lets a query see window + 1 keys"),
    Mutant("attention_window_ignored", "cpu/kernels.py",
           (("            if window > 0:\n                j0 =", "            if window < 0:\n                j0 ="),),
           CONFORMANCE_TESTS + GEMMA_FORWARD_TESTS,
           "the Numba attention kernel's rows see every key from the tile's first window on"),
    Mutant("prefill_window_mask_one_too_wide", "cpu/prefill_attention.py",
           (("(dist >= 0) & (dist < window)", "(dist >= 0) & (dist <= window)"),),
           CONFORMANCE_TESTS + GEMMA_FORWARD_TESTS,
           "the BLAS prefill path lets a query see window + 1 keys"),
    Mutant("prefill_window_read_then_mask", "cpu/prefill_attention.py",
           (("first_block = max(0, first - window + 1) // block_size", "first_block = 0"),
            ("lo = max(0, first + a - window + 1)  # the tile's first visible key", "lo = 0"),),
           CONFORMANCE_TESTS + GEMMA_FORWARD_TESTS,
           "the BLAS prefill path multiplies the (freed, NaN) blocks before the window, then masks"),
    Mutant("gemma_embedding_unscaled", "model/llama.py",
           (("hidden = hidden * hidden.dtype.type(cfg.embedding_multiplier)",
             "hidden = hidden * hidden.dtype.type(1.0)"),),
           GEMMA_FORWARD_TESTS, "Gemma's embedding rows not multiplied by sqrt(hidden)"),
    Mutant("gemma_norm_offset_dropped", "model/llama.py",
           (("weight = np.asarray(weight, np.float32) + np.float32(self.config.norm_offset)",
             "weight = np.asarray(weight, np.float32) + np.float32(0.0)"),),
           GEMMA_FORWARD_TESTS, "Gemma's norms multiply by w instead of 1 + w"),
    Mutant("gemma_qk_norm_skipped", "model/llama.py",
           (("        if layer.q_norm is not None:\n", "        if False:\n"),),
           GEMMA_FORWARD_TESTS, "no RMSNorm of the query and key heads before RoPE"),
    Mutant("gemma_attn_out_norm_skipped", "model/llama.py",
           (("x_weight=layer.attn_out_norm)", "x_weight=None)"),),
           GEMMA_FORWARD_TESTS, "the attention output is added to the residual unnormed"),
    Mutant("gemma_mlp_out_norm_skipped", "model/llama.py",
           (("x_weight=self.layers[i - 1].mlp_out_norm)", "x_weight=None)"),),
           GEMMA_FORWARD_TESTS, "the MLP output is added to the residual unnormed"),
    Mutant("gemma_pre_ffn_norm_swapped", "model/llama.py",
           (('norms = {"post_norm": norm(w[f"{p}pre_feedforward_layernorm.weight"]),',
             'norms = {"post_norm": norm(w[f"{p}post_feedforward_layernorm.weight"]),'),),
           GEMMA_FORWARD_TESTS, "the MLP input normed by post_feedforward_layernorm's weights"),
    Mutant("gemma_local_rope_base_ignored", "model/llama.py",
           (("return [LayerRecipe(local if w else self.rope_cache, w) for w in windows]",
             "return [LayerRecipe(self.rope_cache, w) for w in windows]"),),
           GEMMA_FORWARD_TESTS, "sliding layers rotate with rope_theta instead of rope_local_base_freq"),
    Mutant("gemma_window_not_passed", "model/llama.py",
           (('extra = {"window": recipe.window} if recipe.window else {}', "extra = {}"),),
           GEMMA_FORWARD_TESTS, "sliding layers attend to the whole context"),
    Mutant("gemma_activation_silu", "model/llama.py",
           (('"gelu_pytorch_tanh": ops.gelu_tanh_and_mul}', '"gelu_pytorch_tanh": ops.silu_and_mul}'),),
           GEMMA_FORWARD_TESTS, "Gemma's MLP gated by SiLU instead of tanh-GELU"),
    Mutant("gemma_attention_scale_head_dim", "config.py",
           (("return float(self.query_pre_attn_scalar) ** -0.5", "return self.head_dim ** -0.5"),),
           GEMMA_FORWARD_TESTS, "attention scale head_dim^-0.5 instead of query_pre_attn_scalar^-0.5"),
    Mutant("fused_decode_accepts_gemma", "cpu/decode_path.py",
           (("        if not fused_architecture(cfg):\n            return", "        if False:\n            return"),),
           GEMMA_FORWARD_TESTS, "Gemma decode steps run the Llama-only fused kernel"),
    Mutant("gemma_pattern_off_by_one", "model/loader.py",
           (('"full_attention" if (i + 1) % pattern == 0', '"full_attention" if i % pattern == 0'),),
           GEMMA_FORWARD_TESTS, "sliding_window_pattern 6 makes layers 0, 6, 12 full instead of 5, 11, 17"),
    Mutant("cuda_gelu_no_cubic", "cuda/row_kernels.py",
           (("inner = _GELU_SQRT_2_OVER_PI * (a + _GELU_CUBIC * a * a * a)",
             "inner = _GELU_SQRT_2_OVER_PI * a"),),
           ("tests/cuda/test_cuda_window.py",),
           "gelu_tanh_and_mul drops the 0.044715 a^3 term (not PyTorch's tanh GELU)"),
    Mutant("cuda_prefill_window_read_then_mask", "cuda/prefill_kernels.py",
           (("for k0 in range(_window_start(pos0 + 1, window), n_ctx, PREFILL_KV_TILE):",
             "for k0 in range(0, n_ctx, PREFILL_KV_TILE):"),),
           ("tests/cuda/test_cuda_window.py",),
           "the prefill kernel loads keys (freed blocks, NaN) before the tile's window"),
    Mutant("cuda_prefill_window_unmasked", "cuda/prefill_kernels.py",
           (("first = _max(0, _window_start(pos + 1, window) - k0)  # the row's window",
             "first = 0"),),
           ("tests/cuda/test_cuda_window.py",),
           "a prefill row attends to the loaded keys before its own window"),
    Mutant("cuda_decode_window_ignored", "cuda/decode_kernels.py",
           (("start = _window_start(ctx, window) + p * partition_size",
             "start = p * partition_size"),),
           ("tests/cuda/test_cuda_window.py",),
           "split-K decode partitions count from 0 instead of the window's start"),
    Mutant("cuda_reduce_window_ignored", "cuda/decode_kernels.py",
           (("n_parts = (ctx - _window_start(ctx, window) + partition_size - 1) // partition_size",
             "n_parts = (ctx + partition_size - 1) // partition_size"),),
           ("tests/cuda/test_cuda_window.py",),
           "the split-K reduction folds partitions past the window's (garbage exp sums)"),
    Mutant("cuda_fused_window_ignored", "cuda/decode_kernels.py",
           (("        lo = _window_start(ctx, window)\n        start = lo + p * partition_size",
             "        lo = 0\n        start = lo + p * partition_size"),),
           ("tests/cuda/test_cuda_window.py",),
           "the fused decode kernel reads the whole context (freed blocks) in a sliding layer"),
    Mutant("cuda_window_metadata_checks_all", "cuda/step.py",
           (("    if window > 0:  # the first new token, at sl - n_new, sees keys from sl - n_new + 1 - window",
             "    if False:"),),
           ("tests/cuda/test_cuda_window.py",),
           "block ids before the window (freed) are checked and refused"),
    Mutant("cuda_graphs_drop_groups", "cuda/graphs.py",
           (("        attn = groups[0] if len(groups) == 1 else groups",
             "        attn = [groups[0]] * len(groups) if len(groups) > 1 else groups[0]"),),
           ("tests/cuda/test_cuda_window.py",),
           "a replayed decode step gives every KV-cache group group 0's tables"),
)

# Issue 31: the int8 KV cache on CUDA, the disk tier, and the format's arithmetic.
# Mutant specs of helper "kv-cuda" (issue 31, part B: the int8 KV cache on CUDA).
# Same fields as tools/mutation_check.py's Mutant; each checked by hand
# (applied, tests/cuda/test_cuda_kv_int8.py failed, reverted).
KV_INT8_CUDA_TESTS = ("tests/cuda/test_cuda_kv_int8.py",)

MUTANTS_KV_CUDA = (
    Mutant("cuda_kv_int8_write_scale", "cuda/decode_kernels.py",
           (("kv_scales[b, 0, o, h, hd // 4] = k_max / float32(INT8_MAX)",
             "kv_scales[b, 0, o, h, hd // 4] = k_max / float32(128)"),),
           KV_INT8_CUDA_TESTS, "write_kv stores K scales max|x|/128 (codes made for /127)"),
    Mutant("cuda_kv_int8_fused_write_scale", "cuda/decode_kernels.py",
           (("kv_scales[b, 1, o, h, hd // 4] = v_max / float32(INT8_MAX)",
             "kv_scales[b, 1, o, h, hd // 4] = v_max / float32(128)"),),
           KV_INT8_CUDA_TESTS,
           "the fused decode kernel (and write_kv, one helper) stores V scales max|x|/128"),
    Mutant("cuda_kv_int8_code_rounding", "cuda/decode_kernels.py",
           (("c = round(x * inv)", "c = math.floor(x * inv + float32(0.5))"),),
           KV_INT8_CUDA_TESTS, "int8 KV codes rounded half up, not half to even"),
    Mutant("cuda_kv_int8_decode_key_scale", "cuda/decode_kernels.py",
           (("logit = dot * kv_scales[blk, 0, off, kvh, sc] * scale",
             "logit = dot * scale"),),
           KV_INT8_CUDA_TESTS, "split-K decode logits of int8 keys miss the key scale"),
    Mutant("cuda_kv_int8_decode_value_scale", "cuda/decode_kernels.py",
           (("logits[j] = e * kv_scales[blk, 1, pos % block_size, kvh, sc]",
             "logits[j] = e"),),
           KV_INT8_CUDA_TESTS, "split-K decode weights int8 V codes without the value scale"),
    Mutant("cuda_kv_int8_prefill_key_scale", "cuda/prefill_kernels.py",
           (("dot = dot * k_sc[j]", "dot = dot * k_sc[0]"),),
           KV_INT8_CUDA_TESTS, "prefill tiles scale every key's dot by the tile's first key scale"),
    Mutant("cuda_kv_int8_prefill_value_scale", "cuda/prefill_kernels.py",
           (("scores[j] = e_j * v_sc[j]", "scores[j] = e_j"),),
           KV_INT8_CUDA_TESTS, "prefill tiles weight int8 V codes without the value scale"),
    Mutant("cuda_kv_int8_fused_key_scale", "cuda/decode_kernels.py",
           (("logit = acc[h] * s_k * scale", "logit = acc[h] * scale"),),
           KV_INT8_CUDA_TESTS, "the fused decode kernel's logits miss the key scale"),
    Mutant("cuda_kv_int8_fused_value_scale", "cuda/decode_kernels.py",
           (("logits[h * MAX_PARTITION_SIZE + j] = e * s_v",
             "logits[h * MAX_PARTITION_SIZE + j] = e"),),
           KV_INT8_CUDA_TESTS, "the fused decode kernel weights V codes without the value scale"),
    Mutant("cuda_kv_int8_scale_index", "cuda/decode_kernels.py",
           (("sc = hd // 4  # the scale's index in the float32 view",
             "sc = hd // 4 - 1  # the scale's index in the float32 view"),),
           KV_INT8_CUDA_TESTS, "split-K decode reads the last 4 codes as the scale"),
    Mutant("cuda_kv_int8_ops_float_kernel", "cuda/attention_ops.py",
           (("return kv_cache.dtype == np.int8", "return False"),),
           KV_INT8_CUDA_TESTS, "an int8 cache is handed to the float kernels (codes read as values)"),
)

# Mutant specs of helper "kv-disk" (issue 31, part C: the disk KV tier), fields as
# tools/mutation_check.py's Mutant(name, file, edits, tests, breaks[, count]).
DISK_UNIT = ("tests/engine/test_disk_tier.py",)
DISK_ENGINE = ("tests/engine/test_engine_kv_disk.py",)

MUTANTS_KV_DISK = (
    Mutant("disk_lru_evicts_newest", "kv_offload/disk_tier.py",
           (("                for block_hash in self._index:\n"
             "                    if block_hash in self._foreign or",
             "                for block_hash in reversed(self._index):\n"
             "                    if block_hash in self._foreign or"),),
           DISK_UNIT, "the disk tier's bound removes the most recently used file, not the least"),
    Mutant("disk_read_is_no_use", "kv_offload/disk_tier.py",
           (("            if block_hash in self._index:\n"
             "                self._index.move_to_end(block_hash)\n"
             "            _add(self.counters.reads",
             "            _add(self.counters.reads"),),
           DISK_UNIT, "a disk read does not count as a use for the LRU order"),
    Mutant("disk_lease_ignored", "kv_offload/disk_tier.py",
           (("                    if block_hash in self._foreign or self._leases.get(block_hash, 0.0) >= now:",
             "                    if block_hash in self._foreign:"),),
           DISK_UNIT, "the bound removes a block a look-up leased for the next step's load"),
    Mutant("disk_evicts_a_live_tiers_files", "kv_offload/disk_tier.py",
           (("                    if block_hash in self._foreign or self._leases.get(block_hash, 0.0) >= now:",
             "                    if self._leases.get(block_hash, 0.0) >= now:"),
            ("            excess = len(self._index) - len(self._foreign) - self.max_blocks",
             "            excess = len(self._index) - self.max_blocks")),
           DISK_UNIT, "a tier with a smaller bound deletes another live server's block files "
           "(issue 47 item 10)"),
    Mutant("disk_owner_lock_ignored", "kv_offload/disk_tier.py",
           (("        return True  # held: its owner lives",
             "        return False"),),
           DISK_UNIT, "every other tier's files are taken for a dead owner's and evicted"),
    Mutant("kv_cache_lost_fails_the_requests", "actors/scheduler.py",
           (("        if result.error is not None and (result.kv_load_lost or result.kv_lost):",
             "        if result.error is not None and result.kv_load_lost:"),),
           ("tests/actors/test_scheduler_kv_load_lost.py",),
           "a pipeline stage's restart ends every running request with a 500 instead of "
           "restarting them (issue 47 item 8)"),
    Mutant("kv_restarts_unbounded", "actors/scheduler.py",
           (("                 and r.num_kv_restarts >= MAX_KV_RESTARTS]",
             "                 and False]"),),
           ("tests/actors/test_scheduler_kv_load_lost.py",),
           "a request whose K/V is lost at every try (a stage that dies at every step) "
           "restarts forever"),
    Mutant("health_unavailable_answers_200", "api/app.py",
           (('status_code=503 if body.get("status") == "unavailable"',
             'status_code=200 if body.get("status") == "unavailable"'),),
           ("tests/api/test_api_errors.py",),
           "/health answers 200 while a pipeline stage (or every replica) is down"),
    Mutant("kv_load_lost_fails_the_request", "actors/scheduler.py",
           (("        if result.error is not None and (result.kv_load_lost or result.kv_lost):",
             "        if result.error is not None and result.kv_lost:"),),
           ("tests/actors/test_scheduler_kv_load_lost.py",) + DISK_ENGINE,
           "a block lost from the offload tier between look-up and load is a 500 "
           "instead of a recompute"),
    Mutant("disk_checksum_unchecked", "kv_offload/disk_tier.py",
           (("            if zlib.crc32(view[HEADER_BYTES:]) != crc:",
             "            if False:"),),
           DISK_UNIT, "a disk block whose payload was corrupted is served"),
    Mutant("disk_layout_key_ignores_dtype", "kv_offload/disk_tier.py",
           (('"dtype": np.dtype(dtype).str,\n                       "block_shape"',
             '"dtype": "any",\n                       "block_shape"'),),
           DISK_UNIT, "blocks of another cache dtype (same shape) share a folder"),
    Mutant("disk_scan_keeps_other_layout", "kv_offload/disk_tier.py",
           (('        if key != self.key:\n            return "other_layout"',
             '        if False:\n            return "other_layout"'),),
           DISK_UNIT, "a file of another layout in the folder is indexed and served"),
    Mutant("disk_scan_keeps_truncated", "kv_offload/disk_tier.py",
           (("            if stat.st_size != self.file_bytes:\n                report.remove(path, \"truncated\")",
             "            if False:\n                report.remove(path, \"truncated\")"),),
           DISK_UNIT, "a truncated file survives the start-up scan and is looked up"),
    Mutant("disk_lookup_memory_only", "kv_offload/kv_connector.py",
           (("        return in_memory, self.disk.lookup(block_hashes[in_memory:])",
             "        return in_memory, 0"),),
           DISK_UNIT + DISK_ENGINE, "the scheduler never finds a prefix on disk (no hit after a restart)"),
    Mutant("disk_no_write_through", "kv_offload/kv_connector.py",
           (("                self.disk.put(saves[i].block_hash, copies[i])",
             "                pass"),),
           DISK_UNIT + DISK_ENGINE, "saved blocks never reach the disk tier"),
    Mutant("disk_hits_counted_as_memory", "core/kv_cache_manager.py",
           (("        on_disk = min(num_loaded, self._last_disk_blocks or 0) * self.block_size",
             "        on_disk = 0"),),
           ("tests/core/test_core_kv_transfer.py",),
           "disk hits are counted as memory-tier hits (stats and tier=disk metrics)"),
)

MUTANTS_KV_DISK_CHECK = (
    Mutant("disk_start_up_check_skips_checksum", "kv_offload/disk_tier.py",
           (("if len(raw) != self.file_bytes or zlib.crc32(memoryview(raw)[HEADER_BYTES:]) != crc:",
             "if len(raw) != self.file_bytes:"),),
           DISK_UNIT, "the start-up check indexes a block file whose payload fails its CRC-32"),
)

MUTANTS_RAY_START = (
    Mutant("ray_stale_record_joined", "distributed/ray_start.py",
           (('    return "local"\n', "    return recorded\n"),),
           ("tests/test_ray_start.py",),
           "a recorded Ray cluster that is gone is joined anyway: the start retries for minutes"),
    Mutant("ray_named_address_unprobed", "distributed/ray_start.py",
           (('if named == "local" or answers(named, timeout):', "if True:"),),
           ("tests/test_ray_start.py",),
           "a --ray-address nothing answers at is passed to ray.init instead of one line, exit 2"),
    Mutant("ray_replica_start_not_retried", "distributed/client.py",
           (("            if attempt == tries:", "            if True:"),),
           ("tests/test_ray_start.py",),
           "a replica killed during start-up (Ray restarts it) ends the server's start"),
    Mutant("ray_memory_monitor_left_on", "distributed/ray_start.py",
           ((', "RAY_memory_monitor_refresh_ms": "0"}', "}"),),
           ("tests/test_ray_start.py",),
           "Ray's memory monitor kills replicas and stages when the host is busy"),
    Mutant("tp_sweep_removes_live_segments", "distributed/tensor_parallel.py",
           (("        if match is None or _pid_alive(int(match.group(1))):",
             "        if match is None:"),),
           ("tests/model/test_tensor_parallel.py",),
           "the start-up sweep unlinks a live server's all-reduce segment"),
)

MUTANTS_CONSTRAINT_WATCHDOG = (
    Mutant("constraint_watchdog_silent_exit", "constraints/compile_worker.py",
           (('            stdout.write(json.dumps({"timeout": cpu_seconds}) + "\\n")\n', ""),),
           ("tests/test_constraint_watchdog.py",),
           "a constraint past its CPU budget ends the child without answering: the server "
           "reads a crash (or a lost exit status) instead of the budget"),
    Mutant("constraint_compile_idle_from_start", "constraints/compile_worker.py",
           (("used is None or used > self.normal_cpu_seconds", "True"),),
           ("tests/test_constraint_watchdog.py",),
           "every compile runs on idle CPU only from its start: beside other busy processes "
           "the server's constraints starve for minutes"),
    Mutant("constraint_compile_never_demoted", "constraints/compile_worker.py",
           (("                    yield_the_cpu(native_id)\n", ""),),
           ("tests/test_constraint_watchdog.py",),
           "a hostile compile keeps normal priority for its whole CPU budget, beside the steps"),
)

MUTANTS_LOGGING = (
    Mutant("log_uvicorn_keeps_its_own_handler", "observability/log.py",
           (("        uvicorn_logger.propagate = True\n", ""),),
           ("tests/observability/test_obs_log_format.py",),
           "after a uvicorn.Config with its default log_config, uvicorn's lines bypass ours"),
)

MUTANTS_KV_FORMAT = (
    Mutant("kv_int8_bytes_without_scales", "kv_format.py",
           [("    return head_dim + SCALE_BYTES\n", "    return head_dim\n")],
           ("tests/test_plan.py",),
           "int8 KV bytes per token forget the 4-byte scale of each vector: the planner "
           "promises more tokens than the cache holds"),
    Mutant("kv_int8_reference_rounds_down", "model/kv_quant.py",
           [("codes = np.clip(np.rint(x * inv)", "codes = np.clip(np.floor(x * inv)")],
           ("tests/cpu/test_kv_int8.py",),
           "the reference quantization truncates instead of rounding half to even"),
)

# Mutant specs of helper "kv-cpu" (issue 31, part A: the int8 KV cache in the CPU kernels).
# Same fields as tools/mutation_check.py's Mutant; each checked by hand (applied to a
# copy of src/ imported first on PYTHONPATH, the tests below failed, copy reverted /
# discarded: /work/main itself was never mutated, so that the other sessions' test runs
# were not disturbed).
# Note: the tile kernel's int8 read (kernels._attend_tile) and the int8 write
# (kernels.quantize_kv_vector) are the very functions the fused decode step calls, so
# the key/value-scale and scale/rounding/clip mutants below hit both paths at once;
# the fused step's own int8 code (K rotated before quantizing, the scales it passes)
# has the cpu_kv_int8_fused_* mutants, killed by the fused-vs-op-path test.
KV_INT8_CPU_TESTS = ("tests/cpu/test_kv_int8.py",)
KV_INT8_FUSED_TESTS = (
    "tests/cpu/test_decode_layer.py::test_fused_decode_on_int8_caches_matches_op_path",)

MUTANTS_KV_CPU = (
    Mutant("cpu_kv_int8_write_scale", "cpu/kernels.py",
           (("scales[hd // 4] = amax / np.float32(127.0)",
             "scales[hd // 4] = amax / np.float32(128.0)"),),
           KV_INT8_CPU_TESTS, "write_kv (and the fused step) store scales max|x|/128 "
           "while the codes are made for /127"),
    Mutant("cpu_kv_int8_code_rounding", "cpu/kernels.py",
           (("c = np.rint(x[d] * inv)", "c = np.floor(x[d] * inv + np.float32(0.5))"),),
           KV_INT8_CPU_TESTS, "int8 KV codes rounded half up, not half to even"),
    Mutant("cpu_kv_int8_code_clip", "cpu/kernels.py",
           (("""        if c > np.float32(127.0):
            c = np.float32(127.0)""", """        if c > np.float32(126.0):
            c = np.float32(126.0)"""),),
           KV_INT8_CPU_TESTS, "int8 KV codes clipped at 126: a vector's largest value loses a step"),
    Mutant("cpu_kv_int8_key_scale", "cpu/kernels.py",
           (("p[j] *= kv_scales[pb, 0, j, kvh, sidx]", "p[j] *= kv_scales[pb, 1, j, kvh, sidx]"),),
           KV_INT8_CPU_TESTS, "the attention tiles (and the fused step) scale an int8 key's "
           "dot product by its value's scale"),
    Mutant("cpu_kv_int8_value_scale", "cpu/kernels.py",
           (("p[j] *= kv_scales[pb, 1, j, kvh, sidx]", "p[j] *= kv_scales[pb, 1, j0, kvh, sidx]"),),
           KV_INT8_CPU_TESTS, "the attention tiles (and the fused step) weight every int8 "
           "value of a block by the first visible value's scale"),
    Mutant("cpu_kv_int8_scale_index", "cpu/kernels.py",
           (("sidx = hd // 4  # the scale's index", "sidx = hd // 4 - 1  # the scale's index"),),
           KV_INT8_CPU_TESTS, "the attention tiles read the last four codes as the scale"),
    Mutant("cpu_kv_int8_blas_prefill_unscaled", "cpu/prefill_attention.py",
           (("kv = kv[..., :hd].astype(_F32) * kv.view(_F32)[..., hd // 4:hd // 4 + 1]",
             "kv = kv[..., :hd].astype(_F32)"),),
           KV_INT8_CPU_TESTS, "the BLAS prefill path gathers int8 codes without their scales"),
    Mutant("cpu_kv_int8_fused_unrotated_key", "cpu/decode_layer.py",
           (("quantize_kv_vector(k, kv_cache[b, 0, o, kvh], kv_scales[b, 0, o, kvh])",
             "quantize_kv_vector(qkv[s, koff:koff + hd], kv_cache[b, 0, o, kvh], "
             "kv_scales[b, 0, o, kvh])"),),
           KV_INT8_FUSED_TESTS, "the fused decode step quantizes K before RoPE"),
    Mutant("cpu_kv_int8_fused_value_scale_slot", "cpu/decode_layer.py",
           (("""                           kv_scales[b, 1, o, kvh])""",
             """                           kv_scales[b, 0, o, kvh])"""),),
           KV_INT8_FUSED_TESTS, "the fused decode step writes V's scale over K's"),
    Mutant("cpu_kv_int8_fused_reads_codes_unscaled", "cpu/decode_layer.py",
           (("""att,
                 window, kv_scales)""", """att,
                 window, None)"""),
            ("nh // nkv, att, window, kv_scales)", "nh // nkv, att, window, None)")),
           KV_INT8_FUSED_TESTS, "the fused decode step attends over int8 codes without scales"),
)

TP_TESTS = ("tests/model/test_tensor_parallel.py",)

MUTANTS_TP = (
    Mutant("tp_row_parallel_bias_on_every_rank", "distributed/tensor_parallel.py",
           (("return weight if rank == 0 else np.zeros_like(weight)", "return weight"),),
           TP_TESTS,
           "every worker keeps the o_proj / down_proj bias: the all-reduce adds it T times"),
    Mutant("tp_column_split_from_zero", "distributed/tensor_parallel.py",
           (("return np.ascontiguousarray(weight[:, lo:hi])",
             "return np.ascontiguousarray(weight[:, :hi - lo])"),),
           TP_TESTS,
           "o_proj / down_proj columns of every worker taken from column 0, not from its "
           "heads' / intermediate range"),
    Mutant("tp_allreduce_drops_third_rank", "distributed/tensor_parallel.py",
           (("for r in range(2, self.world):", "for r in range(3, self.world):"),),
           TP_TESTS,
           "the shared-memory sum leaves out rank 2's slot (T >= 3 gives wrong logits)"),
    Mutant("tp_allreduce_one_size_field", "distributed/tensor_parallel.py",
           (("counters[me + 1 + (g & 1)] = n", "counters[me + 1] = n"),
            ("sizes = [counters[i + 1 + (g & 1)] for i in self._gen]",
             "sizes = [counters[i + 1] for i in self._gen]")),
           TP_TESTS,
           "one element-count field per rank: a peer already in the next call overwrites it "
           "and the size check fails spuriously"),
    Mutant("tp_allreduce_single_buffer", "distributed/tensor_parallel.py",
           (("slots = self._slots[g & 1, :, :n]", "slots = self._slots[0, :, :n]"),),
           TP_TESTS,
           "one buffer without a second barrier: a rank already in the next call overwrites "
           "its slot before a slower rank has summed it"),
)

MUTANTS_PLAN_PARALLEL = (
    Mutant("plan_device_kv_unsharded", "core/plan.py",
           (("num_key_value_heads=len(shard.kv_heads), intermediate_size=len(columns))",
             "num_key_value_heads=model.num_key_value_heads, intermediate_size=len(columns))"),),
           ("tests/test_plan.py",),
           "each device sized as if it held every KV head: no KV memory freed by tensor parallelism"),
    Mutant("plan_loosest_device", "core/plan.py",
           (("tightest = min(d.kv_tokens for d in devices)",
             "tightest = max(d.kv_tokens for d in devices)"),),
           ("tests/test_plan.py",),
           "the plan's KV tokens are the loosest device's, more than the tightest device holds"),
    Mutant("plan_query_weights_unsharded", "core/plan.py",
           (("return n * len(shard.q_heads) // model.num_attention_heads",
             "return n"),),
           ("tests/test_plan.py",),
           "every TP rank counted with the whole q_proj and o_proj"),
)

PIPELINE_TESTS = ("tests/model/test_pipeline_runner.py",)
MICRO_BATCH_TESTS = ("tests/core/test_core_pipeline_micro_batches.py",)

MUTANTS_PIPELINE = (
    Mutant("pp_micro_batch_takes_every_decode", "core/scheduler.py",
           (("decodes = [r for r in decodes if not r.num_output_placeholders][\n"
             "                :-(-len(decodes) // stages)]",
             "decodes = [r for r in decodes if not r.num_output_placeholders]"),),
           MICRO_BATCH_TESTS + PIPELINE_TESTS,
           "a pipelined step takes every free decode: the second micro-batch is empty and one "
           "stage idles while the other computes"),
    Mutant("pp_micro_batch_cap_counts_tokens_in_flight", "core/scheduler.py",
           (("decodes = [r for r in decodes if not r.num_output_placeholders][",
             "decodes = [r for r in decodes][",),),
           MICRO_BATCH_TESTS,
           "the 1/P cap is taken from a list that still holds the requests in flight: the "
           "next micro-batch comes out empty"),
    Mutant("pp_stage_ignores_previous_mlp_output", "model/llama.py",
           (("            ops.fused_add_rms_norm(x, residual, self.layers[0].input_norm, "
             "cfg.rms_norm_eps)\n",
             "            x = ops.rms_norm(hidden, self.layers[0].input_norm, cfg.rms_norm_eps)\n"),),
           PIPELINE_TESTS,
           "a later stage drops the previous stage's last MLP output instead of adding it to "
           "the residual stream (op path)"),
    Mutant("pp_fused_decode_ignores_previous_mlp_output", "cpu/decode_path.py",
           (("    add_first = x is not None\n", "    add_first = False\n"),),
           PIPELINE_TESTS,
           "the fused decode step of a later stage starts from the residual alone"),
    Mutant("pp_finished_request_dropped_in_flight", "distributed/pipeline.py",
           (("        self._finish_ahead(set(scheduler_output.finished_request_ids))\n", ""),),
           PIPELINE_TESTS,
           "a step that preempts (or aborts) a request of the step in flight drops its state "
           "before that step samples it"),
    Mutant("pp_restarted_stage_runs_any_step", "distributed/pipeline.py",
           (("    return all(c.request_id in new and c.start_position == 0 "
             "for c in scheduler_output.scheduled)",
             "    return True"),),
           PIPELINE_TESTS,
           "after a stage restarted empty, a step that reads its lost K/V runs anyway"),
)

MUTANTS_NO_STALL = (
    Mutant("no_char_bound", "actors/tokenizer.py",
           (("            self._check_chars(message)\n            if message.messages is not None:",
             "            if message.messages is not None:"),),
           ("tests/e2e/test_e2e_no_stall.py",),
           "huge prompts are tokenized before their 400, on the tokenizer's time"),
)

MUTANTS_BENCH = (
    Mutant("bench_speed_scaling_inverted", "bench/compare.py",
           (("            c = c * speed if kind == \"lower\" else c / speed",
             "            c = c / speed if kind == \"lower\" else c * speed"),),
           ("tests/tools/test_tools_compare.py",),
           "make bench scales the current run the wrong way: a slower machine looks slower still"),
    Mutant("bench_busy_run_judged", "bench/compare.py",
           (("    if args.max_load is not None and load is not None and load > args.max_load:",
             "    if False:"),),
           ("tests/tools/test_tools_compare.py",),
           "make bench judges a run on a busy machine (reports regressions it did not cause)"),
)

#: The serving core's policies (issue 33): each mutant's one test file runs in seconds.
MUTANTS_CORE_POLICY = (
    Mutant("diagnosis_ignores_targets", "observability/diagnosis.py",
           (("    target = _target_rule(f, explained=bool(verdicts))",
             "    target = None"),),
           ("tests/observability/test_obs_stats_unit.py",),
           "a uniformly slow server (0.02 tokens/s per request, a 9.7 s median TTFT) gets no "
           "verdict: nothing relative stands out"),
    Mutant("recompute_keeps_the_void_token", "core/scheduler.py",
           (("                    or scheduler_output.step_id <= request.outputs_void_through):",
             "                    or False):"),),
           ("tests/core/test_core_kv_transfer.py",),
           "a request restarted after a lost KV load keeps the token a step in flight computed "
           "from the bad K/V"),
    Mutant("free_queue_evicts_newest_cached", "core/block_pool.py",
           (("                else:\n                    self.free_queue.append(block)",
             "                else:\n                    self.free_queue.appendleft(block)"),),
           ("tests/core/test_core_kv_cache_manager.py",),
           "a freed cached block goes to the head of the free queue: the most recently used "
           "cached block is evicted first, not the least"),
    Mutant("full_prefix_hit_skips_last_token", "core/kv_cache_manager.py",
           (("        max_blocks = (request.num_tokens - 1) // self.block_size\n"
             "        if self.num_groups > 1:",
             "        max_blocks = request.num_tokens // self.block_size\n"
             "        if self.num_groups > 1:"),),
           ("tests/core/test_core_kv_cache_manager.py",),
           "a prompt whose every block is cached takes all of them as hits: its last token "
           "is never computed, so nothing is sampled from it"),
    Mutant("budget_admits_at_zero", "core/scheduler.py",
           (("        while self.staged and step.budget > 0:",
             "        while self.staged and step.budget >= 0:"),),
           ("tests/core/test_core_scheduler.py",),
           "a step whose token budget is spent still admits a waiting request, with 0 "
           "tokens scheduled (a running slot and blocks taken for nothing)"),
    Mutant("victim_ignores_priority", "core/scheduler.py",
           (("        return max(self.running, key=lambda r: (*self._priority_key(r), "
             "order[id(r)]))",
             "        return max(self.running, key=lambda r: order[id(r)])"),),
           ("tests/core/test_core_scheduler.py",),
           "under priority the preemption victim is the latest admitted request, not the "
           "one of worst priority"),
    Mutant("aging_sign_flipped", "core/request_queue.py",
           (("return (request.priority + request.arrival_time / aging_seconds, "
             "request.arrival_time)",
             "return (request.priority - request.arrival_time / aging_seconds, "
             "request.arrival_time)"),),
           ("tests/core/test_core_admission_queue.py",),
           "with priority aging a request's effective priority gets worse the longer it "
           "waits (newer requests overtake older ones of the same priority)"),
    Mutant("utf8_partial_char_streamed", "core/incremental_text.py",
           (("if len(full_text) <= len(prefix_text) or "
             "(full_text.endswith(REPLACEMENT_CHAR) and not flush):",
             "if len(full_text) <= len(prefix_text):"),),
           ("tests/actors/test_detokenizer_policy_edges.py",),
           "a token ending mid UTF-8 character streams U+FFFD instead of waiting for the "
           "rest of the character"),
    Mutant("top_p_zero_accepted", "core/sampling_params.py",
           (('_check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)',
             '_check_range("top_p", self.top_p, 0.0, 1.0)'),),
           ("tests/core/test_core_sampling_params.py",),
           "top_p = 0 is accepted (an empty nucleus) instead of a 400 naming top_p"),
    Mutant("min_tokens_off_by_one", "core/request.py",
           (("    if num_output >= params.min_tokens:",
             "    if num_output > params.min_tokens:"),),
           ("tests/core/test_core_request.py",),
           "EOS or a stop token id sampled as the min_tokens-th token does not stop the "
           "request (one token too many)"),
    Mutant("capacity_reported_every_step", "actors/scheduler.py",
           (("        changed = capacity != self._reported and self._num_queued > 0",
             "        changed = capacity != self._reported"),),
           ("tests/actors/test_admission_protocol.py",),
           "the scheduler reports its capacity to admission at every step of steady decode, "
           "with nothing waiting there"),
    Mutant("preempted_kept_staged", "core/scheduler.py",
           (("        self._preempted[request.request_id] = None\n", ""),),
           ("tests/actors/test_scheduler_kv_load_lost.py",),
           "a preempted request stays staged in the scheduler instead of going back to "
           "admission, which owns the waiting requests"),
)

MUTANTS = (MUTANTS + MUTANTS_KV_CPU + MUTANTS_KV_CUDA + MUTANTS_KV_DISK + MUTANTS_KV_DISK_CHECK
           + MUTANTS_KV_FORMAT + MUTANTS_RAY_START + MUTANTS_LOGGING
           + MUTANTS_CONSTRAINT_WATCHDOG + MUTANTS_TP + MUTANTS_PLAN_PARALLEL
           + MUTANTS_PIPELINE + MUTANTS_BENCH + MUTANTS_CORE_POLICY + MUTANTS_NO_STALL)


#: What ``.ci/run`` checks (``--ci``): every core-policy mutant, and one of
#: each kernel or policy family whose tests run in seconds (the CUDA
#: simulator's and the model-loading ones stay in ``make mutation-check``).
CI_MUTANTS = (
    # kernels: CPU attention, prefill, RoPE, norms, products, fused decode, KV int8, sampler
    "gqa_head_mapping", "prefill_causal_mask", "rope_direction", "rms_norm_eps_placement",
    "f32_gemv_channel", "int8_tile_channel_scale", "q4_nibble_order", "block_dot_q8_rounding",
    "panel_nibble_half", "kquant_q6k_offset",
    "fused_kv_slot", "cpu_kv_int8_key_scale", "attention_window_ignored",
    "top_p_drops_crossing_token", "penalty_sign", "structured_bit_order",
    # the serving core's data and policies
    "constraint_child_forked", "constraint_compile_idle_from_start",
    "block_hash_parent_link", "slot_mapping_offset", "threads_no_dwell",
    "stall_clock_not_restarted", "router_prefix_gap", "disk_checksum_unchecked",
    "disk_evicts_a_live_tiers_files", "kv_load_lost_fails_the_request",
    "kv_cache_lost_fails_the_requests", "health_unavailable_answers_200",
    "tp_allreduce_single_buffer", "pp_micro_batch_takes_every_decode",
    "pp_finished_request_dropped_in_flight", "plan_device_kv_unsharded",
    "bench_speed_scaling_inverted", "bench_busy_run_judged",
) + tuple(m.name for m in MUTANTS_CORE_POLICY)


def _apply(mutant: Mutant, root: Path) -> None:
    """Apply ``mutant``'s edits to the copy under ``root``.

    Raises LookupError when an edit's text does not occur ``count`` times.
    """
    path = root / "src" / mutant.file
    text = path.read_text(encoding="utf-8")
    for old, new in mutant.edits:
        found = text.count(old)
        if found != mutant.count:
            raise LookupError(f"mutant {mutant.name}: {old!r} occurs {found} times in "
                              f"src/{mutant.file}, expected {mutant.count}; update the mutant")
        text = text.replace(old, new)
    path.write_text(text, encoding="utf-8")


def _copy_tree(dest: Path) -> None:
    """Copy what the tests need (``src``, ``tests``, ``pyproject.toml``) to
    ``dest``, keeping mtimes so that Numba's on-disk cache stays valid for
    the files a mutant does not touch; ``dest/site/kvserve`` points at the copy."""
    for name in ("src", "tests"):
        shutil.copytree(REPO / name, dest / name, symlinks=True,
                        ignore=shutil.ignore_patterns(".pytest_cache", ".hypothesis"))
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")
    (dest / "site").mkdir()
    (dest / "site" / "kvserve").symlink_to(dest / "src", target_is_directory=True)


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


#: pytest's exit status when no test was collected or all were deselected.
_NO_TESTS_RAN = 5


def _run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str, str]:
    """Run ``tests`` in the copy. Returns (passed, first failing test, output tail).

    Only a run that ends with a failure kills: one past ``timeout`` and one in
    which no test ran (pytest's exit 5) count as passed (the mutant survives),
    with the reason in place of the failing test."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KVSERVE_REQUIRE_GOLDEN")}
    env["PYTHONPATH"] = str(root / "site")
    env["KVSERVE_GOLDEN"] = str(root / "no-golden")  # as in a plain clone
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-m", "not model",
           "-p", "no:cacheprovider", "--hypothesis-seed=0", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        # A run that did not finish killed nothing: a survivor, not a kill.
        return True, "(timeout: counted as a survivor)", ""
    out = proc.stdout + proc.stderr
    if proc.returncode == _NO_TESTS_RAN:  # every test deselected (e.g. all marked `model`)
        return True, "(no test ran: counted as a survivor)", out[-3000:]
    failed = _FAILED.search(out)
    return proc.returncode == 0, failed.group(1) if failed else f"(exit {proc.returncode})", out[-3000:]


def check(mutant: Mutant | None, timeout: float,
          baseline_of: tuple[Mutant, ...] = MUTANTS) -> tuple[bool, str, float, str]:
    """Copy, mutate (None: baseline: the tests of ``baseline_of``), run.
    Returns (passed, killer, seconds, output)."""
    with tempfile.TemporaryDirectory(prefix="kvserve-mutant-") as tmp:
        root = Path(tmp)
        _copy_tree(root)
        if mutant is not None:
            _apply(mutant, root)
        tests = mutant.tests if mutant else tuple(dict.fromkeys(
            t for m in baseline_of for t in m.tests))
        start = time.monotonic()
        passed, killer, out = _run_tests(root, tests, timeout)
        return passed, killer, time.monotonic() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants only")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant run")
    parser.add_argument("--ci", action="store_true",
                        help="the subset CI runs (CI_MUTANTS: the core policies and one mutant "
                             "per kernel family)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28s} src/{m.file:26s} {m.breaks}")
        return 0
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    only = set(args.only or ()) | (set(CI_MUTANTS) if args.ci else set())
    chosen = [m for m in MUTANTS if not only or m.name in only]

    passed, killer, seconds, out = check(None, args.timeout, tuple(chosen))
    passed = passed and not killer.startswith(("(timeout", "(no test"))  # no baseline
    print(f"baseline (no mutant): {'passed' if passed else 'FAILED'} in {seconds:.1f} s", flush=True)
    if not passed:
        print(out, file=sys.stderr)
        print(f"error: the unmutated tests fail ({killer}); fix that first", file=sys.stderr)
        return 2
    rows = []
    for mutant in chosen:
        try:
            passed, killer, seconds, _ = check(mutant, args.timeout)
        except LookupError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        status = "SURVIVED" if passed else "killed"
        rows.append((mutant.name, status, killer if passed and killer.startswith(("(timeout", "(no test")) else (
            "-" if passed else killer), seconds))
        print(f"{mutant.name}: {status} ({seconds:.1f} s)", flush=True)

    print()
    print("| mutant | result | killed by | seconds |")
    print("|---|---|---|---|")
    for name, status, by, seconds in rows:
        print(f"| {name} | {status} | {by} | {seconds:.1f} |")
    survivors = [r[0] for r in rows if r[1] == "SURVIVED"]
    print(f"\n{len(rows) - len(survivors)} of {len(rows)} mutants killed"
          + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Tiny random checkpoints of each model family, and transformers' greedy tokens on them.

The references of ``tests/model/test_families.py``: kvserve did not produce
them. Run in a venv of its own (transformers and this machine's CPU torch
wheel are never kvserve dependencies)::

    python3 -m venv ~/.cache/kvserve/hf-venv
    ~/.cache/kvserve/hf-venv/bin/pip install torch==2.13.0 transformers sentencepiece protobuf
    ~/.cache/kvserve/hf-venv/bin/python tools/make_family_references.py \\
        [--llama-cpp ~/.cache/kvserve/llama.cpp] [--out tests/model/data]

For each family (:data:`FAMILIES`: Llama 3.x with its ``llama3`` RoPE, Qwen2
with q/k/v biases and a base of 1,000,000, Qwen3 with q/k norms and a
``head_dim`` of its own, Mistral with a sliding window of 8, Phi-3 with
fused projections and LongRoPE, and a plain Llama) it writes
``<out>/families/<family>/``:

- the checkpoint as transformers saves it (``save_pretrained``: config.json
  in transformers 5's form, ``model.safetensors`` in bfloat16; the float32
  reference model holds the same bfloat16-rounded values) with a tiny
  byte-level BPE tokenizer (:func:`tiny_tokenizer`, 320 tokens);
- ``model.gguf``: the same folder converted by llama.cpp's own
  ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist that
  ``tools/bench_vs_llamacpp.py`` builds; ``--outtype bf16``). Its BPE
  pre-tokenizer check knows only released tokenizers, so it is told this
  one is ``gpt-2``'s (the tokenizer plays no part in the weights);
- ``reference.json``: prompts (token ids), transformers' greedy tokens
  (a full forward per step, no cache) and each step's top-2 logit margin.

Weights are random with a scale that makes the tokens decisive (linear
layers N(0, 1/fan_in), embeddings and LM head N(0, 1), a tied table
N(0, 1/16), norms 1 + N(0, 0.01), biases N(0, 0.01)),
seeded per family, so a rerun writes the same files.

``quantized`` (``... make_family_references.py quantized``): for the
families of :data:`QUANTIZED` a larger checkpoint of the same kind (hidden
256, so that every product's K is a whole number of 256-weight
super-blocks), converted to F16 and quantized by llama.cpp's own
``llama-quantize`` to Q4_K_M, kept as ``<family>/model-q4_k_m.gguf`` (no
folder, no reference tokens: ``tests/model/test_families.py`` compares the
file's block kernels with the same file dequantized by the ``gguf``
package).

It also writes ``<out>/rope_reference.json`` (``rope`` subcommand alone:
``... make_family_references.py rope``): transformers' inverse frequencies
and attention factors of the ``llama3``, ``linear``, ``yarn`` and
``longrope`` types, for ``tests/model/test_rope.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, MistralConfig, Phi3Config, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3Config)

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 320
NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 17, 31)  # + 24 new: at most 55 positions, below Phi-3's 64
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)
#: family -> (config class, its settings beyond COMMON, seed)
FAMILIES = {
    "llama": (LlamaConfig, dict(tie_word_embeddings=False), 1),
    "llama3": (LlamaConfig, dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}), 2),
    "qwen2": (Qwen2Config, dict(tie_word_embeddings=False, rope_theta=1000000.0), 3),
    "qwen3": (Qwen3Config, dict(tie_word_embeddings=True, rope_theta=1000000.0,
                                head_dim=32), 4),
    "mistral": (MistralConfig, dict(tie_word_embeddings=False, sliding_window=8), 5),
    "phi3": (Phi3Config, dict(
        tie_word_embeddings=False, original_max_position_embeddings=64, sliding_window=None,
        rope_scaling={"type": "longrope",
                      "short_factor": [1.0 + 0.25 * i for i in range(8)],
                      "long_factor": [1.0 + 2.0 * i for i in range(8)]}), 6),
    # Phi-4-mini: Phi-3's layout, RoPE over three quarters of each head
    "phi4mini": (Phi3Config, dict(
        tie_word_embeddings=True, original_max_position_embeddings=64, sliding_window=None,
        partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope",
                      "short_factor": [1.0 + 0.25 * i for i in range(6)],
                      "long_factor": [1.0 + 2.0 * i for i in range(6)]}), 7),
}
CORPUS = ("The quick brown fox jumps over the lazy dog. def parse(line):\n"
          "    name, _, value = line.partition(':')\n    return name.strip(), value\n"
          "Serving engines batch requests, page the KV cache and stream tokens. ") * 20


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of :data:`VOCAB` tokens trained on :data:`CORPUS`
    (``<|endoftext|>`` is id 0: BOS, EOS and padding)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def random_model(family: str) -> torch.nn.Module:
    """The family's model, weights re-drawn (module docstring) and rounded to bfloat16."""
    cls, settings, seed = FAMILIES[family]
    config = cls(**{**COMMON, **settings})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed_tokens" in name and config.tie_word_embeddings:
                # a tied table of N(0, 1) rows makes each token its own next
                # one (its logit |e|^2 dwarfs the rest): smaller rows
                p.copy_(0.25 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2 and ("embed_tokens" in name or "lm_head" in name):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # norms
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    return model.eval()


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by a full forward per step (no KV cache) and each step's top-2 margin."""
    ids, margins = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].double()
            top = torch.topk(logits, 2)
            ids.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return ids[len(prompt):], margins


def convert_to_gguf(folder: Path, out: Path, llama_cpp: Path, outtype: str = "bf16") -> None:
    """``convert_hf_to_gguf.py folder --outtype OUTTYPE --outfile out``, run from the
    sdist's own source folder, its BPE pre-tokenizer check answered ``gpt-2``."""
    source = next(llama_cpp.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if source is None:
        raise SystemExit(f"no llama.cpp sdist under {llama_cpp}: run tools/bench_vs_llamacpp.py "
                         "once (it fetches and builds it)")
    wrapper = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(source)!r}, {str(source / 'gguf-py')!r}]\n"
        "from conversion import base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        f"sys.argv = ['convert_hf_to_gguf.py', {str(folder)!r}, '--outtype', {outtype!r},"
        f" '--outfile', {str(out)!r}]\n"
        f"runpy.run_path({str(source / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
    subprocess.run([sys.executable, "-c", wrapper], check=True, cwd=source,
                   stdout=subprocess.DEVNULL)


#: Families whose Q4_K_M file is written (``quantized``): Llama 3's
#: ``rope_freqs``, Qwen3's q/k norms, Phi-3's fused tensors split as blocks.
QUANTIZED = ("llama3", "qwen3", "phi3")
#: The quantized files' shapes (every K a multiple of 256).
QUANTIZED_SHAPES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2)


def write_quantized(family: str, out: Path, tokenizer: PreTrainedTokenizerFast,
                    llama_cpp: Path) -> None:
    """``<out>/families/<family>/model-q4_k_m.gguf``: :data:`QUANTIZED_SHAPES`
    of the family, F16 by ``convert_hf_to_gguf.py``, then ``llama-quantize``
    Q4_K_M."""
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"no {quantize}: run tools/bench_vs_llamacpp.py once (it builds it)")
    cls, settings, seed = FAMILIES[family]
    settings = {**settings, **QUANTIZED_SHAPES}
    if family == "qwen3":
        settings["head_dim"] = 64
    if family == "phi3":  # a factor per frequency of a 64-wide head
        settings["rope_scaling"] = {**settings["rope_scaling"],
                                    "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                    "long_factor": [1.0 + 0.5 * i for i in range(32)]}
    FAMILIES[f"{family}-q"] = (cls, settings, seed + 50)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / family
        random_model(f"{family}-q").to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if family == "phi3":
            path = folder / "tokenizer_config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()),
                                        "tokenizer_class": "GPT2Tokenizer"}))
        f16 = Path(tmp) / "f16.gguf"
        convert_to_gguf(folder, f16, llama_cpp, "f16")
        target = out / "families" / family / "model-q4_k_m.gguf"
        subprocess.run([str(quantize), str(f16), str(target), "Q4_K_M"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"{family}: {target.stat().st_size / 1024:.0f} KiB Q4_K_M", flush=True)


def write_family(family: str, out: Path, tokenizer: PreTrainedTokenizerFast,
                 llama_cpp: Path | None) -> None:
    folder = out / "families" / family
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    model = random_model(family)
    model.to(torch.bfloat16).save_pretrained(folder)
    model.to(torch.float32)
    tokenizer.save_pretrained(folder)
    if family in ("phi3", "phi4mini"):  # the converter reads a BPE vocabulary only so
        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()),
                                    "tokenizer_class": "GPT2Tokenizer"}, indent=2) + "\n")
    gen = torch.Generator().manual_seed(100 + FAMILIES[family][2])
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    runs = []
    for prompt in prompts:
        tokens, margins = greedy(model, prompt, NEW_TOKENS)
        runs.append({"prompt": prompt, "tokens": tokens,
                     "margins": [round(m, 6) for m in margins]})
    (folder / "reference.json").write_text(json.dumps({
        "family": family, "transformers": transformers.__version__,
        "torch": torch.__version__, "new_tokens": NEW_TOKENS, "runs": runs}, indent=1) + "\n")
    for junk in ("generation_config.json", "chat_template.jinja"):
        (folder / junk).unlink(missing_ok=True)
    if llama_cpp is not None:
        convert_to_gguf(folder, folder / "model.gguf", llama_cpp)
    sizes = sum(p.stat().st_size for p in folder.iterdir())
    print(f"{family}: {sizes / 1024:.0f} KiB, smallest margin "
          f"{min(min(r['margins']) for r in runs):.4f}", flush=True)


ROPE_CASES = {
    "llama3": (LlamaConfig, dict(
        head_dim=64, hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
        rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "linear": (LlamaConfig, dict(
        head_dim=64, hidden_size=512, num_attention_heads=8, max_position_embeddings=4096,
        rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "yarn": (LlamaConfig, dict(
        head_dim=64, hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
        rope_theta=1000000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32768})),
    "longrope": (Phi3Config, dict(
        hidden_size=512, num_attention_heads=8, max_position_embeddings=131072,
        original_max_position_embeddings=4096, rope_theta=10000.0, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
            "long_factor": [1.0 + 0.5 * i for i in range(32)]})),
}


def write_rope_reference(out: Path) -> None:
    """transformers' ``ROPE_INIT_FUNCTIONS`` on :data:`ROPE_CASES`: the config as
    given (transformers 4's keys), as transformers 5 saves it, the inverse
    frequencies (float32) and the attention factor (longrope: also past the
    original context)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    result = {}
    for name, (cls, kwargs) in ROPE_CASES.items():
        config = cls(**kwargs)
        fn = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]]
        inv, attention = fn(config, "cpu")
        entry = {"config": kwargs, "inv_freq": inv.tolist(), "attention_factor": float(attention),
                 "saved_config": {k: v for k, v in config.to_dict().items()
                                  if "rope" in k or "position" in k}}
        if name == "longrope":
            entry["inv_freq_long"] = fn(config, "cpu", seq_len=8192)[0].tolist()
        result[name] = entry
    (out / "rope_reference.json").write_text(json.dumps(result, separators=(",", ":")))
    print(f"rope: {', '.join(result)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="*", default=["rope", *FAMILIES, "quantized"],
                    help=f"rope, quantized and/or families (default: all): "
                         f"{', '.join(FAMILIES)}")
    ap.add_argument("--out", default=str(ROOT / "tests" / "model" / "data"))
    ap.add_argument("--llama-cpp", default=os.path.expanduser("~/.cache/kvserve/llama.cpp"),
                    help="where tools/bench_vs_llamacpp.py keeps the llama.cpp sdist; "
                         "'' skips the GGUF files")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    llama_cpp = Path(args.llama_cpp) if args.llama_cpp else None
    tokenizer = tiny_tokenizer()
    for what in args.what:
        if what == "rope":
            write_rope_reference(out)
        elif what == "quantized":
            for family in QUANTIZED:
                write_quantized(family, out, tokenizer, llama_cpp)
        elif what in FAMILIES:
            write_family(what, out, tokenizer, llama_cpp)
        else:
            raise SystemExit(f"unknown {what!r}: rope or one of {', '.join(FAMILIES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

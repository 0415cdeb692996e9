"""Write a tiny random-weight Llama model and a locally trained byte-level BPE tokenizer to a directory.

Runs inside the vLLM venv (it needs torch, transformers and tokenizers) and never touches a model
hub: the tokenizer is trained on the Python standard library's sources (the same files for the same
Python version, so the same seed gives the same model and tokenizer).

    .venv-vllm/bin/python scripts/make_tiny_llama.py --out /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_files(max_files: int, max_bytes: int) -> list[str]:
    """The standard library's .py files in sorted order, within the limits."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[str] = []
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).parts
        if rel[0] in ("site-packages", "dist-packages") or len(files) >= max_files or total >= max_bytes:
            continue
        files.append(str(path))
        total += path.stat().st_size
    if not files:
        raise SystemExit("make_tiny_llama: found no local .py files to train the tokenizer on")
    return files


def build_tokenizer(vocab_size: int, files: list[str]) -> object:
    """A byte-level BPE with bos/eos/unk/pad, a `<s>` prefix on encode and a tiny chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: object, vocab_size: int, seed: int, init_std: float, dtype: str) -> object:
    """A random LlamaForCausalLM: 256 hidden, 512 MLP, 2 layers, 4 heads of 64, untied embeddings.

    The default weight std (0.1, five times transformers' 0.02) makes greedy output depend on the
    prompt instead of repeating one token, so comparing P/D output with single-instance output
    actually tests the transferred KV cache.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,  # type: ignore[attr-defined]
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
        dtype=dtype,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.eval()
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--init-std", type=float, default=0.1, help="std of the random weights")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="weights dtype (vLLM on CPU runs bf16 anyway)")
    parser.add_argument("--max-files", type=int, default=200, help="at most this many .py files for the tokenizer")
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="stop adding files past this many bytes")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    files = training_files(args.max_files, args.max_bytes)
    tokenizer = build_tokenizer(args.vocab_size, files)
    model = build_model(tokenizer, args.vocab_size, args.seed, args.init_std, args.dtype)
    model.save_pretrained(args.out)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(args.out)  # type: ignore[attr-defined]
    n_params = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    summary = {
        "out": str(args.out),
        "params": n_params,
        "tokenizer_files": len(files),
        "vocab_size": args.vocab_size,
        "dtype": args.dtype,
        "seconds": round(time.perf_counter() - start, 2),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

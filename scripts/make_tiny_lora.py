"""Write a tiny random LoRA adapter for the tiny Llama of scripts/make_tiny_llama.py, in PEFT's format.

`adapter_model.safetensors` holds `base_model.model.model.layers.{i}.{module}.lora_A.weight` (rank ×
in) and `.lora_B.weight` (out × rank) for every target module of every layer, float32, seeded;
`adapter_config.json` is PEFT's LoRA config, which vLLM's `PEFTHelper` reads (r, lora_alpha,
target_modules, ...). Nothing is downloaded. The shapes come from the model directory's config.json
when `--model` is given, else from make_tiny_llama's defaults. B is random, not PEFT's zeros, so the
adapter changes the model's output (a LoRA request and a base-model request then differ).

Needs numpy only (the safetensors file is written by hand to its documented layout: an 8-byte
little-endian header length, a JSON header padded with spaces to 8 bytes, the tensors' bytes), so
it runs under the vLLM venv's python as under the project's:

    .venv-vllm/bin/python scripts/make_tiny_lora.py --model /tmp/tiny-llama --out /tmp/tiny-lora
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
"""make_tiny_llama.py's shape."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def module_shapes(config: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA-able linear module of one Llama layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_tensors(
    config: dict[str, int], targets: list[str], rank: int, std: float, seed: int
) -> dict[str, np.ndarray]:
    """PEFT's tensor names → seeded random float32 weights."""
    rng = np.random.default_rng(seed)
    shapes = module_shapes(config)
    out: dict[str, np.ndarray] = {}
    for layer in range(config["num_hidden_layers"]):
        for module in targets:
            fan_in, fan_out = shapes[module]
            part = "self_attn" if module in ATTENTION else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            out[f"{stem}.lora_A.weight"] = rng.normal(0.0, std, (rank, fan_in)).astype(np.float32)
            out[f"{stem}.lora_B.weight"] = rng.normal(0.0, std, (fan_out, rank)).astype(np.float32)
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """The safetensors layout: u64 LE header size, JSON header (8-byte aligned), tensor bytes in order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    blobs: list[bytes] = []
    for name in sorted(tensors):
        blob = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        shape = list(tensors[name].shape)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


def adapter_config(rank: int, alpha: int, targets: list[str], base: str) -> dict[str, object]:
    """PEFT's LoraConfig as `save_pretrained` writes it (the fields vLLM reads, and the usual rest)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory (created)")
    parser.add_argument("--model", type=Path, help="the base model's directory (its config.json gives the shapes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r (vLLM's --max-lora-rank >= it)")
    parser.add_argument("--alpha", type=int, default=16, help="lora_alpha (scaling alpha / r)")
    parser.add_argument("--std", type=float, default=0.05, help="std of the random A and B weights")
    parser.add_argument("--targets", default=",".join(ATTENTION), help="comma-separated modules to adapt")
    args = parser.parse_args(argv)

    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(ATTENTION + MLP))
    if unknown or not targets or args.rank < 1:
        known = ", ".join(ATTENTION + MLP)
        parser.error(f"--targets from {known}; --rank >= 1 (got {unknown or targets}, rank {args.rank})")
    config = dict(TINY_LLAMA)
    base = "tiny-llama"
    if args.model is not None:
        loaded = json.loads((args.model / "config.json").read_text())
        config.update({k: loaded[k] for k in TINY_LLAMA if loaded.get(k) is not None})
        base = str(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(config, targets, args.rank, args.std, args.seed)
    write_safetensors(args.out / "adapter_model.safetensors", tensors, {"format": "pt"})
    (args.out / "adapter_config.json").write_text(
        json.dumps(adapter_config(args.rank, args.alpha, targets, base), indent=2) + "\n"
    )
    print(f"make_tiny_lora: {len(tensors)} tensors, rank {args.rank}, {', '.join(targets)} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""scripts/make_tiny_lora.py as a real process: PEFT's files, the safetensors layout read back, shapes from the
base model's config, seeded weights, and the emulator accepting the adapter it writes."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_tiny_lora.py"


def make(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True, timeout=60
    )


def read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Parse the file by its documented layout (the test does not depend on the safetensors package)."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    assert size % 8 == 0
    header = json.loads(data[8 : 8 + size])
    meta = header.pop("__metadata__")
    body = data[8 + size :]
    out = {}
    end = 0
    for name, spec in header.items():
        a, b = spec["data_offsets"]
        assert spec["dtype"] == "F32"
        out[name] = np.frombuffer(body[a:b], dtype="<f4").reshape(spec["shape"])
        end = max(end, b)
    assert end == len(body)
    return out, meta


def test_writes_peft_files_with_the_tiny_llamas_shapes(tmp_path: Path) -> None:
    r = make(tmp_path / "a")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    tensors, meta = read_safetensors(tmp_path / "a" / "adapter_model.safetensors")
    assert meta == {"format": "pt"} and len(tensors) == 2 * 4 * 2  # 2 layers x 4 modules x (A, B)
    stem = "base_model.model.model.layers.1.self_attn."
    assert tensors[stem + "q_proj.lora_A.weight"].shape == (8, 256)
    assert tensors[stem + "v_proj.lora_B.weight"].shape == (256, 8)
    assert all(np.abs(t).sum() > 0 for t in tensors.values())  # B is not PEFT's zeros


def test_shapes_follow_the_models_config_and_weights_the_seed(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})
    )
    args = ("--model", str(model), "--rank", "4", "--targets", "k_proj,down_proj", "--seed", "3")
    assert make(tmp_path / "x", *args).returncode == 0
    assert make(tmp_path / "y", *args).returncode == 0
    x, _ = read_safetensors(tmp_path / "x" / "adapter_model.safetensors")
    y, _ = read_safetensors(tmp_path / "y" / "adapter_model.safetensors")
    assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
    assert x["base_model.model.model.layers.2.self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 kv heads x 16
    assert x["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 96)
    z = make(tmp_path / "z", *args[:-1], "4")
    assert z.returncode == 0
    other, _ = read_safetensors(tmp_path / "z" / "adapter_model.safetensors")
    assert not np.array_equal(other["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"],
                              x["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"])


def test_bad_targets_are_refused(tmp_path: Path) -> None:
    r = make(tmp_path / "bad", "--targets", "q_proj,lm_head")
    assert r.returncode == 2 and "lm_head" in r.stderr


def test_the_emulator_loads_the_adapter_it_writes(tmp_path: Path) -> None:
    import asyncio

    from adapters.emulator.lora import EmulatedLora, LoraSettings

    assert make(tmp_path / "a", "--rank", "16").returncode == 0
    state = EmulatedLora(LoraSettings(enable_lora=True, max_lora_rank=16), "tiny-llama", 0.0, 0.0)
    message = asyncio.run(state.load("a", str(tmp_path / "a")))
    assert message == "Success: LoRA adapter 'a' added successfully."
    assert make(tmp_path / "b", "--rank", "32").returncode == 0
    from adapters.emulator.protocol import ErrorAnswer

    with pytest.raises(ErrorAnswer, match="LoRA rank 32 is greater than max_lora_rank 16"):
        asyncio.run(state.load("b", str(tmp_path / "b")))

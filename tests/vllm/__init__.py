"""Tests against real vLLM processes (run in the vLLM venv: `pytest -m vllm tests/vllm`)."""

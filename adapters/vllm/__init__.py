"""Talking to vLLM (real or emulated): P/D two-leg forwarding, /metrics scraping, launching."""

"""The emulated vLLM engine: vLLM's HTTP API, metrics and P/D protocol, timed by core.perf."""

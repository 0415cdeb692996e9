"""Everything that talks to the outside world: vLLM, the emulated engine, the run store."""

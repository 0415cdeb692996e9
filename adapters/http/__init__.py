"""HTTP clients the adapters use on the gateway's hot path."""

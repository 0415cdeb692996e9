"""The HTTP gateway: OpenAI-compatible P/D proxy, control API, Prometheus metrics."""

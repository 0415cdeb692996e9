"""vLLM 0.32's Prometheus metrics (names, labels, buckets) for one emulated instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.emulator.engine import EngineLike, Sequence

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
LONG_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)


class EngineMetrics:
    """A registry per instance; every series carries model_name and engine labels, as vLLM's."""

    def __init__(self, model: str, engine: EngineLike) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        lv = {"model_name": model, "engine": "0"}
        self._lv = lv

        def gauge(name: str, doc: str, fn: object) -> None:
            Gauge(name, doc, labels, registry=r).labels(**lv).set_function(fn)  # type: ignore[arg-type]

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lambda: len(engine.running))
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: engine.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: engine.kv_usage)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r).labels(**lv)
        by_source = Counter("vllm:prompt_tokens_by_source", "Prompt tokens by source.", [*labels, "source"], registry=r)
        self.prompt_local = by_source.labels(**lv, source="local_compute")
        self.prompt_external = by_source.labels(**lv, source="external_kv_transfer")
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r).labels(**lv)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.", [*labels, "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(**lv, finished_reason=reason)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r).labels(**lv)
        self.failed_transfers = Counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV cache transfers.", labels, registry=r).labels(**lv)
        self.expired_kv = Counter("vllm:nixl_num_kv_expired_reqs", "Requests whose held KV expired before it was pulled.", labels, registry=r).labels(**lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LONG_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LONG_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LONG_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LONG_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LONG_BUCKETS)
        self._last_preemptions = 0
        self._engine = engine

    def success(self, reason: str) -> None:
        self._success.labels(**self._lv, finished_reason=reason).inc()

    def step(self, batch: list[Sequence], t: float, n: int) -> None:
        """Per engine step: generated tokens and inter-token latencies."""
        self.generation_tokens.inc(n)
        itl = self.itl
        for s in batch:
            if s.generated > 1 and s.last_token_at is not None and s.prev_token_at is not None:
                itl.observe(s.last_token_at - s.prev_token_at)
        if self._engine.preemptions != self._last_preemptions:
            self.preemptions.inc(self._engine.preemptions - self._last_preemptions)
            self._last_preemptions = self._engine.preemptions

    def finished(self, s: Sequence, arrival: float) -> None:
        """A request's latencies, from its engine timestamps (loop clock)."""
        assert s.finished_at is not None and s.first_token_at is not None and s.admitted_at is not None
        self.ttft.observe(s.first_token_at - arrival)
        self.e2e.observe(s.finished_at - arrival)
        self.queue.observe(s.admitted_at - arrival)
        self.inference.observe(s.finished_at - s.admitted_at)
        self.prefill.observe(s.first_token_at - s.admitted_at)
        self.decode.observe(s.finished_at - s.first_token_at)
        if s.generated > 1:
            self.tpot.observe((s.finished_at - s.first_token_at) / (s.generated - 1))

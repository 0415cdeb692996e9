"""vLLM 0.32's Prometheus metrics (names, labels, buckets) for one emulated instance.

One CollectorRegistry per instance, so several instances in one process stay independent. Every
`vllm:` series carries `model_name` and `engine="0"`. Values come from the engine's own clock:
TTFT and e2e from arrival, queue time from arrival to first scheduling, prefill time from first
scheduling to first token, decode time from first to last token, inter-token latency per token.
Prompt tokens are counted when a request's first token is produced, split by source
(`local_cache_hit` for the prefix found in the instance's own cache, `external_kv_transfer` for KV
pulled from a prefill instance, `local_compute` for the rest); at the same moment, with prefix
caching on, the prefix-cache counters as vLLM counts them at admission: `prefix_cache_queries`
+= prompt tokens, `prefix_cache_hits` += local hits (source "device"), and on a decode leg
`external_prefix_cache_queries` += the tokens not found locally, `external_prefix_cache_hits` +=
those pulled (source "p2p", NixlConnector's). Preempted requests' later lookups are not counted.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adapters.emulator.sequence import Scheduler, Sequence, StepRecord

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
    160,
    640,
    2560,
)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
LONG_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
CACHE_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, … up to `limit`, as vLLM builds its token-count buckets."""
    out: list[float] = []
    mag = 1
    while True:
        for m in (1, 2, 5):
            v = m * mag
            if v > limit:
                return tuple(out)
            out.append(v)
        mag *= 10


def buckets_pow2(limit: int) -> tuple[float, ...]:
    """1, 8, 16, 32, … up to `limit` (vllm:iteration_tokens_total)."""
    out: list[float] = [1]
    v = 8
    while v <= limit:
        out.append(v)
        v *= 2
    return tuple(out)


class EngineMetrics:
    """The instance's registry; the engine's hooks and the HTTP layer feed it."""

    def __init__(self, model: str, engine: Scheduler, max_model_len: int, prefix_caching: bool = False) -> None:
        self.prefix_caching = prefix_caching
        self.registry = r = CollectorRegistry()
        labels = ["model_name", "engine"]
        lv = {"model_name": model, "engine": "0"}

        def gauge(name: str, doc: str, fn: object) -> None:
            Gauge(name, doc, labels, registry=r).labels(**lv).set_function(fn)  # type: ignore[arg-type]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(**lv)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", lambda: len(engine.running)
        )
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: engine.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda: engine.kv_usage)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; 1 marks the current state.",
            [*labels, "sleep_state"],
            registry=r,
        )
        sleep.labels(**lv, sleep_state="awake").set(1)
        sleep.labels(**lv, sleep_state="weights_offloaded").set(0)
        sleep.labels(**lv, sleep_state="discard_all").set(0)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "kv_cache_size_tokens", "enable_prefix_caching", "engine"],
            registry=r,
        )
        info.labels(
            block_size=str(engine.block_size),
            num_gpu_blocks=str(engine.total_blocks),
            kv_cache_size_tokens=str(engine.total_blocks * engine.block_size),
            enable_prefix_caching=str(prefix_caching),
            engine="0",
        ).set(1)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*labels, "source"], registry=r
        )
        self.prompt_local = by_source.labels(**lv, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**lv, source="local_cache_hit")
        self.prompt_external = by_source.labels(**lv, source="external_kv_transfer")
        self.prompt_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        cached_by = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            [*labels, "source"],
            registry=r,
        )
        self.cached_by = {src: cached_by.labels(**lv, source=src) for src in CACHE_SOURCES}
        self.cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.ext_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
        )
        self.ext_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.success_by = {reason: self._success.labels(**lv, finished_reason=reason) for reason in FINISH_REASONS}
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.failed_transfers = counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.")
        self.expired_kv = counter("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire.")

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LONG_BUCKETS
        )
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LONG_BUCKETS
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", LONG_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LONG_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LONG_BUCKETS
        )
        tokens = buckets_1_2_5(max_model_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.req_generation = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.req_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens,
        )
        self.req_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.req_preemptions = hist(
            "vllm:request_num_preemptions", "Number of preemptions per request.", PREEMPTION_BUCKETS
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", buckets_pow2(16384)
        )
        self.xfer_time = hist(
            "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.", TTFT_BUCKETS
        )

        engine.on_step = self.on_step
        engine.on_finish = self.on_finish
        engine.on_preempt = lambda s: self.preemptions.inc()

    def on_step(self, record: StepRecord, sampled: list[Sequence]) -> None:
        """Per engine step: generated tokens, inter-token latencies, first-token prompt counts."""
        self.generation_tokens.inc(len(sampled))
        self.iteration_tokens.observe(record.tokens)
        itl = self.itl.observe
        for s in sampled:
            prev = s.prev_token_at
            if prev is not None and s.last_token_at is not None:
                itl(s.last_token_at - prev)
            elif s.generated == 1:
                self._prompt(s)

    def _prompt(self, s: Sequence) -> None:
        """A request's first token: its prompt tokens by source and its prefix-cache lookup."""
        hit = max(s.cached_tokens, 0)
        ext = s.external_tokens
        self.prompt_tokens.inc(s.prompt_tokens)
        self.prompt_external.inc(ext)
        self.prompt_cache_hit.inc(hit)
        self.prompt_local.inc(max(0, s.prompt_tokens - ext - hit))
        self.prompt_cached.inc(hit + ext)
        if self.prefix_caching and s.cached_tokens >= 0:
            self.cache_queries.inc(s.prompt_tokens)
            self.cache_hits.inc(hit)
            self.cached_by["device"].inc(hit)
        if ext:
            self.ext_queries.inc(s.prompt_tokens - hit)
            self.ext_hits.inc(ext)
            self.cached_by["p2p"].inc(ext)

    def on_finish(self, s: Sequence) -> None:
        """A request left the engine: its outcome and latencies (engine clock)."""
        reason = s.finish_reason or "error"
        if reason == "migrated":
            return  # it finishes on the instance it moved to
        self.success_by[reason].inc()
        if (
            reason in ("abort", "error")
            or s.resumed
            or s.first_token_at is None
            or s.admitted_at is None
            or s.finished_at is None
        ):
            return
        self.ttft.observe(s.first_token_at - s.arrival)
        self.e2e.observe(s.finished_at - s.arrival)
        self.queue.observe(s.admitted_at - s.arrival)
        self.inference.observe(s.finished_at - s.admitted_at)
        self.prefill.observe(s.first_token_at - s.admitted_at)
        self.decode.observe(s.finished_at - s.first_token_at)
        self.req_prompt.observe(s.prompt_tokens)
        # vLLM: the prompt less its cached tokens (local prefix hits and KV pulled through the connector)
        self.req_computed.observe(max(s.prompt_tokens - max(s.cached_tokens, 0) - s.external_tokens, 0))
        self.req_generation.observe(s.generated)
        self.req_preemptions.observe(s.preemptions)
        if s.max_tokens_param:
            self.req_max_tokens.observe(s.max_tokens_param)
        if s.generated > 1:
            self.tpot.observe((s.finished_at - s.first_token_at) / (s.generated - 1))

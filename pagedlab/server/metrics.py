"""What the server exposes at /metrics, in Prometheus' text format.

Three kinds of numbers, each a prometheus_client object on the app's own CollectorRegistry (two
apps in one process -- two test servers -- never share or double-count a metric):

- gauges read at scrape time from the engine: requests running and waiting, KV blocks used and total.
  Each is read from AsyncLLM.stats() when Prometheus asks: the numbers each engine core sent with its
  last step, summed over the cores (data parallelism: one view of every replica).
- counters that only grow: tokens generated and prompted, requests finished by finish_reason,
  preemptions, requests refused with 503. A rate is the counter's slope: tokens/s is
  `rate(pagedlab_generation_tokens_total[1m])` in PromQL.
- histograms of latency: time to first token (from the HTTP request's arrival) and the time between
  tokens (inter-token latency, from the engine's per-token times).

The prefix cache is measured here too: prompt tokens of finished requests taken from the cache
(`pagedlab_prefix_cache_hit_tokens_total / pagedlab_prompt_tokens_total` is the hit rate seen by
clients), and, read off the allocator when it keeps them (`prefix_queries`, `prefix_hits`,
`hit_rate`, `num_cached`), the engine's own count since it started and the blocks kept for reuse.
"""
from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

# seconds; TTFT spans a fast GPU (ms) to a loaded CPU (many s), ITL a GPU step to a CPU step
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# what a prefix-caching allocator keeps (kv_cache.BlockAllocator): metric name -> (attribute, help)
PREFIX_CACHE_GAUGES = {
    "pagedlab_prefix_cache_hit_rate": ("hit_rate", "prompt tokens found in the prefix cache / looked up"),
    "pagedlab_prefix_cache_queried_tokens": ("prefix_queries", "prompt tokens looked up at admission"),
    "pagedlab_prefix_cache_hit_tokens_engine": ("prefix_hits", "of those, tokens found cached"),
    "pagedlab_kv_blocks_cached": ("num_cached", "blocks nobody holds that keep a known prefix"),
}


class ManyHistogram:
    """A Prometheus histogram that takes a request's values in one call. prometheus_client's
    Histogram.observe takes a lock and walks the buckets per value: a finished 144-token stream is
    143 gaps, ~0.1 ms of the front end's one thread per request (py-spy, H200 host, 2026-12-02).
    Here a request's gaps are counted first (bisect, no lock) and added under the lock once."""

    def __init__(self, name: str, doc: str, buckets, registry):
        self.name, self.doc, self.bounds = name, doc, tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)           # the last bucket: above every bound
        self._sum, self._lock = 0.0, threading.Lock()
        registry.register(self)

    def observe_many(self, values) -> None:
        if not values:
            return
        counts, bounds = [0] * len(self._counts), self.bounds
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1        # le: a value on a bound counts in it
        total = float(sum(values))
        with self._lock:
            for i, c in enumerate(counts):
                if c:
                    self._counts[i] += c
            self._sum += total

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cum, buckets = 0, []
        for bound, c in zip((*map(str, self.bounds), "+Inf"), counts):
            cum += c
            buckets.append((bound, cum))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class CoreSilence:
    """pagedlab_core_silent_seconds{core="k"}: seconds since engine core k last answered, read at
    scrape time (AsyncLLM.core_silence). A core that runs answers at least every 0.25 s, idle or
    busy; more than a step's time means it is stopped or stuck (/health: 503 past AsyncLLM.silent_s)."""

    name = "pagedlab_core_silent_seconds"

    def __init__(self, read, registry):
        self.read = read
        registry.register(self)

    def collect(self):
        g = GaugeMetricFamily(self.name, "seconds since the engine core last answered (a running core answers "
                              "every 0.25 s at least; /health turns 503 past the threshold)", labels=["core"])
        for k, seconds in enumerate(self.read()):
            g.add_metric([str(k)], seconds)
        yield g


class ServerMetrics:
    def __init__(self, stats, frontend: dict | None = None, core_silence=None):
        """stats: a function giving the engine's gauges now (AsyncLLM.stats: summed over its cores).
        frontend: which front end answers (index, of, pid; serve --api-servers N): a scrape reaches
        one of them, and says which. core_silence: a function giving each core's seconds since it
        last answered (AsyncLLM.core_silence), shown as pagedlab_core_silent_seconds."""
        self.registry = reg = CollectorRegistry()
        if core_silence is not None:
            CoreSilence(core_silence, reg)
        if frontend is not None:
            Info("pagedlab_frontend", "the front end that answered this scrape (serve --api-servers N: "
                 "each counts its own requests; the engine gauges are the cores', the same on all)",
                 registry=reg).info({k: str(v) for k, v in frontend.items()})
        for name, key, doc in (
                ("pagedlab_requests_running", "running", "requests in a slot (prefilling or decoding)"),
                ("pagedlab_requests_waiting", "waiting", "requests in the engine's queue (new and preempted)"),
                ("pagedlab_kv_blocks_used", "kv_used", "KV cache blocks in use"),
                ("pagedlab_kv_blocks_total", "kv_total", "KV cache blocks in the pool"),
                ("pagedlab_engine_steps", "steps", "engine steps since start (all cores)"),
                ("pagedlab_engine_step_seconds", "step_seconds", "seconds the cores spent in steps since start"),
                ("pagedlab_engine_prompt_steps", "prompt_steps",
                 "of those, steps with prompt tokens in them (run eagerly: CUDA graphs hold decode-only steps)"),
                ("pagedlab_engine_prompt_step_seconds", "prompt_step_seconds", "seconds the cores spent in those"),
                ("pagedlab_engine_step_sequences", "step_sequences",
                 "sequences that got a token, summed over steps (/ steps: the mean decode batch)"),
                ("pagedlab_engine_host_schedule_seconds", "host_schedule_s",
                 "of the steps' seconds: the host scheduling them (engine.PhaseTimer)"),
                ("pagedlab_engine_host_launch_seconds", "host_launch_s",
                 "of the steps' seconds: the host launching them (inputs, kernels or a graph replay)"),
                ("pagedlab_engine_host_read_seconds", "host_read_s",
                 "of the steps' seconds: the host waiting for a step's tokens (the GPU's time it did not hide)"),
                ("pagedlab_engine_host_accept_seconds", "host_accept_s",
                 "of the steps' seconds: the host taking the tokens in (stops, blocks, bookkeeping)"),
                ("pagedlab_engine_host_decode_schedule_seconds", "host_decode_schedule_s",
                 "of those, in decode-only steps (no prompt tokens: a graph replay)"),
                ("pagedlab_engine_host_decode_launch_seconds", "host_decode_launch_s",
                 "of those, in decode-only steps (no prompt tokens: a graph replay)"),
                ("pagedlab_engine_host_decode_read_seconds", "host_decode_read_s",
                 "of those, in decode-only steps (no prompt tokens: a graph replay)"),
                ("pagedlab_engine_host_decode_accept_seconds", "host_decode_accept_s",
                 "of those, in decode-only steps (no prompt tokens: a graph replay)"),
                ("pagedlab_core_idle_seconds", "core_idle_s", "seconds the cores waited for work"),
                ("pagedlab_core_inbox_seconds", "core_inbox_s", "seconds the cores took in requests and aborts"),
                ("pagedlab_core_busy_periods", "busy_periods", "times a core went from idle to work"),
                ("pagedlab_core_busy_start_time", "busy_start_t",
                 "when a core last went from idle to work (time.monotonic of the machine, seconds)"),
                ("pagedlab_core_busy_end_time", "busy_end_t",
                 "when the cores last ran out of work (time.monotonic of the machine, seconds)"),
                ("pagedlab_core_handout_seconds", "core_handout_s", "seconds the cores spent handing out steps"),
                ("pagedlab_frontend_output_seconds", "frontend_output_s",
                 "seconds the front end spent on the cores' step outputs (detokenizing is the callers')"),
                ("pagedlab_frontend_cpu_seconds", "frontend_cpu_s",
                 "CPU seconds (user + system, all threads) of the front-end process that answered this scrape"),
                ("pagedlab_frontend_stall_seconds", "frontend_stall_s",
                 "seconds this front end's event loop stood still (a task that asks to wake every 5 ms: how "
                 "late it woke, summed; pagedlab/loop_watch.py)"),
                ("pagedlab_frontend_long_stalls", "frontend_long_stalls", "of those stalls, the ones >= 50 ms"),
                ("pagedlab_frontend_long_stall_seconds", "frontend_long_stall_s", "their seconds"),
                ("pagedlab_frontend_longest_stall_seconds", "frontend_longest_stall_s",
                 "the longest stall since the front end started"),
                ("pagedlab_frontend_gc_seconds", "frontend_gc_s", "seconds this front end's garbage collector ran"),
                ("pagedlab_frontend_gcs", "frontend_gcs", "its collections"),
                ("pagedlab_frontend_long_gcs", "frontend_long_gcs", "of those, the ones >= 50 ms"),
                ("pagedlab_frontend_long_gc_seconds", "frontend_long_gc_s", "their seconds")):
            Gauge(name, doc, registry=reg).set_function(lambda key=key: stats().get(key, 0))
        if "prefix_queries" in stats():          # only an allocator with a prefix cache has them
            for name, (attr, doc) in PREFIX_CACHE_GAUGES.items():
                Gauge(name, doc, registry=reg).set_function(lambda attr=attr: float(stats().get(attr, 0)))
        self.generation_tokens = Counter("pagedlab_generation_tokens", "tokens generated", registry=reg)
        self.prompt_tokens = Counter("pagedlab_prompt_tokens", "prompt tokens of finished requests",
                                     registry=reg)
        self.prefix_cache_hit_tokens = Counter(
            "pagedlab_prefix_cache_hit_tokens", "prompt tokens found in the prefix cache", registry=reg)
        self.spec_proposed = Counter("pagedlab_spec_proposed_tokens",
                                     "speculative decoding: guessed tokens verified (finished requests)", registry=reg)
        self.spec_accepted = Counter("pagedlab_spec_accepted_tokens",
                                     "speculative decoding: of those, kept (finished requests)", registry=reg)
        self.preemptions = Counter("pagedlab_preemptions", "preemptions of finished requests",
                                   registry=reg)
        self.finished = Counter("pagedlab_requests_finished", "requests finished, by finish_reason",
                                ["finish_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)           # every reason shows, at 0, from the start
        self.rejected = Counter("pagedlab_requests_rejected", "requests refused: the queue was full (503)",
                                registry=reg)
        self.ttft = Histogram("pagedlab_time_to_first_token_seconds",
                              "HTTP request arrival to its first token", buckets=TTFT_BUCKETS, registry=reg)
        self.itl = ManyHistogram("pagedlab_inter_token_latency_seconds", "time between two tokens of a request",
                                 ITL_BUCKETS, reg)

    def on_tokens(self, n: int) -> None:
        if n:
            self.generation_tokens.inc(n)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_finish(self, output) -> None:
        """A stream's last RequestOutput: its finish reason, prompt, preemptions, token gaps."""
        self.finished.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.prefix_cache_hit_tokens.inc(getattr(output, "num_cached_tokens", 0) or 0)
        self.preemptions.inc(output.num_preemptions)
        self.spec_proposed.inc(getattr(output, "num_spec_proposed", 0) or 0)
        self.spec_accepted.inc(getattr(output, "num_spec_accepted", 0) or 0)
        self.itl.observe_many(output.itl_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

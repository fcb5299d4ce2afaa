"""Prometheus metrics of a coordinator, a peer or a pipeline stage.

Nothing on a hot path is instrumented: each collector reads its node's ``status()`` when
Prometheus scrapes, and turns it into metric families. Each node gets a registry of its own
(not the process-wide default), so several nodes in one process never clash.

Every series is prefixed ``swarmtrain_``; the full list is in docs/operations.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "STALENESS_BUCKETS", "CoordinatorCollector", "HttpCollector", "PeerCollector",
           "StageCollector", "StatusCollector", "registry_for", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
F = TypeVar("F", CounterMetricFamily, GaugeMetricFamily)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
"""Upper bounds (versions behind) of the staleness histogram's buckets; +Inf is added."""

Status = Callable[[], Mapping[str, Any]]


def _num(value: Any) -> float:
    """A status value as a float (None, missing or non-numeric -> NaN)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return math.nan


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"swarmtrain_{name}", doc, value=_num(value))


def _counter(name: str, doc: str, value: Any) -> CounterMetricFamily:
    return CounterMetricFamily(f"swarmtrain_{name}", doc, value=_num(value))


def _by_label(family: type[F], name: str, doc: str, label: str, values: Mapping[str, Any] | None) -> F:
    """``swarmtrain_NAME{label=key}`` = value for each item of ``values``, sorted by key."""
    fam = family(f"swarmtrain_{name}", doc, labels=[label])
    for key, n in sorted(dict(values or {}).items()):
        fam.add_metric([str(key)], _num(n))
    return fam


def _refusals(st: Mapping[str, Any]) -> CounterMetricFamily:
    """``swarmtrain_refusals_total{reason=...}``: everything the node refused, by reason code
    (the status's ``refusals``, whose reasons are bounded by
    :class:`~swarmtrain.transport.refusals.RefusalCounter`)."""
    return _by_label(CounterMetricFamily, "refusals", "connections and messages refused, by reason "
                     "(handshake codes, connection caps, TLS, malformed frames, bad messages)",
                     "reason", st.get("refusals"))


def _heldout(st: Mapping[str, Any]) -> GaugeMetricFamily:
    return _by_label(GaugeMetricFamily, "heldout_metric", "latest held-out evaluation", "metric",
                     st.get("metrics"))


class StatusCollector(Collector):
    """Base of the collectors: reads ``status()`` once per scrape.

    Args:
        status: the node's status function (called on the scraping thread).
    """

    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        yield from self.families(self.status())

    def families(self, st: Mapping[str, Any]) -> Iterator[Metric]:
        raise NotImplementedError


class CoordinatorCollector(StatusCollector):
    """Series of a parameter-server coordinator (``Coordinator.status``)."""

    def families(self, st: Mapping[str, Any]) -> Iterator[Metric]:
        yield _gauge("version", "model version: optimizer updates applied so far", st.get("version"))
        yield _gauge("step", "training step (equals the version for a coordinator)", st.get("step"))
        yield _gauge("loss", "training loss (moving average over applied gradients)", st.get("loss"))
        yield _heldout(st)
        yield _gauge("running", "1 while training runs (enough workers joined)", st.get("running"))
        yield _gauge("paused", "1 while the cluster is paused", st.get("paused"))
        yield _gauge("workers_connected", "workers connected now", st.get("workers_connected"))
        yield _gauge("uptime_seconds", "seconds since the coordinator started", st.get("uptime_sec"))
        stats = dict(st.get("stats") or {})
        grads = CounterMetricFamily("swarmtrain_gradients", "gradients received, by outcome",
                                    labels=["outcome"])
        for outcome, key in (("applied", "applied"), ("stale", "stale"), ("duplicate", "duplicates"),
                             ("rejected", "rejected")):
            grads.add_metric([outcome], _num(stats.get(key, 0)))
        yield grads
        yield _counter("refused_messages", "gradients refused (non-finite, outlier, malformed...)",
                       stats.get("rejected", 0))
        yield _counter("held_variance_steps", "top-k gradients applied with Adam's second moment "
                       "held (sparse_variance = hold)", st.get("held_variance_steps", 0))
        yield from _worker_families(list(st.get("workers") or []))
        yield _staleness(dict(st.get("staleness_counts") or {}))
        yield from _downlink(dict(st.get("downlink") or {}))
        yield from _admission(dict(st.get("admission") or {}))
        yield from _memory(dict(st.get("memory") or {}))
        yield from _traffic(dict(st.get("traffic") or {}))
        yield _refusals(st)


def _downlink(d: Mapping[str, Any]) -> Iterator[Metric]:
    """The shared downlink: what its log holds, how far the published copy is, what went out."""
    yield _gauge("downlink_log_bytes", "bytes the downlink's update log holds", d.get("log_bytes", 0))
    yield _gauge("downlink_drift", "relative L2 distance of the published weights from the master",
                 d.get("drift", 0.0))
    yield _counter("downlink_resets", "restarts of the published track (every worker then gets the "
                   "full weights)", d.get("resets", 0))
    yield _by_label(CounterMetricFamily, "downlink_answers", "answers to gradients, by what they "
                    "carried (chain of log entries, full weights, nothing new; withheld: the weights "
                    "were due, but as many copies as answers may hold were held)", "kind", d.get("answers"))


def _memory(d: Mapping[str, Any]) -> Iterator[Metric]:
    """Freed memory malloc holds, and what the coordinator gave back (hardware.FreedMemory)."""
    if d.get("allocator_free_mb") is not None:
        yield _gauge("allocator_free_bytes", "bytes malloc holds free (resident or given back)",
                     d["allocator_free_mb"] * 2**20)
    yield _counter("memory_released_bytes", "resident bytes of freed memory given back to the "
                   "system after bursts (many workers joining at once)", d.get("released_mb", 0) * 2**20)


def _admission(d: Mapping[str, Any]) -> Iterator[Metric]:
    """The bound on gradients received and not yet applied (network.max_held_gradient_mb)."""
    yield _gauge("gradient_bytes_held", "gradient bytes received and not yet applied, all workers",
                 d.get("held_bytes", 0))
    yield _gauge("gradient_bytes_held_peak", "most gradient bytes held at once so far (at most "
                 "max_held_gradient_mb, or one larger gradient alone)", d.get("peak_held_bytes", 0))
    yield _counter("gradients_waited_for_room", "gradients whose bytes waited in the network "
                   "buffers until the coordinator had room for them", d.get("waited", 0))


def _worker_families(workers: list[Mapping[str, Any]]) -> Iterator[Metric]:
    labels = ["worker", "profile"]
    gauges = {key: GaugeMetricFamily(f"swarmtrain_worker_{name}", doc, labels=labels)
              for key, name, doc in (
                  ("samples_per_sec", "samples_per_second", "samples per second applied from the worker"),
                  ("share", "share", "fraction of all applied samples that came from the worker"),
                  ("avg_staleness", "avg_staleness", "mean staleness (versions) of its applied gradients"),
                  ("last_seen_sec", "last_seen_seconds", "seconds since the worker was last heard from"),
                  ("connected", "connected", "1 while the worker is connected"),
                  ("loss", "loss", "loss of the worker's last gradient"))}
    counters = {key: CounterMetricFamily(f"swarmtrain_worker_{name}", doc, labels=labels)
                for key, name, doc in (
                    ("steps", "steps", "gradients of the worker applied"),
                    ("samples", "samples", "samples in the worker's applied gradients"),
                    ("stale", "stale", "gradients of the worker dropped as too stale"),
                    ("rejected", "rejected", "gradients of the worker refused"))}
    for w in workers:
        values = [str(w.get("id", "?")), str(w.get("profile", "?"))]
        for key, fam in gauges.items():
            fam.add_metric(values, _num(w.get(key)))
        for key, cfam in counters.items():
            cfam.add_metric(values, _num(w.get(key, 0)))
    yield from gauges.values()
    yield from counters.values()


def _staleness(counts: Mapping[str, Any]) -> HistogramMetricFamily:
    """Cumulative buckets over the applied gradients' staleness (versions behind)."""
    by_value = {int(k): int(v) for k, v in counts.items()}
    buckets = [(str(bound), float(sum(n for s, n in by_value.items() if s <= bound)))
               for bound in STALENESS_BUCKETS]
    total = sum(by_value.values())
    buckets.append(("+Inf", float(total)))
    return HistogramMetricFamily(
        "swarmtrain_gradient_staleness", "staleness (versions behind) of applied gradients",
        buckets=buckets, sum_value=float(sum(s * n for s, n in by_value.items())))


def _traffic(traffic: Mapping[str, Mapping[str, Any]]) -> Iterator[Metric]:
    for key, name, doc in (
            ("bytes_in", "received_bytes", "bytes of frames received, by message type"),
            ("bytes_out", "sent_bytes", "bytes of frames sent, by message type"),
            ("messages_in", "received_messages", "frames received, by message type"),
            ("messages_out", "sent_messages", "frames sent, by message type")):
        fam = CounterMetricFamily(f"swarmtrain_{name}", doc, labels=["type"])
        for mtype, value in sorted(dict(traffic.get(key) or {}).items()):
            fam.add_metric([str(mtype)], _num(value))
        yield fam


class PeerCollector(StatusCollector):
    """Series of a peer (``PeerTrainer.status`` or ``PeerBackend.status``)."""

    def families(self, st: Mapping[str, Any]) -> Iterator[Metric]:
        yield _gauge("epoch", "membership epoch (increases when peers join or leave)", st.get("epoch"))
        yield _gauge("world_size", "peers in the current epoch", st.get("world_size"))
        yield _gauge("rank", "this peer's rank in the current epoch (-1 before the first)",
                     st.get("rank", -1))
        yield _counter("rounds", "averaging rounds completed", st.get("rounds"))
        yield _gauge("step", "averaging rounds completed (the peer's step)",
                     st.get("round", st.get("rounds")))
        yield _gauge("loss", "training loss of the last round", st.get("loss"))
        yield _counter("samples", "samples trained on by this peer", st.get("samples", 0))
        yield _heldout(st)
        yield _counter("collective_sent_bytes", "bytes sent by all-reduce and broadcast",
                       st.get("bytes_sent"))
        yield _counter("collective_received_bytes", "bytes received by all-reduce and broadcast",
                       st.get("bytes_received"))
        yield from _traffic(dict(st.get("traffic") or {}))
        yield _counter("nonfinite_local", "rounds whose own contribution was NaN/Inf (sent as zero weight)",
                       st.get("nonfinite_local", 0))
        yield _counter("rounds_refused", "rounds whose average was NaN/Inf and was not applied",
                       st.get("rounds_refused", 0))
        refused = CounterMetricFamily("swarmtrain_refused_connections",
                                      "connections turned away, by listener and reason",
                                      labels=["listener", "reason"])
        failed = CounterMetricFamily("swarmtrain_listener_failed_handshakes",
                                     "failed handshakes, by listener", labels=["listener"])
        for listener in ("control", "ring"):
            for reason, n in sorted(dict(st.get(f"{listener}_refused") or {}).items()):
                refused.add_metric([listener, str(reason)], _num(n))
            failed.add_metric([listener], _num(st.get(f"{listener}_failed_handshakes", 0)))
        yield refused
        yield failed
        yield _refusals(st)


class StageCollector(StatusCollector):
    """Series of a pipeline stage (``StageServer.status``)."""

    def families(self, st: Mapping[str, Any]) -> Iterator[Metric]:
        yield _counter("stage_steps", "optimizer steps of the stage", st.get("steps"))
        yield _gauge("step", "optimizer steps of the stage", st.get("steps"))
        yield _counter("stage_microbatches", "micro-batches trained (backward passes)",
                       st.get("microbatches"))
        yield _counter("stage_forwards", "forward passes", st.get("forwards"))
        yield _counter("stage_inferences", "inference requests answered", st.get("inferences"))
        yield _counter("refused_messages", "work refused because the inbound buffer was full",
                       st.get("refused"))
        yield _counter("failed_handshakes", "connections that failed the handshake",
                       st.get("failed_handshakes"))
        yield _counter("sync_rounds", "parameter averages with replicas", st.get("sync_rounds"))
        yield _counter("bad_input", "requests refused for what they carried (all senders)",
                       st.get("bad_input", 0))
        yield _counter("sender_disconnects", "connections closed after max_bad_in_row refusals in a row",
                       st.get("sender_disconnects", 0))
        labels = ["buffer"]
        fill = GaugeMetricFamily("swarmtrain_buffer_fill", "buffer fill (size / capacity)", labels=labels)
        size = GaugeMetricFamily("swarmtrain_buffer_size", "packets held now", labels=labels)
        packets_in = CounterMetricFamily("swarmtrain_buffer_packets_in", "packets accepted", labels=labels)
        packets_out = CounterMetricFamily("swarmtrain_buffer_packets_out", "packets handed on (sent)",
                                          labels=labels)
        dropped = CounterMetricFamily("swarmtrain_buffer_dropped", "packets discarded or given up on",
                                      labels=labels)
        refused = CounterMetricFamily("swarmtrain_buffer_refused", "packets refused because it was full",
                                      labels=labels)
        for name in ("inbound", "infer_inbound"):
            m = dict(st.get(name) or {})
            fill.add_metric([name], _num(m.get("fill")))
            size.add_metric([name], _num(m.get("size")))
            packets_in.add_metric([name], _num(m.get("packets_in")))
            packets_out.add_metric([name], _num(m.get("packets_out")))
            dropped.add_metric([name], _num(m.get("dropped")))
            refused.add_metric([name], _num(m.get("rejected")))
        out = dict(st.get("outbound") or {})
        fill.add_metric(["outbound"], _num(out.get("fill")))
        size.add_metric(["outbound"], _num(out.get("size")))
        packets_out.add_metric(["outbound"], _num(out.get("sent")))
        dropped.add_metric(["outbound"], _num(out.get("failed")))
        refused.add_metric(["outbound"], _num(out.get("refused")))
        yield from (fill, size, packets_in, packets_out, dropped, refused)
        yield from _traffic(dict(st.get("traffic") or {}))
        yield _refusals(st)


class HttpCollector(Collector):
    """``swarmtrain_http_responses_total{code=...}``: the answers of the node's HTTP port by
    status code (``503``: busy; ``400``, ``408``, ``414``, ``431``: bad requests).

    Args:
        answered: the server's count of answers by status code (read on its own thread).
    """

    def __init__(self, answered: Mapping[int, int]) -> None:
        self.answered = answered

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("swarmtrain_http_responses", "answers of the ops HTTP port, by "
                                  "status code (503: busy)", labels=["code"])
        for code, n in sorted(dict(self.answered).items()):
            fam.add_metric([str(code)], _num(n))
        yield fam


def registry_for(collector: Collector, *more: Collector) -> CollectorRegistry:
    """A registry of its own holding just ``collector`` (and ``more``)."""
    registry = CollectorRegistry(auto_describe=False)
    for c in (collector, *more):
        registry.register(c)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format (version 0.0.4)."""
    return generate_latest(registry)

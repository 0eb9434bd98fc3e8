"""Scrape-time gauges an inference gateway's router reads, under edgemoe's names and vLLM's.

Gateways that load-balance a fleet of model servers (the Kubernetes Gateway API inference extension's
endpoint picker, llm-d, ...) pick a server by its queue and KV-cache use, read from ``/metrics`` under
vLLM's names. :class:`GatewayCollector` exposes, read from the engine at scrape time:

=================================== ================================================================
``edgemoe_kv_cache_pages_used``     KV pages held by requests in flight
``edgemoe_kv_cache_pages_total``    KV pages requests can hold
``vllm:num_requests_running``       = ``edgemoe_num_requests_running`` (requests prefilling or decoding)
``vllm:num_requests_waiting``       = ``edgemoe_num_requests_waiting`` (requests queued)
``vllm:kv_cache_usage_perc``        used / total pages, a fraction in [0, 1] (vLLM's name and unit)
``vllm:gpu_cache_usage_perc``       the same, under vLLM's older name
``vllm:cache_config_info``          1, labelled with ``block_size`` (tokens per page) and ``num_gpu_blocks``
=================================== ================================================================

The ``vllm:`` families carry a ``model_name`` label (the first served name), as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from edgemoe.engine.async_engine import AsyncLLM

__all__ = ["GatewayCollector", "gateway_registry"]


class GatewayCollector:
    """The gauges of the module doc, read from ``llm`` at each scrape.

    Args:
        llm: the engine (nothing is exposed but the request gauges while it loads).
        model_name: the ``model_name`` label of the ``vllm:`` families.
    """

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm, self.model_name = llm, model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels, value = ["model_name"], [self.model_name]
        for name, doc, n in (
            ("vllm:num_requests_running", "Requests being prefilled or decoded", self.llm.num_running),
            ("vllm:num_requests_waiting", "Requests queued for admission", self.llm.num_waiting),
        ):
            fam = GaugeMetricFamily(name, doc, labels=labels)
            fam.add_metric(value, n)
            yield fam
        pages = self.llm.kv_cache_pages
        if pages is None:
            return
        used, total = pages
        yield GaugeMetricFamily("edgemoe_kv_cache_pages_used", "KV-cache pages held by requests in flight", value=used)
        yield GaugeMetricFamily("edgemoe_kv_cache_pages_total", "KV-cache pages requests can hold", value=total)
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            fam = GaugeMetricFamily(name, "KV-cache usage: used / total pages (1 = full)", labels=labels)
            fam.add_metric(value, used / total if total else 0.0)
            yield fam
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache geometry (value 1)",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(self.llm.engine.runner.engine_config.page_size), str(total)], 1)
        yield info


def gateway_registry(llm: AsyncLLM, model_name: str) -> CollectorRegistry:
    """A registry holding one :class:`GatewayCollector` (rendered after the engine's own registry)."""
    registry = CollectorRegistry()
    registry.register(GatewayCollector(llm, model_name))
    return registry


"""/metrics on a port of its own (ELMO_METRICS_PORT, as text-embeddings-inference's --prometheus-port), without API
keys: Prometheus scrapes it as the Kubernetes annotations say, while every route of the main port stays behind
the keys. prometheus_client's own small threaded server, in the background: it answers during start-up and a
drain too. It is meant for the cluster's network (the Service does not expose it): it has none of the main
port's bounds on slow or idle connections."""

from __future__ import annotations

from prometheus_client import start_http_server
from prometheus_client.registry import Collector

from service.api.health import observe_queues


class _Scraped(Collector):
    """The app's registry, read after the gauges that a scrape sets (the queues)."""

    def __init__(self, app):
        self.app = app

    def _registry(self):
        observe_queues(self.app)
        return self.app.state.runtime.metrics.registry

    def collect(self):
        return self._registry().collect()

    def restricted_registry(self, names):  # ?name[]=...
        return self._registry().restricted_registry(names)


def serve_metrics(app, host: str, port: int):
    """Serve the app's metrics on host:port until the process ends; the server (its `shutdown()` stops it)."""
    server, _ = start_http_server(port, addr=host, registry=_Scraped(app))
    return server

"""Who calls, and a Prometheus endpoint: what every service may have besides its API.

`cluster_peer` names the part of the cluster behind a call that came with a client
certificate (mutual TLS: `tls_client_ca` or the `cluster_listen` port), or None. The metrics
endpoint is off unless `metrics_listen` is set, and costs nothing then; services define their
metrics with `prometheus_client` in the default registry and the endpoint serves what is there.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import start_http_server

from runtime.validate import parse_host_port

__all__ = ["METRICS_PREFIX", "MetricsEndpoint", "cluster_peer"]

METRICS_PREFIX = "NONOMAD_METRICS"
"""Printed as `NONOMAD_METRICS <service> <host:port>` once the metrics endpoint listens."""


def cluster_peer(context: Any) -> str | None:
    """The common name of the certificate the caller presented, or None without one.

    Only a listener with mutual TLS asks for client certificates, and it accepts only those
    its CA signed, so a name here is a verified member of the cluster.
    """
    auth = context.auth_context()
    if not auth.get("x509_pem_cert"):
        return None
    names = auth.get("x509_common_name") or [b"(no common name)"]
    return bytes(names[0]).decode(errors="replace")


class MetricsEndpoint:
    """Prometheus text format at `http://<address>/metrics`, served from a daemon thread."""

    def __init__(self, listen: str) -> None:
        host, port = parse_host_port(listen)
        self._server, self._thread = start_http_server(port, addr=host)
        bound = self._server.server_port
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        thread: threading.Thread = self._thread
        thread.join(timeout=5)

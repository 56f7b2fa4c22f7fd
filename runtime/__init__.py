"""The ground floor every service stands on (the machine model, `model`, above it; flyd,
registry, flaps, proxy above that; nonomad and bench on top); it imports none of them.

Its modules: server bootstrap and lifecycle, where each service's errors become statuses
through its own `map_error` (`server`), settings (`settings`), JSON logs (`logs`), tracing and
client channels (`tracing`), who calls and the metrics endpoint (`endpoints`), the injected
clock (`clock`), request bounds and field validation (`limits`, `validate`, `errors`), the
cluster's certificates and their roles (`pki`), which role may call which RPC of a service
(`access`), the collector kept off the event loop (`heap`) and how late the loop runs
(`looplag`).

A service's entry point loads its `ServiceSettings` subclass with `settings_or_exit`, calls
`configure_logging` and `setup_tracing`, builds a `Service`, and hands it to `main_entry`.
Clients open channels with `aio_channel` so trace context crosses every hop.
"""

from runtime.endpoints import METRICS_PREFIX, MetricsEndpoint, cluster_peer
from runtime.logs import configure_logging
from runtime.server import (
    CLUSTER_PREFIX,
    READY_PREFIX,
    ErrorMapper,
    Mapped,
    Service,
    abort_with_details,
    error_info,
    main_entry,
    read_announcements,
    register,
    server_options,
    time_left,
    use_event_loop,
    wrap_servicer,
)
from runtime.settings import (
    ServiceSettings,
    SettingsError,
    load_settings,
    parse_host_port,
    settings_or_exit,
)
from runtime.tracing import (
    CLUSTER_NAME,
    DEFAULT_CHANNEL_OPTIONS,
    ChannelOption,
    ChannelTLS,
    aio_channel,
    client_interceptors,
    server_interceptors,
    setup_tracing,
    shutdown_tracing,
    tracing_enabled,
    tracing_requested,
)

__all__ = [
    "CLUSTER_NAME",
    "CLUSTER_PREFIX",
    "DEFAULT_CHANNEL_OPTIONS",
    "METRICS_PREFIX",
    "READY_PREFIX",
    "ChannelOption",
    "ChannelTLS",
    "ErrorMapper",
    "Mapped",
    "MetricsEndpoint",
    "Service",
    "ServiceSettings",
    "SettingsError",
    "abort_with_details",
    "aio_channel",
    "client_interceptors",
    "cluster_peer",
    "configure_logging",
    "error_info",
    "load_settings",
    "main_entry",
    "parse_host_port",
    "read_announcements",
    "register",
    "server_interceptors",
    "server_options",
    "settings_or_exit",
    "setup_tracing",
    "shutdown_tracing",
    "time_left",
    "tracing_enabled",
    "tracing_requested",
    "use_event_loop",
    "wrap_servicer",
]

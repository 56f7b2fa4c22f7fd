"""The ground floor every service stands on (the machine model, `model`, above it; flyd,
registry, flaps, proxy above that; nonomad and bench on top); it imports none of them.

Its modules: server bootstrap and lifecycle, where each service's errors become statuses
through its own `map_error` (`server`), the ErrorInfo a failed call carries (`status`),
settings (`settings`), JSON logs (`logs`), tracing and client channels (`tracing`), who calls
and the metrics endpoint (`endpoints`), the injected clock (`clock`), request bounds and field
validation (`limits`, `validate`, `errors`), the cluster's certificates and their roles
(`pki`), which role may call which RPC of a service (`access`), the collector kept off the
event loop (`heap`) and how late the loop runs (`looplag`).

A service's entry point loads its `ServiceSettings` subclass with `settings_or_exit`, calls
`configure_logging` and `setup_tracing`, builds a `Service`, and hands it to `main_entry`.
Clients open channels with `aio_channel` so trace context crosses every hop.

The names below load on first use (PEP 562): `import runtime.validate` from the CLI must not pay
for the server, settings and pydantic (~0.4 s of imports on every command).
"""

# ruff: noqa: F401 - the imports below are for type checkers only; __getattr__ serves them

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.endpoints import (
        METRICS_PREFIX,
        MetricsEndpoint,
        cluster_peer,
    )
    from runtime.logs import (
        configure_logging,
    )
    from runtime.server import (
        CLUSTER_PREFIX,
        READY_PREFIX,
        ErrorMapper,
        Mapped,
        Service,
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
        settings_or_exit,
    )
    from runtime.status import abort_with_details, error_info
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
    from runtime.validate import parse_host_port

_HOMES: dict[str, tuple[str, ...]] = {
    "runtime.endpoints": (
        "METRICS_PREFIX",
        "MetricsEndpoint",
        "cluster_peer",
    ),
    "runtime.logs": ("configure_logging",),
    "runtime.server": (
        "CLUSTER_PREFIX",
        "READY_PREFIX",
        "ErrorMapper",
        "Mapped",
        "Service",
        "main_entry",
        "read_announcements",
        "register",
        "server_options",
        "time_left",
        "use_event_loop",
        "wrap_servicer",
    ),
    "runtime.settings": (
        "ServiceSettings",
        "SettingsError",
        "load_settings",
        "settings_or_exit",
    ),
    "runtime.status": ("abort_with_details", "error_info"),
    "runtime.validate": ("parse_host_port",),
    "runtime.tracing": (
        "CLUSTER_NAME",
        "DEFAULT_CHANNEL_OPTIONS",
        "ChannelOption",
        "ChannelTLS",
        "aio_channel",
        "client_interceptors",
        "server_interceptors",
        "setup_tracing",
        "shutdown_tracing",
        "tracing_enabled",
        "tracing_requested",
    ),
}
"""Where each public name lives, by module."""

_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_HOME_OF)


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME_OF})

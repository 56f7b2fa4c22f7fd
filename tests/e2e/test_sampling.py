"""The sampler comes from the standard `OTEL_TRACES_SAMPLER(_ARG)` environment, as the SDK reads
it: a real flaps process is called with grpcurl, with a sampled W3C `traceparent`, with an
unsampled one and with none, and a graceful stop flushes whatever it kept to the receiver."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.e2e.otlp import OtlpReceiver, SpanKind
from tests.harness import ServiceProcess, clean_env, grpcurl

RPC = "flaps.v1.PlatformService/ListRegions"


def call(address: str, traceparent: str | None) -> None:
    headers = ["-H", f"traceparent: {traceparent}"] if traceparent else []
    result = grpcurl("-plaintext", *headers, "-d", "{}", address, RPC)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {}  # no workers, no regions


@pytest.mark.parametrize(
    ("sampler", "arg", "exported"),
    [
        ("always_on", None, {"sampled parent", "unsampled parent", "no parent"}),
        ("always_off", None, set()),
        # Parent-based: a remote parent's decision is followed; the ratio decides for roots.
        ("parentbased_traceidratio", "0", {"sampled parent"}),
        ("parentbased_traceidratio", "1", {"sampled parent", "no parent"}),
        ("parentbased_always_off", None, {"sampled parent"}),
    ],
)
def test_the_sampler_is_read_from_the_environment(
    tmp_path: Path, otlp: OtlpReceiver, sampler: str, arg: str | None, exported: set[str]
) -> None:
    settings = {"OTEL_TRACES_SAMPLER": sampler}
    if arg is not None:
        settings["OTEL_TRACES_SAMPLER_ARG"] = arg
    flaps = ServiceProcess(
        "flaps",
        ["--listen", "127.0.0.1:0", "--grace-period", "2"],
        tmp_path / "flaps.log",
        env=clean_env(**otlp.env(**settings)),
    ).start()
    parents = {
        "sampled parent": (secrets.token_hex(16), secrets.token_hex(8), "01"),
        "unsampled parent": (secrets.token_hex(16), secrets.token_hex(8), "00"),
    }
    try:
        for trace_id, span_id, flags in parents.values():
            call(flaps.address, f"00-{trace_id}-{span_id}-{flags}")
        call(flaps.address, None)
    finally:
        assert flaps.terminate() == 0  # a graceful stop exports every span it kept

    by_trace = {trace_id: (name, span_id) for name, (trace_id, span_id, _) in parents.items()}
    seen: set[str] = set()
    for span in otlp.spans:
        assert (span.name, span.kind) == (f"/{RPC}", SpanKind.SPAN_KIND_SERVER), span
        assert span.service == "flaps"
        name, parent_id = by_trace.get(span.trace_id, ("no parent", ""))
        assert span.parent_span_id == parent_id  # a child of the caller's span, or a root
        assert name not in seen
        seen.add(name)
    assert seen == exported
    if not exported:
        assert otlp.exports == 0  # nothing at all went out

"""runtime.limits: every field of a request bounded, the first one over named with its bound."""

from __future__ import annotations

import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from flyd.v1 import machine_pb2 as pb
from flyd.v1 import worker_pb2 as w
from model.validate import CONFIG_LIMITS
from runtime.errors import InvalidArgument
from runtime.limits import DEFAULT_LIMITS, Limits, check

LIMITS = DEFAULT_LIMITS.merged(CONFIG_LIMITS)


def request(**config: object) -> w.CreateMachineRequest:
    return w.CreateMachineRequest(app="web", config=pb.MachineConfig(image="app:v1", **config))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            w.GetMachineRequest(machine_id="m" * 1025),
            "machine_id: at most 1024 characters, got 1025",
        ),
        (request(cmd=["a"] * 257), "config.cmd: at most 256 entries, got 257"),
        (request(cmd=["ok", "a" * 4097]), "config.cmd[1]: at most 4096 characters, got 4097"),
        (request(env={"K" * 257: "v"}), "config.env key: at most 256 characters, got 257"),
        (request(env={"KEY": "v" * 4097}), "config.env['KEY']: at most 4096 characters, got 4097"),
        (
            request(checks=[pb.CheckConfig(http=pb.HttpCheck(method="G" * 17))]),
            "config.checks[0].http.method: at most 16 characters, got 17",
        ),
        (request(metadata={str(i): "v" for i in range(65)}), "config.metadata: at most 64 entries"),
        (
            request(env={f"K{i}": "v" * 4000 for i in range(20)}),
            "config: at most 65536 bytes encoded",
        ),
        # Decodes, but no conversion takes it (flaps' forwarding raised on it: INTERNAL).
        (
            w.StopMachineRequest(timeout=Duration(seconds=-(2**63))),
            "timeout: not a valid Duration: out of its range",
        ),
        (
            w.StopMachineRequest(timeout=Duration(seconds=1, nanos=-1)),
            "timeout: not a valid Duration",
        ),
        (
            pb.Machine(created_at=Timestamp(seconds=2**62)),
            "created_at: not a valid Timestamp: out of its range",
        ),
    ],
)
def test_the_first_field_over_its_bound_is_named_with_the_bound(
    message: Message, error: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check(message, LIMITS)
    assert str(caught.value).startswith(error)
    assert len(str(caught.value)) < 120  # nothing of the value itself


def test_a_request_within_its_bounds_passes() -> None:
    check(request(cmd=["a" * 4096] * 10, env={"K": "v" * 4096}), LIMITS)


def test_bounds_of_a_type_apply_wherever_it_appears() -> None:
    nested = Limits(texts={"flyd.v1.GuestConfig.disk_mib": 1}, counts={"flyd.v1.Machine.ports": 1})
    machine = pb.Machine(ports=[pb.PortMapping(), pb.PortMapping()])
    with pytest.raises(InvalidArgument, match=r"^ports: at most 1 entries, got 2"):
        check(machine, nested)

"""The wire contract: every proto file of the project and every service they declare."""

from __future__ import annotations

from google.protobuf.descriptor import FileDescriptor, ServiceDescriptor

from flaps.v1 import machines_pb2, platform_pb2, tokens_pb2
from flyd.v1 import worker_pb2
from proxy.v1 import proxy_pb2
from registry.v1 import registry_pb2

PROTO_FILES: list[FileDescriptor] = [
    worker_pb2.DESCRIPTOR,
    machines_pb2.DESCRIPTOR,
    platform_pb2.DESCRIPTOR,
    tokens_pb2.DESCRIPTOR,
    proxy_pb2.DESCRIPTOR,
    registry_pb2.DESCRIPTOR,
]

SERVICES: list[ServiceDescriptor] = [
    service for file in PROTO_FILES for service in file.services_by_name.values()
]

"""The google.rpc status a failed call carries: the ErrorInfo a caller reads from it, and the
details a handler ends a call with (in the standard `grpc-status-details-bin` trailer).

Apart from the server so a client (the CLI) reads reasons without loading the server's stack.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    """The google.rpc.ErrorInfo a failed call's status carries (the reason), or None."""
    status = rpc_status.from_call(err)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    return None


async def abort_with_details(
    context: Any, code: grpc.StatusCode, message: str, *details: Message
) -> NoReturn:
    """End the call with `code` and `message`, and `details` (google.rpc messages such as
    ErrorInfo) in the standard `grpc-status-details-bin` trailer. Through `context.abort`, not
    `abort_with_status`: interceptors (tracing) see the code only from `abort`."""
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    status = rpc_status.to_status(
        status_pb2.Status(code=code.value[0], message=message, details=packed)
    )
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises

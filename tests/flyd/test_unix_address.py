"""netd's control socket under a deep data dir: a path longer than a unix socket address holds
(108 bytes) is reached through a descriptor of its directory, by netd binding and flyd calling."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from flyd.drivers.netd import UNIX_PATH_MAX, unix_address


@pytest.mark.parametrize("depth", [1, 12])
def test_a_socket_is_bound_and_reached_however_deep_its_directory(
    tmp_path: Path, depth: int
) -> None:
    directory = tmp_path.joinpath(*["d" * 10] * depth)
    directory.mkdir(parents=True)
    path = str(directory / ".netd.sock")
    assert (len(path) > UNIX_PATH_MAX) == (depth > 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        with unix_address(path) as address:
            server.bind(address)
        server.listen(1)
        assert (directory / ".netd.sock").is_socket()  # where it was asked to be
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as client:
            with unix_address(path) as address:
                client.connect(address)
            conn, _ = server.accept()
            with conn:
                client.send(b"ping")
                assert conn.recv(8) == b"ping"

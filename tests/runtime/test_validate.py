"""The shared field checks (runtime.validate): whole-string matches, short error texts."""

from __future__ import annotations

import re

import pytest

from flyd.v1 import machine_pb2 as pb
from registry.errors import InvalidArgument as RegistryInvalid
from registry.view import check_worker_info
from runtime.errors import InvalidArgument
from runtime.validate import check_name, is_boot_id, is_name, parse_host_port, quote


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("x", True),
        ("web-1", True),
        ("a" * 63, True),
        ("x\n", False),  # `re.match` with `$` let this one in (issue 19, defect 2)
        ("fzmid\n", False),
        ("\nx", False),
        ("a" * 64, False),
        ("-x", False),
        ("x-", False),
        ("Web", False),
        ("", False),
    ],
)
def test_a_name_is_matched_whole(value: str, valid: bool) -> None:
    assert is_name(value) is valid


@pytest.mark.parametrize(
    ("value", "valid"),
    [("", True), ("a1b2.c_d-e", True), ("b" * 64, True), ("boot\n", False), ("b" * 65, False)],
)
def test_a_boot_id_is_matched_whole(value: str, valid: bool) -> None:
    assert is_boot_id(value) is valid


def test_a_worker_whose_boot_id_ends_in_a_newline_is_refused() -> None:
    info = pb.WorkerInfo(id="w1", region="ams", address="127.0.0.1:5000", boot_id="b1\n")
    with pytest.raises(RegistryInvalid, match=r"worker\.boot_id"):
        check_worker_info(info)
    info.boot_id = "b1"
    check_worker_info(info)


def test_an_error_quotes_a_short_prefix_of_a_huge_value() -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_name("app", "a" * 2**20)
    text = str(caught.value)
    assert len(text) < 200
    assert "(1048576 chars)" in text
    assert quote("short") == "'short'"


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("h" * 1024, "expected host:port, got 'hhhh"),
        ("[::1" + "1" * 1024 + "]:x", "port must be a number, got 'x'"),
        ("127.0.0.1:" + "x" * 1024, "port must be a number, got 'xxxx"),
        ("127.0.0.1:" + "9" * 5000, "port must be in 0..65535, got '9999"),  # never int()ed
        ("127.0.0.1:99999", "port must be in 0..65535, got '99999'"),
    ],
)
def test_a_worker_address_error_quotes_a_short_prefix(address: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        parse_host_port(address)
    assert len(str(caught.value)) < 120

"""One loopback test for every address form trainlift takes (dashboard URL, GCS HOST:PORT, Ray Client)."""

import pytest

from trainlift.ops.localray import is_loopback


@pytest.mark.parametrize("address, loopback", [
    ("http://127.0.0.1:8265", True), ("127.0.0.1:6379", True), ("ray://127.0.0.1:10001", True),
    ("localhost:6379", True), ("[::1]:6379", True), ("http://10.0.0.5:8265", False), ("10.0.0.5:6379", False),
    ("ray://head.example:10001", False),
])
def test_loopback_addresses(address, loopback):
    assert is_loopback(address) is loopback

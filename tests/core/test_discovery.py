"""The pure part of engine discovery: expanding DNS entries, merging the sources, the diff."""

from __future__ import annotations

from sieproxy.core.upstream.discovery import Endpoint, diff, host_port, replicas, with_address


def test_with_address_keeps_scheme_port_and_path() -> None:
    assert with_address("http://sglang.ns.svc:30000", "10.0.0.7") == "http://10.0.0.7:30000"
    assert with_address("https://sglang/", "10.0.0.7") == "https://10.0.0.7"
    assert with_address("http://sglang:30000/sub", "fd00::1") == "http://[fd00::1]:30000/sub"
    assert host_port("http://sglang.ns.svc:30000/x") == ("sglang.ns.svc", 30000)
    assert host_port("http://sglang") == ("sglang", None)


def test_replicas_static_then_dns_then_file_first_url_wins() -> None:
    entries = [
        Endpoint("http://gpu-1:30000", pool="a"),
        Endpoint("http://fleet:30000", pool="b", machine_profile="h100", dns=True),
        Endpoint("http://other:30000", dns=True),  # not resolved yet: no replica
    ]
    resolved = {"http://fleet:30000": ["10.0.0.2", "10.0.0.1"]}
    file = [Endpoint("http://10.0.0.1:30000", pool="c"), Endpoint("http://gpu-9:1/")]
    assert replicas(entries, resolved, file) == [
        Endpoint("http://gpu-1:30000", pool="a"),
        Endpoint("http://10.0.0.2:30000", pool="b", machine_profile="h100"),
        Endpoint("http://10.0.0.1:30000", pool="b", machine_profile="h100"),
        Endpoint("http://gpu-9:1"),
    ]
    assert replicas(entries, {}, ()) == [Endpoint("http://gpu-1:30000", pool="a")]


def test_diff_names_added_and_removed_in_order() -> None:
    assert diff(["a", "b", "c"], ["c", "d", "a", "e"]) == (["d", "e"], ["b"])
    assert diff([], []) == ([], [])

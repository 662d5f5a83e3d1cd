"""Webhooks cannot be turned inward: every special-purpose address is refused however it is
spelled (the IPv6 transition forms that embed an IPv4 included), and a refusal names the host,
never what it resolved to."""

from __future__ import annotations

import pytest

from offpeak import webhook_target

INWARD = [
    "127.0.0.1",
    "10.1.2.3",
    "169.254.169.254",  # cloud metadata
    "192.0.0.192",  # 192.0.0.0/24, a cloud metadata address
    "100.100.100.200",  # shared address space, a cloud metadata address
    "0.0.0.0",
    "::1",
    "fd00:ec2::254",  # unique local, a cloud metadata address
    "fe80::1%eth0",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::127.0.0.1",  # IPv4-compatible
    "::ffff:0:7f00:1",  # SIIT, IPv4-translated
    "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "64:ff9b:1::a00:1",  # local-use NAT64
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "2002:a00:1::",  # 6to4 of 10.0.0.1
    "2001:0:4136:e378:8000:63bf:80ff:fffe",  # Teredo
    "2001:db8::1",
    "ff02::1",
    "224.0.0.1",
    "240.0.0.1",
    "198.18.0.1",
]


@pytest.mark.parametrize("address", INWARD)
def test_every_special_purpose_spelling_is_refused(address: str) -> None:
    assert not webhook_target.is_public(address)
    with pytest.raises(webhook_target.TargetRefused) as refused:
        webhook_target.check_target(
            "https://hooks.example/",
            allow_http=False,
            allow_private=False,
            resolve=lambda _host, _port: ["93.184.215.14", address],
        )
    # The refusal names the host the tenant gave, never what it resolved to.
    assert address.split("%")[0] not in str(refused.value)
    assert "93.184.215.14" not in str(refused.value)


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert webhook_target.is_public(address)

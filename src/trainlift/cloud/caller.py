"""This machine's public address as AWS sees it: what `cluster up` lets reach a new cluster's EKS API endpoint."""

from __future__ import annotations

import ipaddress
import urllib.request

from trainlift.cloud.capacity import Unknown

# AWS's own "what is my IP" endpoint: the address requests from here reach AWS with, as plain text.
CHECKIP_URL = "https://checkip.amazonaws.com"


def public_cidr(url: str = CHECKIP_URL, timeout: float = 5.0) -> str | Unknown:
    """The address as a single-address CIDR block (a /32), or why it could not be looked up."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read(64).decode("ascii", "replace").strip()
    except (OSError, ValueError) as exc:
        return Unknown(f"{url} did not answer ({getattr(exc, 'reason', exc)})")
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return Unknown(f"{url} answered {text[:40]!r}, not an address")
    return f"{address}/{address.max_prefixlen}"

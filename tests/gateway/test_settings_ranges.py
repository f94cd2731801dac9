"""The range checks of ``AdmissionConfig``, ``HealthPolicy`` and ``GatewaySettings``: the
first field out of its range is named with its bound and value."""

from __future__ import annotations

import math

import pytest
from prefixgate.gateway.settings import AdmissionConfig, GatewaySettings, HealthPolicy


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: AdmissionConfig(max_queued_requests=0), "max_queued_requests must be >= 1, got 0"),
        (lambda: AdmissionConfig(max_queued_tokens=0), "max_queued_tokens must be >= 1, got 0"),
        (lambda: AdmissionConfig(max_running=-1), "max_running must be >= 0, got -1"),
        (lambda: HealthPolicy(healthy_threshold=0), "healthy_threshold must be >= 1, got 0"),
        (lambda: HealthPolicy(interval_s=0.0), "interval_s must be > 0, got 0.0"),
        (lambda: GatewaySettings(max_body_bytes=10), "max_body_bytes must be >= 1024, got 10"),
        (lambda: GatewaySettings(max_connections=0), "max_connections must be >= 1, got 0"),
        (lambda: GatewaySettings(key_max_prefixes=-1), "key_max_prefixes must be >= 0, got -1"),
        (lambda: GatewaySettings(poll_s=0.0), "poll_s must be > 0, got 0.0"),
        (lambda: GatewaySettings(keepalive_s=math.nan), "keepalive_s must be > 0, got nan"),
    ],
)
def test_a_value_out_of_range_is_named(make, message) -> None:
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_the_defaults_pass() -> None:
    AdmissionConfig()
    HealthPolicy()
    GatewaySettings()

"""A field taken only at its no-op value names the value sent in JSON's spelling, as the client
wrote it: ``store: true``, ``modalities: ["text", "audio"]``, ``best_of: 2`` (they read
``store: 'True'`` and ``modalities: "['text', 'audio']"``, Python's reprs; a new user's probe)."""

from __future__ import annotations

import pytest
from prefixgate.gateway.http.errors import APIError
from prefixgate.gateway.wire.request_fields import check_refused


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("store", True, "store: true is not supported"),
        ("modalities", ["text", "audio"], 'modalities: ["text", "audio"] is not supported'),
        ("service_tier", "flex", 'service_tier: "flex" is not supported'),
        ("best_of", 2, "best_of: 2 is not supported"),
    ],
)
def test_a_refused_value_is_shown_as_sent(field, value, shown):
    with pytest.raises(APIError) as exc:
        check_refused({field: value}, n=1)
    assert exc.value.param == field
    assert exc.value.message.startswith(shown), exc.value.message


def test_the_responses_apis_service_tier_is_shown_as_sent(serve_fake):
    import httpx
    from prefixgate.gateway.settings import GatewaySettings

    srv, _ = serve_fake(GatewaySettings(model_name="fake"), token_delay_s=0.0)
    body = {"model": "fake", "input": "hi", "max_output_tokens": 2, "service_tier": {"a": 1}}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith('service_tier: {"a": 1} is not supported')

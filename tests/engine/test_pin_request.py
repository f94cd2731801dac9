"""``PinRequest``: one prefix pin, built once by the caller and handed to the engine's
``pin_prefix`` (engine/protocol.py); its fields are checked when it is built."""

from __future__ import annotations

import dataclasses

import pytest
from prefixgate.engine.protocol import PinRequest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("ttl_s", [0, -1, 0.0, float("nan"), True, "60", None])
def test_ttl_not_a_positive_number_is_a_value_error(ttl_s):
    with pytest.raises(ValueError, match="ttl_s must be a positive number of seconds"):
        PinRequest([1, 2, 3], ttl_s)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"token_ids": "You dream."}, "tokenize the text first"),
        ({"token_ids": b"\x01\x02"}, "token_ids must be a list of token ids"),
        ({"token_ids": 42}, "token_ids must be a list of token ids"),
        ({"cache_salt": 5}, "cache_salt must be a string or None"),
        ({"tenant": ["a"]}, "tenant must be a string or None"),
    ],
)
def test_bad_fields_are_type_errors(kwargs, message):
    with pytest.raises(TypeError, match=message):
        PinRequest(**{"token_ids": [1, 2, 3], "ttl_s": 60, **kwargs})


def test_the_pin_is_a_frozen_copy():
    ids = [1, 2, 3]
    pin = PinRequest(ids, 60, cache_salt="s", tenant="team-a")
    ids.append(4)  # the caller's list changing later does not change the pin
    assert pin == PinRequest((1, 2, 3), 60.0, "s", "team-a")
    assert pin.token_ids == (1, 2, 3) and isinstance(pin.ttl_s, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        pin.ttl_s = 5  # type: ignore[misc]


def test_the_engine_takes_only_a_pin_request(pool_whole):
    from prefixgate.engine.config import EngineConfig
    from prefixgate.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(num_kv_blocks=64))
    with pytest.raises(TypeError, match="pin_prefix takes a PinRequest, got list"):
        eng.pin_prefix(list(range(3, 40)))  # type: ignore[arg-type]
    pin = eng.pin_prefix(PinRequest(list(range(3, 40)), 60))
    assert pin.num_tokens == 32
    eng.unpin_prefix(pin.id)
    pool_whole(eng)

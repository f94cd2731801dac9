"""The keys file: every entry's fields are validated, errors name the file and the entry."""

from __future__ import annotations


def test_keys_file_entries_are_validated(tmp_path):
    # A non-string salt was loaded and then failed every request of that key at the engine
    # ("cache_salt must be a string"); a duplicate key silently replaced the first's limits;
    # a key with surrounding spaces could never match (the header's key is stripped).
    import json

    import pytest
    from prefixgate.gateway.tenancy.keys import KeyRing

    bad = [
        [{"key": "k1", "salt": 5}],
        [{"key": "k1", "salt": ""}],
        [{"key": "k1", "name": 7}],
        [{"key": "k1"}, {"key": "k1", "max_concurrent": 1}],
        [{"key": " k1 "}],
    ]
    for i, entries in enumerate(bad):
        path = tmp_path / f"keys{i}.json"
        path.write_text(json.dumps({"keys": entries}))
        with pytest.raises(ValueError, match="keys"):
            KeyRing.from_options(None, str(path))
    assert not KeyRing.from_options(["k1", "k1"]).open  # the same key twice, same settings
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"keys": [{"key": "k1", "salt": "t"}, {"key": "k2", "salt": "t"}]}))
    ring = KeyRing.from_options(["k3"], str(path))
    assert not ring.open


def test_an_unnamed_keys_errors_name_it_as_logs_do(tmp_path):
    """Was: "requests_per_minute of key ? must be ..." for an entry without a name; the
    key's display name (key- and its digest's first 8 hex digits) is known before the checks."""
    import hashlib
    import json

    import pytest
    from prefixgate.gateway.tenancy.keys import load_keys_file

    shown = "key-" + hashlib.sha256(b"sk-x").hexdigest()[:8]
    for field, value in (("requests_per_minute", -5), ("weight", 0), ("salt", "")):
        path = tmp_path / f"{field}.json"
        path.write_text(json.dumps({"keys": [{"key": "sk-x", field: value}]}))
        with pytest.raises(ValueError, match=f"entry 0: {field} of key {shown} must") as err:
            load_keys_file(str(path))
        assert "?" not in str(err.value)


def test_a_keys_file_with_no_keys_refuses_to_start(tmp_path):
    """Was: ``{"keys": []}`` started an open server (every request 200, no warning); an
    operator passing a keys file expects authentication, so zero keys is refused wherever
    keys are configured: the keys file's reader, the key ring, and a gateway's app."""
    import json

    import pytest
    from prefixgate.gateway.app import create_app
    from prefixgate.gateway.settings import GatewaySettings
    from prefixgate.gateway.tenancy.keys import KeyRing, load_keys_file
    from support.fake_engine import FakeEngine

    empty_json = tmp_path / "keys.json"
    empty_json.write_text(json.dumps({"keys": []}))
    empty_toml = tmp_path / "keys.toml"
    empty_toml.write_text("keys = []\n")
    for path in (empty_json, empty_toml):
        said = f"the keys file {path} has no keys: every request would be open"
        with pytest.raises(ValueError, match=said):
            load_keys_file(str(path))
        with pytest.raises(ValueError, match="add a key or drop --keys-file"):
            KeyRing.from_options(None, str(path))
        with pytest.raises(ValueError, match="has no keys"):
            create_app(FakeEngine(), GatewaySettings(model_name="fake", keys_file=str(path)))

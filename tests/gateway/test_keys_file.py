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

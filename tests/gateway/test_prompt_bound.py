"""Refuse before working: a prompt that cannot fit the context is refused from its size,
before it is tokenized (gateway/wire/prompts.py, Tokenizer.min_num_tokens)."""

from __future__ import annotations

import random

import pytest
from prefixgate.engine.tokenizer import Tokenizer
from prefixgate.gateway.settings import GatewaySettings


def test_over_context_prompts_refused_without_tokenizing(serve_fake, gw):
    srv, engine = serve_fake(GatewaySettings(model_name="fake", max_body_bytes=8 << 20))
    tok = type(engine.tokenizer)
    huge = "x" * 3_900_000
    with gw.client(srv) as c:
        before = tok.encoded_bytes
        r = c.post("/v1/chat/completions", json=gw.chat_body(huge))
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        assert "at least" in err["message"]
        r = c.post("/v1/completions", json={"model": "fake", "prompt": ["ok", huge]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert tok.encoded_bytes - before < 1000  # the 3.9 MB were never tokenized
        # a prompt under the bound is tokenized and checked exactly, as before
        r = c.post("/v1/chat/completions", json=gw.chat_body("y" * 100, max_tokens=100))
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert tok.encoded_bytes - before >= 100
        r = c.post("/v1/chat/completions", json=gw.chat_body("hi", max_tokens=3))
        assert r.status_code == 200


def _texts() -> list[str]:
    rng = random.Random(0)
    return [
        "hello world",
        "x" * 1000,
        " " * 500,
        "\n\t " * 100,
        "日本語テキスト" * 50,
        "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(3000)),
        "".join(chr(rng.randint(0x1F300, 0x1F6FF)) for _ in range(500)),
        "<s></s><unk>" * 20,
        "e\u0301" * 300,
    ]


@pytest.mark.parametrize("model", ["builtin", "aidreams", "smollm2"])
def test_min_num_tokens_is_a_lower_bound(model, request):
    if model == "builtin":
        tok = Tokenizer.builtin()
    else:
        fixture = "aidreams_path" if model == "aidreams" else "smollm2_shape_path"
        tok = Tokenizer.from_pretrained(request.getfixturevalue(fixture))
    assert tok.max_token_bytes > 0
    for text in _texts():
        for special in (False, True):
            n = len(tok.encode(text, add_special_tokens=special))
            assert tok.min_num_tokens(text) <= n, (text[:20], tok.min_num_tokens(text), n)
    # and it is useful: a 100 kB text is bounded far above a small context
    assert tok.min_num_tokens("a" * 100_000) >= 100_000 // tok.max_token_bytes


def test_no_bound_when_the_tokenizer_can_drop_text():
    from tokenizers import Tokenizer as HF
    from tokenizers import models, normalizers, pre_tokenizers

    hf = HF(models.BPE(unk_token="[UNK]", fuse_unk=True))
    hf.add_special_tokens(["[UNK]"])
    assert Tokenizer(hf).max_token_bytes == 0  # a run of unknown text fuses into one token
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Whitespace()  # drops whitespace
    assert Tokenizer(hf).max_token_bytes == 0
    hf = HF(models.BPE())
    hf.normalizer = normalizers.Strip()
    assert Tokenizer(hf).max_token_bytes == 0
    assert Tokenizer(hf).min_num_tokens("x" * 1000) == 0

"""Gemini's dialect as ``google-genai`` sends it with its defaults, in both modes: the client's
default API version (``v1``: ``POST /v1/models/{model}:generateContent``) is served like
``/v1beta``; ``top_k`` (a float in the client's types, so ``5.0`` on the wire) and any other
integer field given as an integral number are taken, a fractional one refused by name;
``thinkingConfig`` that turns thinking off (``thinkingBudget: 0``) is taken, thinking asked
for is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest
from prefixgate.gateway.app import create_proxy_app
from prefixgate.gateway.http.server import BackgroundServer
from prefixgate.gateway.settings import GatewaySettings

genai = pytest.importorskip("google.genai")
from google.genai import errors as genai_errors  # noqa: E402
from google.genai import types  # noqa: E402

HELLO = {"contents": [{"role": "user", "parts": [{"text": "hello"}]}]}


def _client(url: str, key: str = "x") -> genai.Client:
    # no api_version: the client's own default (``v1`` in google-genai 1.x-3.x)
    return genai.Client(api_key=key, http_options=types.HttpOptions(base_url=url))


def test_the_clients_default_api_version_is_served(serve_fake):
    srv, engine = serve_fake()
    client = _client(srv.url)
    cfg = types.GenerateContentConfig(max_output_tokens=3)
    r = client.models.generate_content(model="fake", contents="hello", config=cfg)
    assert r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert r.usage_metadata.candidates_token_count == 3
    chunks = list(client.models.generate_content_stream(model="fake", contents="hi", config=cfg))
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    count = client.models.count_tokens(model="fake", contents="hello")
    assert count.total_tokens == r.usage_metadata.prompt_token_count
    reply = client.chats.create(model="fake", config=cfg).send_message("hello")
    assert reply.usage_metadata.candidates_token_count == 3
    assert len(engine.requests_seen) == 3  # count_tokens runs no request


def test_v1_errors_take_geminis_shape_and_openai_paths_stay_openais(serve_fake):
    srv, _ = serve_fake()
    r = httpx.post(srv.url + "/v1/models/fake:generateContent", content=b"{oops", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    r = httpx.post(srv.url + "/v1/models/other:generateContent", json=HELLO, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
    client = _client(srv.url)
    with pytest.raises(genai_errors.ClientError) as err:
        client.models.generate_content(model="other", contents="hi")
    assert err.value.code == 404
    # the OpenAI model routes are unchanged
    assert httpx.get(srv.url + "/v1/models/fake", timeout=10).json()["id"] == "fake"
    r = httpx.post(srv.url + "/v1/models/fake", json={}, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_wrong_method_on_a_model_path_answers_in_the_clients_dialect(serve_fake, mode):
    """``/v1/models[/{model}]`` answers each client in the dialect its headers name
    (``models_dialect.client_dialect``); a method no route serves there is that dialect's 405
    too. Was: OpenAI's shape whatever the headers (a Google client's ``POST /v1/models/org/x``
    got ``{"error": {"type", "code": "method_not_allowed"}}``, which google-genai cannot
    read as its error)."""
    srv, _ = serve_fake()
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        for path in ("/v1/models/org/x", "/v1/models/fake", "/v1/models"):
            for headers, params in (({"x-goog-api-key": "k"}, {}), ({}, {"key": "k"})):
                r = httpx.post(url + path, json={}, headers=headers, params=params, timeout=10)
                assert r.status_code == 405 and r.headers["Allow"].startswith("GET"), r.text
                err = r.json()["error"]
                assert err["status"] == "UNIMPLEMENTED" and err["code"] == 405, (path, r.text)
                assert "method POST" in err["message"], err
            r = httpx.post(url + path, json={}, headers={"anthropic-version": "2023-06-01"})
            assert r.status_code == 405 and r.json()["type"] == "error", (path, r.text)
            r = httpx.post(url + path, json={}, timeout=10)  # no dialect's header: OpenAI's
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
        # a Gemini method's path keeps Gemini's shape whatever the headers
        r = httpx.delete(url + "/v1/models/fake:generateContent", timeout=10)
        assert r.status_code == 405 and r.json()["error"]["status"] == "UNIMPLEMENTED", r.text


def test_integral_numbers_are_integers(serve_fake):
    srv, engine = serve_fake()
    client = _client(srv.url)
    cfg = types.GenerateContentConfig(max_output_tokens=3, top_k=5, seed=7)
    client.models.generate_content(model="fake", contents="hello", config=cfg)
    params = engine.requests_seen[-1][2]
    assert (params.top_k, params.seed, params.max_tokens) == (5, 7, 3)
    path = "/v1beta/models/fake:generateContent"
    config = {"maxOutputTokens": 2.0, "topK": 4.0, "candidateCount": 1.0, "seed": 3.0}
    r = httpx.post(srv.url + path, json={**HELLO, "generationConfig": config}, timeout=10)
    assert r.status_code == 200, r.text
    params = engine.requests_seen[-1][2]
    assert (params.top_k, params.seed, params.max_tokens) == (4, 3, 2)
    assert all(type(v) is int for v in (params.top_k, params.seed, params.max_tokens))
    for field, value in [("topK", 4.5), ("maxOutputTokens", True), ("seed", "3")]:
        body = {**HELLO, "generationConfig": {field: value}}
        r = httpx.post(srv.url + path, json=body, timeout=10)
        assert r.status_code == 400, (field, r.text)
        assert f"generationConfig.{field}" in r.json()["error"]["message"]


def test_thinking_turned_off_is_taken_and_asked_for_is_refused(serve_fake):
    srv, _ = serve_fake()
    client = _client(srv.url)
    off = types.ThinkingConfig(thinking_budget=0)
    cfg = types.GenerateContentConfig(max_output_tokens=2, thinking_config=off)
    assert client.models.generate_content(model="fake", contents="hi", config=cfg).text
    path = "/v1beta/models/fake:generateContent"
    for thinking in [{"thinkingBudget": 1024}, {"thinkingBudget": -1}, {"includeThoughts": True}]:
        body = {**HELLO, "generationConfig": {"thinkingConfig": thinking}}
        r = httpx.post(srv.url + path, json=body, timeout=10)
        assert r.status_code == 400, (thinking, r.text)
        assert "generationConfig.thinkingConfig" in r.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_stream_without_alt_names_what_is_missing(serve_fake, mode):
    srv, _ = serve_fake()
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        r = httpx.post(url + "/v1beta/models/fake:streamGenerateContent", json=HELLO, timeout=10)
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        # one wording in both modes (the proxy's did not say what came)
        assert "None" not in message and "?alt=sse" in message and "got no alt" in message


@pytest.fixture
def proxy_in_front(serve_fake):
    srv, engine = serve_fake()
    settings = GatewaySettings(api_keys=["k1"])
    gw = BackgroundServer(lambda: create_proxy_app([srv.url], settings)).__enter__()
    yield gw, engine
    gw.close()


def test_proxy_serves_the_clients_default_api_version(proxy_in_front):
    gw, engine = proxy_in_front
    client = _client(gw.url, key="k1")
    cfg = types.GenerateContentConfig(max_output_tokens=3, top_k=5)
    r = client.models.generate_content(model="fake", contents="hello", config=cfg)
    assert r.usage_metadata.candidates_token_count == 3
    assert engine.requests_seen[-1][2].top_k == 5
    chunks = list(client.models.generate_content_stream(model="fake", contents="hi", config=cfg))
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert client.models.count_tokens(model="fake", contents="hello").total_tokens > 0


def test_snake_case_names_are_taken_as_protobufs_json_reads_them(serve_fake):
    srv, engine = serve_fake()
    body = {
        "contents": [{"role": "user", "parts": [{"text": "hello"}]}],
        "system_instruction": {"parts": [{"text": "be brief"}]},
        "generation_config": {"max_output_tokens": 2, "top_k": 3},
    }
    r = httpx.post(srv.url + "/v1beta/models/fake:generateContent", json=body, timeout=10)
    assert r.status_code == 200, r.text
    params = engine.requests_seen[-1][2]
    assert (params.top_k, params.max_tokens) == (3, 2)


BOTH_SPELLINGS = [  # (a body with one field under both its names, the path to it, the names)
    (
        {**HELLO, "generationConfig": {"topK": 3, "top_k": 5}},
        "generationConfig",
        ("topK", "top_k"),
    ),
    (
        {**HELLO, "generationConfig": {"topK": 3}, "generation_config": {"topK": 4}},
        None,
        ("generationConfig", "generation_config"),
    ),
    (
        {
            **HELLO,
            "generationConfig": {"thinkingConfig": {"thinkingBudget": 0, "thinking_budget": 0}},
        },
        "generationConfig.thinkingConfig",
        ("thinkingBudget", "thinking_budget"),
    ),
    (  # a schema's keyword too (was merged, the last one kept)
        {
            **HELLO,
            "generationConfig": {
                "responseMimeType": "application/json",
                "responseSchema": {"type": "STRING", "maxLength": 1, "max_length": 50},
            },
        },
        None,
        ("maxLength", "max_length"),
    ),
]


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_field_sent_under_both_its_names_is_a_400_naming_both(serve_fake, mode):
    """``topK`` and ``top_k`` in one object were taken silently (one of them dropped)."""
    srv, engine = serve_fake()
    if mode == "local":
        _check_both_spellings(srv.url, engine)
        return
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        _check_both_spellings(gw.url, engine)


def _check_both_spellings(url: str, engine) -> None:
    seen = len(engine.requests_seen)
    for body, where, (camel, snake) in BOTH_SPELLINGS:
        for version in ("v1beta", "v1"):
            path = f"/{version}/models/fake:generateContent"
            r = httpx.post(url + path, json=body, timeout=10)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["status"] == "INVALID_ARGUMENT", error
            assert camel in error["message"] and snake in error["message"], error
            if where is not None:
                assert error["message"].startswith(where + ":"), error
    assert len(engine.requests_seen) == seen  # nothing reached the engine


def test_caches_under_v1_say_where_they_are(serve_fake):
    srv, _ = serve_fake()
    client = _client(srv.url)
    with pytest.raises(genai_errors.ClientError) as err:
        client.caches.create(
            model="fake", config=types.CreateCachedContentConfig(system_instruction="s" * 40)
        )
    assert err.value.code == 404 and "api_version='v1beta'" in str(err.value)
    # in Gemini's shape, which the client reads (was OpenAI's: 'ClientError: 404 None.')
    assert err.value.status == "NOT_FOUND", err.value
    with pytest.raises(genai_errors.ClientError) as err:
        list(client.caches.list())
    assert err.value.status == "NOT_FOUND", err.value
    r = httpx.post(srv.url + "/v1/tunedModels/x:generateContent", json=HELLO, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND", r.text


def _check_models(url: str, key: str) -> None:
    client = _client(url, key=key)
    assert [m.name for m in client.models.list()] == ["models/fake"]
    model = client.models.get(model="fake")
    assert model.name == "models/fake" and "generateContent" in model.supported_actions
    with pytest.raises(genai_errors.ClientError) as err:
        client.models.get(model="other")
    assert err.value.code == 404 and err.value.status == "NOT_FOUND"
    # any other client still gets the OpenAI objects there
    headers = {"Authorization": f"Bearer {key}"}
    listed = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == "fake"
    assert httpx.get(url + "/v1/models/fake", headers=headers, timeout=10).json()["id"] == "fake"


def test_the_model_list_under_v1_is_geminis_to_a_google_client(serve_fake, proxy_in_front):
    srv, _ = serve_fake()
    _check_models(srv.url, "x")
    gw, _ = proxy_in_front
    _check_models(gw.url, "k1")


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_model_named_with_a_slash_is_served_to_google_genai(serve_fake, mode):
    """A hub id (``org/name``, the default served name of ``--model org/name``) reaches the
    routes unquoted from google-genai (``models/org/fake:generateContent``). Was: the list
    named ``models/org/fake``, and its get, generate and count were 404 "unknown route", under
    ``/v1`` in the OpenAI shape."""
    srv, engine = serve_fake(GatewaySettings(model_name="org/fake"))
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        cfg = types.GenerateContentConfig(max_output_tokens=2)
        for version in ("v1", "v1beta"):
            client = genai.Client(
                api_key="x", http_options=types.HttpOptions(base_url=url, api_version=version)
            )
            assert [m.name for m in client.models.list()] == ["models/org/fake"]
            assert client.models.get(model="org/fake").name == "models/org/fake"
            r = client.models.generate_content(model="org/fake", contents="hi", config=cfg)
            assert r.usage_metadata.candidates_token_count == 2
            chunks = client.models.generate_content_stream(
                model="org/fake", contents="hi", config=cfg
            )
            assert list(chunks)[-1].candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
            assert client.models.count_tokens(model="org/fake", contents="hi").total_tokens
            with pytest.raises(genai_errors.ClientError) as err:
                client.models.get(model="org/other")
            assert err.value.code == 404 and err.value.status == "NOT_FOUND"
        # an OpenAI client unquoted too (curl)
        assert httpx.get(url + "/v1/models/org/fake", timeout=10).json()["id"] == "org/fake"


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_the_model_list_under_v1_takes_googles_query_key(serve_fake, mode):
    """``GET /v1/models?key=...`` (Google's REST examples) is a Google client's. Was: a 401
    "missing API key: send 'Authorization: Bearer <key>'" in the OpenAI shape."""
    keyed = GatewaySettings(model_name="fake", api_keys=["sk-good"])
    srv, _ = serve_fake(keyed if mode == "local" else None)  # a proxy keyed before an open one
    with BackgroundServer(lambda: create_proxy_app([srv.url], keyed)) as gw:
        url = srv.url if mode == "local" else gw.url
        r = httpx.get(url + "/v1/models", params={"key": "sk-good"}, timeout=10)
        assert r.status_code == 200 and r.json()["models"][0]["name"] == "models/fake", r.text
        r = httpx.get(url + "/v1/models/fake", params={"key": "sk-good"}, timeout=10)
        assert r.status_code == 200 and r.json()["name"] == "models/fake", r.text
        r = httpx.get(url + "/v1/models", params={"key": "sk-bad"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED", r.text


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_geminis_lists_page_alike_in_both_modes(serve_fake, mode):
    """``pageSize`` / ``pageToken`` of ``cachedContents`` and ``models`` (``list_page``). Was:
    the proxy's cachedContents list and both modes' models list ignored them (every item in
    one page with a 200 for ``pageSize: 1``, ``0`` or ``abc``, and for a token never given)."""
    srv, engine = serve_fake()
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        names = []
        for i in range(3):
            body = {"model": "models/fake", "contents": [{"parts": [{"text": f"{i}" * 40}]}]}
            r = httpx.post(url + "/v1beta/cachedContents", json=body, timeout=10)
            assert r.status_code == 200, r.text
            names.append(r.json()["name"])
        seen, token = [], None
        for _ in range(3):
            params = {"pageSize": 2, **({"pageToken": token} if token else {})}
            page = httpx.get(url + "/v1beta/cachedContents", params=params, timeout=10).json()
            seen += [c["name"] for c in page["cachedContents"]]
            token = page.get("nextPageToken")
            if token is None:
                break
        assert seen == names
        client = genai.Client(
            api_key="x", http_options=types.HttpOptions(base_url=url, api_version="v1beta")
        )
        listed = client.caches.list(config=types.ListCachedContentsConfig(page_size=1))
        assert [c.name for c in listed] == names  # the pager follows nextPageToken
        for path in ("/v1beta/cachedContents", "/v1beta/models"):
            for params, field in (
                ({"pageSize": -1}, "pageSize"),
                ({"pageSize": "abc"}, "pageSize"),
                ({"pageSize": "\u00b2"}, "pageSize"),  # a digit to str.isdigit, not to int (a 500)
                ({"pageToken": "zz"}, "pageToken"),
                ({"pageToken": "\u00b2"}, "pageToken"),
                ({"pageToken": "9" * 5000}, "pageToken"),  # past int()'s digit limit (a 500)
            ):
                r = httpx.get(url + path, params=params, timeout=10)
                assert r.status_code == 400, (path, params, r.text)
                violation = r.json()["error"]["details"][0]["fieldViolations"][0]
                assert violation["field"] == field, r.text
            # as Google: 0 or none is the default page, above 1000 is 1000 (was a 400)
            for size in ("0", "", "2000"):
                r = httpx.get(url + path, params={"pageSize": size}, timeout=10)
                assert r.status_code == 200, (path, size, r.text)
        for name in names:
            assert httpx.delete(f"{url}/v1beta/{name}", timeout=10).status_code == 200


def test_a_proxys_gemini_model_has_its_upstreams_token_limits(proxy_in_front):
    """The upstream's card says its context length (``max_model_len``); the proxy's Gemini
    ``Model`` had no ``inputTokenLimit`` / ``outputTokenLimit`` (google-genai read None)."""
    gw, _ = proxy_in_front
    client = genai.Client(api_key="k1", http_options=types.HttpOptions(base_url=gw.url))
    auth = {"Authorization": "Bearer k1"}
    card = httpx.get(gw.url + "/v1/models/fake", headers=auth, timeout=10).json()
    assert isinstance(card["max_model_len"], int), card
    listed = list(client.models.list())
    for model in (listed[0], client.models.get(model="fake")):
        assert model.input_token_limit == card["max_model_len"], model
        assert model.output_token_limit == card["max_model_len"], model


def test_a_model_no_known_list_names_is_not_invented(serve_fake):
    """A proxy knowing one upstream's models and not another's (down): a Gemini ``GET`` of a
    model no known list names was a 200 ``Model`` of that name (the router sends an unknown
    name to the upstream whose models are unknown); it is a 404, as the OpenAI route's
    "not listed yet"."""
    from support.net import free_port

    srv, _ = serve_fake()
    down = f"http://127.0.0.1:{free_port()}"
    with BackgroundServer(lambda: create_proxy_app([srv.url, down], GatewaySettings())) as gw:
        assert httpx.get(gw.url + "/v1/models/fake", timeout=10).status_code == 200
        for path in ("/v1beta/models/nonexistent", "/v1beta/models/made/up"):
            r = httpx.get(gw.url + path, timeout=10)
            assert r.status_code == 404, (path, r.text)
            assert r.json()["error"]["status"] == "NOT_FOUND", r.text
        r = httpx.get(gw.url + "/v1beta/models/fake", timeout=10)
        assert r.status_code == 200 and r.json()["name"] == "models/fake", r.text


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_count_tokens_checks_the_model_its_request_names_in_both_modes(serve_fake, mode):
    """``generateContentRequest.model`` naming a model nobody serves: local mode's 404, the
    proxy's 200 (it counted with the path's model and ignored the field)."""
    srv, _ = serve_fake()
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        body = {"generateContentRequest": {"model": "models/other", **HELLO}}
        r = httpx.post(url + "/v1beta/models/fake:countTokens", json=body, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND", r.text
        body = {"generateContentRequest": {"model": "models/fake", **HELLO}}
        r = httpx.post(url + "/v1beta/models/fake:countTokens", json=body, timeout=10)
        assert r.status_code == 200 and r.json()["totalTokens"] > 0, r.text


@pytest.mark.parametrize("mode", ["local", "proxy"])
def test_a_model_method_without_an_api_version_says_where_geminis_routes_are(serve_fake, mode):
    """LiteLLM's ``gemini/`` model with ``api_base`` the server's root posts
    ``/models/{model}:generateContent``: a 404 in Gemini's shape naming ``/v1beta`` (was
    OpenAI's object saying the routes are under ``/v1``, which LiteLLM showed as is)."""
    srv, _ = serve_fake()
    with BackgroundServer(lambda: create_proxy_app([srv.url], GatewaySettings())) as gw:
        url = srv.url if mode == "local" else gw.url
        for path in ("/models/fake:generateContent", "/models/fake:streamGenerateContent"):
            r = httpx.post(url + path, json=HELLO, timeout=10)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["status"] == "NOT_FOUND" and err["code"] == 404, err
            assert "/v1beta" in err["message"] and "LiteLLM" in err["message"], err
        # an OpenAI path without /v1 keeps OpenAI's object and its hint
        r = httpx.post(url + "/chat/completions", json={}, timeout=10)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert "under /v1" in r.json()["error"]["message"]

"""The Kubernetes manifests of ``examples/cluster/k8s/``, checked offline (no cluster).

- Core kinds (Deployment, StatefulSet, Service, PersistentVolumeClaim, NetworkPolicy) against
  Kubernetes' own OpenAPI schemas, strictly (unknown fields refused), with
  ``kubernetes-validate`` (skipped, with the reason, when it is not installed).
- The ``InferencePool`` (a CRD that ``kubernetes-validate`` does not know) against a small JSON
  schema written here from the published fields of ``inference.networking.k8s.io/v1``
  (the Gateway API Inference Extension's API reference: ``spec.selector.matchLabels``,
  ``spec.targetPorts[].number`` (1 to 8, unique), ``spec.appProtocol``,
  ``spec.endpointPickerRef`` {``group``, ``kind``, ``name`` (required), ``port.number``,
  ``failureMode``: FailOpen | FailClose}).
- The pieces fit: Services and the pool select the pods they mean, on ports those pods
  open; the prefixgate containers' arguments parse with ``prefixgate serve``'s own flags and
  settings; the gateways' KV event endpoints and Redis are the ones the other pods serve;
  the vLLM pods run with prefix caching, cached-token counts and bound KV event sockets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prefixgate.gateway.serve.args import add_serve_arguments
from prefixgate.gateway.serve.configure import settings_from_args

K8S = Path(__file__).resolve().parent.parent / "examples" / "cluster" / "k8s"
KUBERNETES_VERSION = "1.37"
CORE_KINDS = {"Deployment", "StatefulSet", "Service", "PersistentVolumeClaim", "NetworkPolicy"}

_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
# a port reference ({"number": N}), as targetPorts' items and endpointPickerRef.port are
_PORT_OBJECT = {
    "type": "object",
    "required": ["number"],
    "additionalProperties": False,
    "properties": {"number": _PORT},
}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _NAME, "labels": {"type": "object"}},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "minProperties": 1,
                            "additionalProperties": {"type": "string", "maxLength": 63},
                        }
                    },
                },
                "targetPorts": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 8,
                    "uniqueItems": True,
                    "items": _PORT_OBJECT,
                },
                "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
                "endpointPickerRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": _PORT_OBJECT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                out.append((path.name, doc))
    return out


DOCS = _documents()


def _of(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _serve_args(workload: dict[str, Any]) -> argparse.Namespace:
    container = _container(workload)
    assert container["command"] == ["prefixgate", "serve"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    return parser.parse_args(container["args"])


def test_every_manifest_is_a_known_kind():
    kinds = sorted(d["kind"] for _, d in DOCS)
    assert kinds == sorted(
        [
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "StatefulSet",
            "Service",
            "Deployment",
            "Service",
            "Deployment",
            "Service",
            "NetworkPolicy",
            "InferencePool",
        ]
    ), kinds


@pytest.mark.parametrize(
    "name,doc",
    [(f"{n}:{d['kind']}/{d['metadata']['name']}", d) for n, d in DOCS if d["kind"] in CORE_KINDS],
)
def test_core_kinds_validate_against_kubernetes_schemas(name, doc):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install 'prefixgate[test]')",
    )
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_an_unknown_field():
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install 'prefixgate[test]')",
    )
    bad = json.loads(json.dumps(_of("Deployment", "prefixgate-gateway")))
    _container(bad)["portz"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_inference_pool_has_the_published_v1_fields():
    pool = _of("InferencePool", "prefixgate-engines")
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    bad = json.loads(json.dumps(pool))
    bad["spec"]["targetPortNumber"] = 8000  # the pre-v1 (v1alpha2) field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, INFERENCE_POOL_V1)


def test_services_and_the_pool_select_pods_on_ports_they_open():
    for _, svc in DOCS:
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"]
        (workload,) = [
            w
            for w in _workloads()
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert workload["spec"]["selector"]["matchLabels"].items() <= selector.items()
        names = {p["name"] for p in _container(workload)["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    vllm = _of("StatefulSet", "vllm")
    assert vllm["spec"]["serviceName"] == "vllm"
    assert _of("Service", "vllm")["spec"]["clusterIP"] == "None"  # vllm-0.vllm, vllm-1.vllm
    pool = _of("InferencePool", "prefixgate-engines")
    engine = _of("Deployment", "prefixgate-engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    opened = {p["containerPort"] for p in _container(engine)["ports"]}
    assert {p["number"] for p in pool["spec"]["targetPorts"]} <= opened
    policy = _of("NetworkPolicy", "prefixgate-engine-pool-only")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == opened


def test_every_volume_claim_is_declared():
    claims = {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}
    for workload in _workloads():
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims


def test_gateway_arguments_are_prefixgate_serve_flags_that_fit_the_other_pods():
    gateway = _of("Deployment", "prefixgate-gateway")
    args = _serve_args(gateway)
    settings = settings_from_args(args)  # every value in its range
    assert args.routing == "precise" and args.tokenizer
    replicas = _of("StatefulSet", "vllm")["spec"]["replicas"]
    vllm_urls = [f"http://vllm-{i}.vllm:8000" for i in range(replicas)]
    assert args.upstreams == vllm_urls
    assert settings.upstream_kv_events == {
        url: (f"tcp://{url[7:-5]}:5557", f"tcp://{url[7:-5]}:5558") for url in vllm_urls
    }
    redis = _of("Service", "redis")["spec"]["ports"][0]["port"]
    assert settings.redis_url == f"redis://redis:{redis}/0"
    assert gateway["spec"]["replicas"] >= 2  # replicas that share state on Redis
    mounted = {m["mountPath"] for m in _container(gateway)["volumeMounts"]}
    assert any(args.tokenizer.startswith(m + "/") for m in mounted)


def test_engine_arguments_trust_the_pool_and_publish_kv_events():
    from prefixgate.engine.config import EngineConfig

    args = _serve_args(_of("Deployment", "prefixgate-engine"))
    settings = settings_from_args(args)
    assert settings.trust_pool_headers and settings.objective_priority
    assert not args.upstreams and not args.config
    config = EngineConfig(model=None, kv_events=args.kv_events)  # the endpoint as it checks it
    assert config.kv_events == "tcp://*:5557"
    assert args.scheduling_policy == "priority"  # what the objectives' priorities need


def test_vllm_runs_with_prefix_caching_token_details_and_bound_kv_events():
    container = _container(_of("StatefulSet", "vllm"))
    assert container["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    args = container["args"]
    assert "--enable-prefix-caching" in args and "--enable-prompt-tokens-details" in args
    (events,) = [a.split("=", 1)[1] for a in args if a.startswith("--kv-events-config=")]
    events = json.loads(events)
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    # vLLM binds its PUB socket only for an endpoint with "*" (else it connects)
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert not any(e.get("name") == "PYTHONHASHSEED" for e in container.get("env", []))

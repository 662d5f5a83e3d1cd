"""The Kubernetes manifests of ``deploy/kubernetes/``: valid against the Kubernetes schemas
(``kubernetes-validate``, offline, its bundled schemas), and true to the code: real commands,
variables that are settings, probes on real routes, the autoscaler on a metric the API serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.fernet import Fernet
from typer.main import get_command

from offpeak.cli import app
from offpeak.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "deploy" / "kubernetes"
#: The oldest Kubernetes minor still in upstream support when the manifests were written.
KUBERNETES = "1.33.0"
DOCS = [
    doc for path in sorted(FOLDER.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())
]
BY_KIND: dict[str, list[dict[str, Any]]] = {}
for _doc in DOCS:
    BY_KIND.setdefault(_doc["kind"], []).append(_doc)


def _named(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in BY_KIND[kind] if d["metadata"]["name"] == name)


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in DOCS
        if d["kind"] in ("Deployment", "Job")
    ]


def _containers() -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, spec in _pod_specs() for c in spec["containers"]]


def test_every_kind_is_there() -> None:
    assert {"ConfigMap", "Secret", "Job", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler"} <= set(BY_KIND)  # fmt: skip
    components = {
        d["metadata"]["labels"]["app.kubernetes.io/component"] for d in BY_KIND["Deployment"]
    }
    assert components == {"api", "control", "engine"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_valid_against_the_kubernetes_schemas(doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises ValidationError


@pytest.mark.parametrize(
    "name,container", _containers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_container_runs_a_real_offpeak_command(name: str, container: dict[str, Any]) -> None:
    command = container["args"]
    cli = get_command(app)
    ctx = cli.make_context("offpeak", list(command), resilient_parsing=False)
    sub = cli.get_command(ctx, command[0])  # type: ignore[attr-defined]
    assert sub is not None, f"{name}: {command[0]} is not an offpeak command"
    sub.make_context(command[0], list(command[1:]))  # raises on an unknown option


def _environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables as the pod gets them: envFrom first, then env (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_named("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(_named("Secret", source["secretRef"]["name"])["stringData"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = _named("Secret", ref["name"])["stringData"][ref["key"]]
    return env


@pytest.mark.parametrize(
    "name,container", _containers(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_variable_is_a_setting_or_a_standard_aws_one(
    name: str, container: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _environment(container)
    fields = {f"OFFPEAK_{field.upper()}" for field in Settings.model_fields}
    standard = {"AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    unknown = [k for k in env if k.split("__")[0] not in fields and k not in standard]
    assert not unknown, f"{name} sets variables nothing reads: {unknown}"
    # The example's placeholder is not a Fernet key; a deployment's Secret holds a real one.
    env["OFFPEAK_SECRET_KEYS"] = json.dumps([Fernet.generate_key().decode()])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.resolved_blob_url.startswith("s3://")
    assert settings.resolved_broker_url.startswith("redis://")
    assert settings.resolved_database_url.startswith("postgresql+psycopg://")
    if name == "offpeak-migrate":  # straight to PostgreSQL, never through the pooler
        assert ":5432/" in settings.resolved_database_url
    else:
        assert not settings.database_pool.prepared_statements
    if "--models" in container["args"]:
        served = container["args"][container["args"].index("--models") + 1].split(",")
        assert set(served) <= set(settings.models)


def test_probes_are_the_apis_health_routes() -> None:
    from api.routes.health import router

    routes = {route.path for route in router.routes}  # type: ignore[attr-defined]
    api = _named("Deployment", "offpeak-api")["spec"]["template"]["spec"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/readyz" in routes
    assert api["livenessProbe"]["httpGet"]["path"] == "/healthz" in routes
    port = api["args"][api["args"].index("--port") + 1]
    assert [p["containerPort"] for p in api["ports"]] == [int(port)]


def test_selectors_find_their_pods() -> None:
    for doc in BY_KIND["Service"] + BY_KIND["PodDisruptionBudget"]:
        spec = doc["spec"]
        wanted = spec["selector"] if doc["kind"] == "Service" else spec["selector"]["matchLabels"]
        matches = [
            d for d in BY_KIND["Deployment"]
            if wanted.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert matches, f"{doc['kind']}/{doc['metadata']['name']} selects no pod"


def test_engine_workers_take_a_gpu_and_are_scaled_on_replicas_needed() -> None:
    from api.services import fleet_metrics

    source = Path(fleet_metrics.__file__).read_text()
    for hpa in BY_KIND["HorizontalPodAutoscaler"]:
        target = _named("Deployment", hpa["spec"]["scaleTargetRef"]["name"])
        container = target["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert "replicas" not in target["spec"], "the autoscaler owns the replicas"
        [metric] = hpa["spec"]["metrics"]
        assert metric["external"]["metric"]["name"] == "offpeak_replicas_needed"
        assert f'"{metric["external"]["metric"]["name"]}"' in source
        model = metric["external"]["metric"]["selector"]["matchLabels"]["model"]
        assert container["args"][container["args"].index("--models") + 1] == model


def test_no_secret_outside_the_secret() -> None:
    for doc in BY_KIND["ConfigMap"]:
        assert not any(k.endswith(("_KEY", "_TOKEN", "_KEYS", "_URL")) and "change-me" in v
                       for k, v in doc["data"].items())  # fmt: skip
    for name, container in _containers():
        assert all(
            "value" not in item or "change-me" not in item["value"]
            for item in container.get("env", [])
        ), name

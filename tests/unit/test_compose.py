"""docker-compose.yml cannot run here (no Docker engine); check it against the code instead."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.fernet import Fernet
from typer.main import get_command

from offpeak.cli import app
from offpeak.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "docker-compose.yml").read_text()
#: The secrets a deployment puts in .env, from the example it copies.
SECRETS = dict(
    line.split("=", 1)
    for line in (ROOT / "examples" / "compose.env").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
# The example's placeholder is not a Fernet key; a deployment's .env holds a real one.
SECRETS["OFFPEAK_SECRET_KEYS"] = json.dumps([Fernet.generate_key().decode()])
#: ``${NAME}`` and ``${NAME:?message}`` in the file's string values replaced from .env, as
#: ``docker compose`` does (after parsing the YAML, so a JSON value stays a string).
VARIABLE = re.compile(r"\$\{(\w+)(?::\?[^}]*)?\}")


def _interpolate(value: Any) -> Any:
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: SECRETS[m.group(1)], value)
    if isinstance(value, dict):
        return {key: _interpolate(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item) for item in value]
    return value


COMPOSE = _interpolate(yaml.safe_load(TEXT))
OFFPEAK_SERVICES = ["migrate", "api", "control", "engine", "embeddings"]


def test_services_present() -> None:
    assert {"postgres", "redis", *OFFPEAK_SERVICES} <= set(COMPOSE["services"])


@pytest.mark.parametrize("name", OFFPEAK_SERVICES)
def test_command_is_a_real_offpeak_command(name: str) -> None:
    command = COMPOSE["services"][name]["command"]
    cli = get_command(app)
    ctx = cli.make_context("offpeak", list(command), resilient_parsing=False)
    sub = cli.get_command(ctx, command[0])  # type: ignore[attr-defined]
    assert sub is not None, f"{command[0]} is not an offpeak command"
    sub.make_context(command[0], list(command[1:]))  # raises on an unknown option


@pytest.mark.parametrize("name", OFFPEAK_SERVICES)
def test_environment_is_settings(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = COMPOSE["services"][name]["environment"]
    fields = {f"OFFPEAK_{field.upper()}" for field in Settings.model_fields}
    unknown = [key for key in env if key not in fields]
    assert not unknown, f"{name} sets variables no setting reads: {unknown}"
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    settings = Settings()
    assert settings.resolved_database_url.startswith("postgresql+psycopg://")
    assert settings.resolved_broker_url.startswith("redis://:")
    for model in settings.models.values():
        # A folder on the host, or a model packaged in the image (the embedding model).
        assert (model.path and model.path.startswith("/models/")) or model.source


@pytest.mark.parametrize("name", ["engine", "embeddings"])
def test_engine_worker_reserves_a_gpu_and_serves_a_configured_model(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = COMPOSE["services"][name]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    served = engine["command"][engine["command"].index("--models") + 1].split(",")
    for key, value in engine["environment"].items():
        monkeypatch.setenv(key, str(value))
    assert set(served) <= set(Settings().models)


def test_api_port_published() -> None:
    api = COMPOSE["services"]["api"]
    port = api["command"][api["command"].index("--port") + 1]
    assert any(p.endswith(f":{port}") for p in api["ports"])


def test_no_secret_is_written_in_the_file() -> None:
    raw = yaml.safe_load(TEXT)
    assert set(re.findall(r"\$\{(\w+):\?", TEXT)) == set(SECRETS)
    assert raw["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${")
    # Redis takes no command without the password.
    assert "--requirepass" in raw["services"]["redis"]["command"]
    for name in OFFPEAK_SERVICES:
        env = raw["services"][name]["environment"]
        assert "${POSTGRES_PASSWORD" in env["OFFPEAK_DATABASE_URL"]
        assert "${REDIS_PASSWORD" in env["OFFPEAK_BROKER_URL"]

"""A bounded schemathesis run over every operation of the OpenAPI document: the API of this
test process (uvicorn in a thread, on PostgreSQL) with a tenant's key and the admin key, and
schemathesis' CLI as the client, with all its phases (the document's examples, coverage of
boundary and missing values and unexpected methods, generated data that fits the document and
data that does not, and stateful sequences that follow the document's links: upload a file,
create a batch from it, cancel it).

It asserts that no answer is a 5xx and that every answer conforms to the document: declared
status codes, content types, bodies and headers (a 405 with ``Allow``, a 401 without a key),
and that data the document forbids is refused with a 4xx.

Reproducible and bounded: a fixed seed, deterministic generation and ``MAX_EXAMPLES`` generated
cases per operation and phase. Schemathesis' pytest
plugin (``schema.parametrize``) is not used: it reads ``request.node._nodeid``, which pytest 9
no longer has.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from api.app import create_app
from offpeak.settings import Settings
from tests.support.database import fresh_database, new_key
from tests.support.servers import free_port

MAX_EXAMPLES = 30
SEED = 20261201
ADMIN_KEY = "sk-admin-fuzz"

CONFIG = """
seed = {seed}

[generation]
max-examples = {max_examples}
deterministic = true
database = "none"
# Unknown query parameters are ignored, as OpenAI's API does: not data to refuse.
allow-extra-parameters = false

# Keys per security scheme of the document (components.securitySchemes).
[auth.openapi.ApiKey]
bearer = "{tenant_key}"

[auth.openapi.AdminKey]
bearer = "{admin_key}"

# Anthropic's Message Batches routes take the same key as x-api-key.
[auth.openapi.XApiKey]
api_key = "{tenant_key}"

# Every check but "schema-valid data is accepted": a schema cannot say that an input_file_id
# must name an uploaded file, that a file must be UTF-8 JSONL, that start must precede end, or
# which completion windows this server's settings allow (those are 400s or 404s by design).
[checks.positive_data_acceptance]
enabled = false

# A multipart part is bytes: a "type-violating" file (a number, an object) arrives as text,
# which is a valid file, so such an upload is rightly accepted.
[[operations]]
include-path = "/v1/files"
include-method = "POST"
checks.negative_data_rejection.enabled = false
"""


@pytest.fixture(scope="module")
def fuzz_settings(settings: Settings, run_id: str) -> Iterator[Settings]:
    """A database of its own (the run creates files and batches) and a queue prefix nobody
    consumes; the admin API on."""
    with fresh_database(f"offpeak_{run_id}_fuzz") as url:
        yield settings.model_copy(
            update={
                "database_url": url,
                "queue_prefix": f"{run_id}-fuzz",
                "admin_api_key": ADMIN_KEY,
            }
        )


@pytest.fixture(scope="module")
def served(fuzz_settings: Settings) -> Iterator[str]:
    """The API on a free port of 127.0.0.1, served from a thread of this process."""
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(fuzz_settings), host="127.0.0.1", port=free_port(), log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the API did not start")
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join()


def test_api_conforms_to_its_openapi_document(
    served: str, fuzz_settings: Settings, tmp_path: Path
) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(
        CONFIG.format(
            seed=SEED,
            max_examples=MAX_EXAMPLES,
            tenant_key=new_key(fuzz_settings),
            admin_key=ADMIN_KEY,
        )
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{served}/openapi.json",
            "--no-color",
        ],
        cwd=tmp_path,  # whatever the CLI writes stays in the test's folder
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = run.stdout[-20_000:] + run.stderr[-5_000:]
    assert run.returncode == 0, report
    assert " 0 generated" not in report  # it did run cases

"""``WireJSON``: an answer whose body is already JSON-ready values
(``api.schemas.batches.batch_json``), written by orjson.

The reads users poll return it instead of a pydantic model: FastAPI would validate the model
against the route's ``response_model`` again and then serialize it, and for a page of 20
batches building and checking the models cost more than the rest of the request (docs/
benchmarks.md, "Status polls"). The routes still declare ``response_model``, which documents
the schema in OpenAPI; ``tests/unit/test_wire_json.py`` holds the dicts to it byte for byte.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse


class WireJSON(JSONResponse):
    """``application/json``, compact, as FastAPI's own answers of a pydantic model."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)

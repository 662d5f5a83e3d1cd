"""The settings reference of ``docs/configuration.md``, generated from ``Settings`` and the models
it nests, so the page cannot say what the code does not (``offpeak config docs`` rewrites it,
``tests/unit/test_settings_reference.py`` fails when it is stale).

Each setting is a row: its variable (``OFFPEAK_<FIELD>``, a nested model's fields joined with
``__`` as pydantic-settings reads them), its type, its default and its ``Field`` description.
A map of models (``OFFPEAK_MODELS``, ``OFFPEAK_PRICING``) or an optional model
(``OFFPEAK_FAILURE_LIMIT``) is one JSON variable; a table of its entry's fields follows it. Only
the text between ``BEGIN`` and ``END`` is generated; the page's prose around it is written by hand.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from offpeak.settings import Settings

BEGIN = "<!-- generated: settings reference (offpeak config docs) -->"
END = "<!-- end generated -->"
#: The page the reference lives in, in this checkout.
DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ENV_PREFIX = "OFFPEAK_"

#: ``Settings``' fields by section, in the page's order. Every field is in exactly one: a new
#: setting that is not fails the generator (and the drift test) until it is placed.
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "The service",
        (
            "data_dir",
            "database_url",
            "broker_url",
            "blob_url",
            "model_cache_dir",
            "queue_prefix",
            "environment",
            "local_api_key",
        ),
    ),
    ("Database connections", ("database_pool",)),
    ("Models", ("models", "worker_models", "host_engines")),
    (
        "Batches and files",
        (
            "allowed_completion_windows",
            "max_file_bytes",
            "max_requests_per_batch",
            "max_line_bytes",
            "max_validation_errors",
            "failure_limit",
            "idempotency_key_hours",
            "idempotency_in_flight_seconds",
        ),
    ),
    (
        "Retention",
        (
            "file_expiry_days",
            "output_file_expiry_days",
            "request_retention_days",
            "retention_sweep_seconds",
        ),
    ),
    (
        "Workers",
        (
            "chunk_size",
            "lease_seconds",
            "max_line_attempts",
            "max_engine_failures",
            "engine_failure_window_seconds",
            "flush_seconds",
            "sweep_seconds",
            "vacuum",
            "worker_alive_seconds",
            "engine_load_grace_seconds",
        ),
    ),
    (
        "The API and its exposure",
        (
            "api_host",
            "api_port",
            "api_workers",
            "api_access_log",
            "secret_keys",
            "admin_api_key",
            "auth_failures_allowed",
            "auth_failure_window_seconds",
            "api_max_header_bytes",
            "api_header_timeout_seconds",
            "api_body_timeout_seconds",
            "api_max_concurrency",
            "api_keep_alive_seconds",
        ),
    ),
    ("Tenant quotas and rate limits", ("limits",)),
    (
        "Webhooks",
        (
            "webhook_allow_private_targets",
            "webhook_allow_http",
            "webhook_timeout_seconds",
            "webhook_retry_hours",
            "webhook_retry_base_seconds",
            "webhook_retry_max_seconds",
            "webhook_log_days",
        ),
    ),
    (
        "Accounting",
        (
            "pricing",
            "gpu_cost_per_hour",
            "batch_discount",
            "prefill_token_weight",
            "cached_token_weight",
            "decode_token_weight",
        ),
    ),
    (
        "Metrics",
        (
            "metrics_token",
            "metrics_port",
            "metrics_window_seconds",
            "metrics_cache_seconds",
            "load_history_hours",
        ),
    ),
    ("The scheduler", ("scheduler",)),
)

_HEADER = "| variable | type | default | meaning |\n| --- | --- | --- | --- |"
_ENTRY_HEADER = "| field | type | default | meaning |\n| --- | --- | --- | --- |"


class SectionsError(ValueError):
    """``SECTIONS`` and ``Settings`` disagree: a field in no section, in two, or unknown."""


def _model_of(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """``("nested", M)`` for a field of model type ``M``, ``("map", M)`` for ``dict[str, M]``,
    ``("optional", M)`` for ``M | None``; ``None`` for any other type."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "nested", annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and len(args) == 2 and _is_model(args[1]):
        return "map", args[1]
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if _is_model(a)]
        if len(models) == 1 and type(None) in args:
            return "optional", models[0]
    return None


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: Any) -> str:
    """A field's type as the page writes it: ``int``, ``float | None``, ``"busy" | "ignore"``."""
    if annotation is type(None):
        return "None"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:  # validators and constraints are the description's to say
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is Path:
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: FieldInfo) -> str:
    """A field's default as JSON (what the variable would be set to), ``unset`` for ``None``,
    ``required`` for none; a path under the home folder is written from ``~``, so the page is
    the same on every machine."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, Path):
        home = Path.home()
        return f"~/{value.relative_to(home)}" if value.is_relative_to(home) else str(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(exclude_defaults=True)
    elif isinstance(value, dict) and any(isinstance(v, BaseModel) for v in value.values()):
        value = {k: v.model_dump(exclude_defaults=True) for k, v in value.items()}
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(to_jsonable_python(value))


def _cell(text: str) -> str:
    # Markdown tables split on every pipe, even inside a code span (GFM): escape them.
    return text.replace("|", "\\|").replace("\n", " ")


def _description(field: FieldInfo) -> str:
    # The code's reST literals (``x``) as Markdown's (`x`).
    return re.sub(r"``(.+?)``", r"`\1`", field.description or "")


def _row(name: str, field: FieldInfo, *, note: str = "") -> str:
    default = default_text(field)
    default_cell = default if default in ("unset", "required") else f"`{_cell(default)}`"
    text = _description(field) + note
    return f"| `{name}` | `{_cell(type_name(field.annotation))}` | {default_cell} | {_cell(text)} |"


def _rows(
    fields: Iterable[tuple[str, FieldInfo]], env: str, entries: list[str], *, lead: bool = False
) -> Iterator[str]:
    """Rows of ``fields`` under the variable prefix ``env``; a nested model is a row of its own
    (``PREFIX__…``, unless ``lead``: the section's lead says it) and then its fields'; maps and
    optional models append a table of their entry's fields to ``entries``."""
    for name, field in fields:
        variable = f"{env}{name.upper()}"
        kind = _model_of(field.annotation)
        if kind is not None and kind[0] == "nested":
            if not lead:
                yield _group_row(f"{variable}__…", kind[1], field)
            yield from _rows(kind[1].model_fields.items(), f"{variable}__", entries)
            continue
        note = ""
        if kind is not None:
            anchor = variable.lower()
            note = f" JSON; its fields: [below](#{anchor})."
            entries.append(_entry_table(variable, kind[1]))
        yield _row(variable, field, note=note)


def _group_row(name: str, model: type[BaseModel], field: FieldInfo) -> str:
    return f"| `{name}` | `{model.__name__}` | | {_cell(_description(field))} |"


def _entry_rows(model: type[BaseModel], prefix: str) -> Iterator[str]:
    for name, field in model.model_fields.items():
        kind = _model_of(field.annotation)
        if kind is not None and kind[0] in ("nested", "optional"):
            yield _row(f"{prefix}{name}", field)
            yield from _entry_rows(kind[1], f"{prefix}{name}.")
            continue
        yield _row(f"{prefix}{name}", field)


def _entry_table(variable: str, model: type[BaseModel]) -> str:
    lead = (model.__doc__ or "").strip().split("\n\n")[0]
    lead = re.sub(r"``(.+?)``", r"`\1`", " ".join(lead.split()))
    rows = "\n".join(_entry_rows(model, ""))
    return f"#### {variable}\n\n{lead}\n\n{_ENTRY_HEADER}\n{rows}"


def _check_sections() -> None:
    placed = [name for _, names in SECTIONS for name in names]
    fields = set(Settings.model_fields)
    twice = {name for name in placed if placed.count(name) > 1}
    unknown = set(placed) - fields
    missing = fields - set(placed)
    if twice or unknown or missing:
        raise SectionsError(
            "offpeak.settings_reference.SECTIONS must place every Settings field once: "
            f"missing {sorted(missing)}, unknown {sorted(unknown)}, twice {sorted(twice)}"
        )


def reference() -> str:
    """The generated reference: a ``###`` section per entry of ``SECTIONS``, each a table of its
    variables and then the tables of any JSON variable's entry fields.

    Raises ``SectionsError`` when ``SECTIONS`` misses, repeats or names an unknown field."""
    _check_sections()
    parts: list[str] = []
    for title, names in SECTIONS:
        entries: list[str] = []
        rows: list[str] = []
        lead = ""
        for name in names:
            field = Settings.model_fields[name]
            kind = _model_of(field.annotation)
            alone = len(names) == 1 and kind is not None and kind[0] == "nested"
            if alone:
                lead = _description(field) + "\n\n"
            rows.extend(_rows([(name, field)], ENV_PREFIX, entries, lead=alone))
        section = f"### {title}\n\n{lead}{_HEADER}\n" + "\n".join(rows)
        parts.append("\n\n".join([section, *entries]))
    return "\n\n".join(parts)


def render(page: str) -> str:
    """``page`` (``docs/configuration.md``'s text) with the text between ``BEGIN`` and ``END``
    replaced by ``reference()``.

    Raises ``ValueError`` when either marker is missing or out of order."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"docs/configuration.md needs the lines {BEGIN!r} and then {END!r}")
    return f"{page[: start + len(BEGIN)]}\n\n{reference()}\n\n{page[end:]}"

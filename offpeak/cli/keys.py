"""``offpeak keys create|list|revoke``: API keys, on the database or through the admin API.

With ``--admin-url`` (or ``OFFPEAK_ADMIN_URL``) the commands call ``/v1/admin/keys`` with the
admin key from ``OFFPEAK_ADMIN_KEY`` (the server's ``OFFPEAK_ADMIN_API_KEY``), so an operator
needs no database access; without it they work on the database, like ``migrate``.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Any

import httpx
import typer
from rich import box
from rich.console import Console
from rich.table import Table

from offpeak.cli import exit_codes
from offpeak.cli.tables import print_whole
from offpeak.settings import get_settings

console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

AdminUrl = Annotated[
    str | None,
    typer.Option(
        "--admin-url",
        envvar="OFFPEAK_ADMIN_URL",
        help="The API's base URL (http://host:8000): manage keys through its admin API, with "
        "the admin key from OFFPEAK_ADMIN_KEY, instead of the database.",
    ),
]


class AdminApi:
    """``/v1/admin/keys`` of the API at ``base_url``; every failure exits with one line."""

    def __init__(self, base_url: str) -> None:
        key = os.environ.get("OFFPEAK_ADMIN_KEY") or os.environ.get("OFFPEAK_ADMIN_API_KEY")
        if not key:
            errors.print("set OFFPEAK_ADMIN_KEY to the server's OFFPEAK_ADMIN_API_KEY")
            raise typer.Exit(exit_codes.USAGE)
        root = base_url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(
            base_url=f"{root}/v1/admin",
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        )

    def call(self, method: str, path: str = "/keys", **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            errors.print(f"cannot reach the admin API at {self.http.base_url}: {exc}")
            raise typer.Exit(exit_codes.UNREACHABLE) from None
        if response.is_success:
            return response.json()
        try:
            message = response.json()["error"]["message"]
        except Exception:  # not our error shape (a proxy's page)
            message = response.text[:200]
        errors.print(f"error {response.status_code}: {message}")
        raise typer.Exit(exit_codes.ERROR)


def _day(at: int | None) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(at)) if at else "-"


def create_command(
    tenant: Annotated[str, typer.Option(help="Tenant name (created if new).")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
    admin_url: AdminUrl = None,
) -> None:
    """Make an API key for a tenant and print it (shown once; only its hash is stored)."""
    if admin_url:
        answer = AdminApi(admin_url).call("POST", json={"tenant": tenant, "name": name})
        typer.echo(answer["key"])
        return
    from api.services import keys
    from storage.db import session_scope

    with session_scope(get_settings().resolved_database_url) as session:
        key = keys.create_key(session, tenant, name)
    typer.echo(key)


def list_command(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    admin_url: AdminUrl = None,
) -> None:
    """API keys: id, tenant, name, first characters, created and revoked (UTC). The key itself
    cannot be shown (only its hash is kept)."""
    rows: list[tuple[str, str, str | None, str, int, int | None]]
    if admin_url:
        params = {"tenant": tenant} if tenant else {}
        data = AdminApi(admin_url).call("GET", params=params)["data"]
        rows = [
            (k["id"], k["tenant"], k["name"], k["prefix"], k["created_at"], k["revoked_at"])
            for k in data
        ]
    else:
        from api.services import keys
        from storage.db import session_scope

        with session_scope(get_settings().resolved_database_url) as session:
            rows = [
                (k.id, name, k.name, k.prefix, k.created_at, k.revoked_at)
                for k, name in keys.list_keys(session, tenant)
            ]
    table = Table(title="API keys", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
    for column in ("id", "tenant", "name", "starts", "created", "revoked"):
        table.add_column(column, no_wrap=column in ("id", "starts", "created", "revoked"))
    for key_id, tenant_name, label, prefix, created, revoked in rows:
        table.add_row(key_id, tenant_name, label or "-", prefix + "…", _day(created), _day(revoked))
    print_whole(console, table)


def revoke_command(
    key_id: Annotated[str, typer.Argument(help="The key's id (key_…).")],
    admin_url: AdminUrl = None,
) -> None:
    """Revoke a key by its id (``offpeak keys list`` shows ids): the API answers it 401 within
    5 s (each API process caches keys that long). Revoking it again changes nothing."""
    if admin_url:
        answer = AdminApi(admin_url).call("POST", f"/keys/{key_id}/revoke")
        console.print(f"key {answer['id']} ({answer['prefix']}…) revoked")
        return
    from api.services import keys
    from storage.db import session_scope

    with session_scope(get_settings().resolved_database_url) as session:
        try:
            key = keys.revoke_key(session, key_id)
        except keys.UnknownKeyError:
            errors.print(f"no key has id {key_id!r} (see `offpeak keys list`)")
            raise typer.Exit(exit_codes.ERROR) from None
        console.print(f"key {key.id} ({key.prefix}…) revoked")

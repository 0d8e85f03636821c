"""The `signal` command: serve, manage API keys, list models, apply migrations."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

from app.catalog import Catalog
from app.db import Database, migrate_async
from app.errors import NotFound, SignalError
from app.server_url import running_url
from app.services.keys import KeyService
from app.services.login_links import LoginLinkService
from app.services.users import UserService
from app.settings import Settings
from app.startup import ADMIN_EMAIL, login_url, startup_lock
from app.tables import Run, User


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    settings = Settings()
    try:
        return int(args.handler(settings, args) or 0)
    except SignalError as error:
        print(f"error: {error.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="signal", description="Signal: LoRA fine-tuning as a service.")
    commands = parser.add_subparsers(title="commands")

    serve = commands.add_parser("serve", help="run the API server (applies migrations first)")
    serve.add_argument("--host", help="bind address (default SIGNAL_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default SIGNAL_PORT or 8000)")
    serve.set_defaults(handler=serve_command)

    runtime = commands.add_parser("runtime", help="run the GPU runtime on the data directory's Unix socket "
                                  "(DATA_DIR/runtime.sock) for every server process of this machine; `serve` "
                                  "starts one itself when none runs")
    runtime.set_defaults(handler=runtime_command)

    keys = commands.add_parser("keys", help="manage API keys").add_subparsers(title="keys commands")
    create = keys.add_parser("create", help="create a key (and the user, if new); prints the secret once")
    create.add_argument("--user", default=ADMIN_EMAIL, help=f"owner's email (default {ADMIN_EMAIL})")
    create.add_argument("--name", default="cli", help="a name to recognise the key by")
    create.set_defaults(handler=lambda s, a: _with_db(s, lambda db: _keys_create(db, a.user, a.name)))
    listing = keys.add_parser("list", help="list a user's keys")
    listing.add_argument("--user", default=ADMIN_EMAIL)
    listing.set_defaults(handler=lambda s, a: _with_db(s, lambda db: _keys_list(db, a.user)))
    revoke = keys.add_parser("revoke", help="revoke a key by id or prefix")
    revoke.add_argument("key", help="the key's id or its displayed prefix")
    revoke.add_argument("--user", default=ADMIN_EMAIL)
    revoke.set_defaults(handler=lambda s, a: _with_db(s, lambda db: _keys_revoke(db, a.user, a.key)))

    link = commands.add_parser("login-link", help="print a one-time dashboard sign-in link")
    link.add_argument("--user", default=ADMIN_EMAIL, help=f"who signs in (default {ADMIN_EMAIL}; created if new)")
    link.set_defaults(handler=lambda s, a: _with_db(s, lambda db: _login_link(db, s, a.user)))

    models = commands.add_parser("models", help="list the model catalogue")
    models.set_defaults(handler=models_command)

    pull = commands.add_parser("pull", help="copy a run's artifacts (config, journal, manifest, latest adapter, "
                               "checkpoints) to a local directory: pull before teardown")
    pull.add_argument("run_id", metavar="RUN_ID")
    pull.add_argument("dir", metavar="DIR", nargs="?", help="where to put them (default ./RUN_ID; must be new or empty)")
    pull.set_defaults(handler=pull_command)

    doctor = commands.add_parser("doctor", help="check the setup (Modal, Hugging Face, Supabase, database, disk, "
                                 "torch, the default model) and say how to fix what is missing")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(handler=doctor_command)

    migrate_parser = commands.add_parser("migrate", help="apply database migrations")
    migrate_parser.set_defaults(handler=migrate_command)
    return parser


def serve_command(settings: Settings, args: argparse.Namespace) -> int:
    import uvicorn

    from app.server import create_app

    updates: dict[str, object] = {key: getattr(args, key) for key in ("host", "port") if getattr(args, key)}
    settings = settings.model_copy(update=updates)
    # Migrations, the admin's key and sign-in link, the URL: all in the app's start, once (create_app refuses a
    # backend that cannot work before anything is created or printed).
    app = create_app(settings, announce=True)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def runtime_command(settings: Settings, args: argparse.Namespace) -> int:
    """Become the runtime (exec): it holds DATA_DIR/runtime.lock, so a second one on the same data dir refuses."""
    from gpu_runtime.client.runtime_client import RuntimeClient

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    client = RuntimeClient(data_dir=str(settings.data_dir), device=settings.device, options=settings.runtime_options(),
                          allow_downloads=settings.allow_downloads, threads=settings.threads)
    command = client.command(["--socket"])
    sys.stdout.flush()
    os.execve(command[0], command, client.environment())
    return 0  # not reached: exec replaced this process


def models_command(settings: Settings, args: argparse.Namespace) -> int:
    catalog = Catalog.from_file(settings.models_file)
    width = max(len(model.name) for model in catalog.list())
    for model in catalog.list():
        note = "offline" if model.offline else ""
        print(f"{model.name:<{width}}  {model.parameters / 1e9:>6.2f}B  {model.gpu:<12} {note}")
    return 0


def pull_command(settings: Settings, args: argparse.Namespace) -> int:
    from gpu_runtime.client.persistence import check_id
    from gpu_runtime.client.run_files import LocalRunFiles, RunFiles, VolumeRunFiles, pull_run

    run_id = check_id(args.run_id, "run_id")
    dest = Path(args.dir or run_id)
    files: RunFiles
    if settings.backend == "modal":
        from gpu_runtime.client.modal_names import VOLUME_NAME

        # The Volume is laid out by user: the run's owner comes from the database.
        files = VolumeRunFiles(VOLUME_NAME, _with_db(settings, lambda db: _run_owner(db, run_id)), run_id)
    else:
        files = LocalRunFiles(settings.data_dir, run_id)
    pulled = pull_run(files, dest)
    size = sum(item.size for item in pulled)
    print(f"pulled {len(pulled)} files ({size / 1e6:.1f} MB) of run {run_id} from {files.source} into {dest}")
    return 0


async def _run_owner(db: Database, run_id: str) -> str:
    async with db.session() as session:
        run = await session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id!r} not found in the database", field="run_id")
    return run.user_id


def doctor_command(settings: Settings, args: argparse.Namespace) -> int:
    from app.doctor import diagnose, render

    report = diagnose(settings)
    print(json.dumps(report.to_dict(), indent=2) if args.json else render(report))
    return 0 if report.ok else 1


def migrate_command(settings: Settings, args: argparse.Namespace) -> int:
    _migrate(settings)
    print("database is up to date")
    return 0


def _migrate(settings: Settings) -> None:
    async def locked() -> None:
        async with startup_lock(settings):
            await migrate_async(settings.resolved_database_url)

    asyncio.run(locked())


def server_url(settings: Settings) -> str:
    """The URL of the server serving this data directory, else the settings' (saying so, on stderr)."""
    url, source = running_url(settings.data_dir)
    if url is None:
        url = settings.resolved_public_url
        print(f"{source}; the link uses the settings' URL {url} (SIGNAL_PUBLIC_URL, or SIGNAL_HOST and SIGNAL_PORT)",
              file=sys.stderr)
    return url


async def _login_link(db: Database, settings: Settings, email: str) -> int:
    user, created = await UserService(db).get_or_create(email, is_admin=email == ADMIN_EMAIL)
    if created:
        print(f"created user {user.email}", file=sys.stderr)
    token = await LoginLinkService(db, settings.login_link_ttl_s).mint(user)
    print(f"sign-in link for {user.email} (works once, expires in {settings.login_link_ttl_s // 60} min):",
          file=sys.stderr)
    print(login_url(server_url(settings), token))
    return 0


T = TypeVar("T")


def _with_db(settings: Settings, action: Callable[[Database], Awaitable[T]]) -> T:
    _migrate(settings)

    async def run() -> T:
        db = Database(settings.resolved_database_url)
        try:
            return await action(db)
        finally:
            await db.dispose()

    return asyncio.run(run())


async def _keys_create(db: Database, email: str, name: str) -> int:
    user, created = await UserService(db).get_or_create(email)
    secret, key = await KeyService(db).create(user, name)
    if created:
        print(f"created user {user.email}", file=sys.stderr)
    print(f"created key {key.id} ({key.prefix}…) for {user.email}; the secret is shown this once:", file=sys.stderr)
    print(f"(for Tinker's SDK: TINKER_API_KEY=tml-{secret}; docs/TINKER.md)", file=sys.stderr)
    print(secret)
    return 0


async def _existing_user(db: Database, email: str) -> User:
    user = await UserService(db).find(email)
    if user is None:
        raise NotFound(f"no user {email!r}; `signal keys create --user {email}` creates one")
    return user


async def _keys_list(db: Database, email: str) -> int:
    user = await _existing_user(db, email)
    for key in await KeyService(db).list(user):
        state = "revoked" if key.revoked_at else "active"
        last = key.last_used_at.isoformat(timespec="seconds") if key.last_used_at else "never"
        print(f"{key.id}  {key.prefix}…  {state:<8} last used {last:<25} {key.name}")
    return 0


async def _keys_revoke(db: Database, email: str, ident: str) -> int:
    user = await _existing_user(db, email)
    keys = KeyService(db)
    ident = ident.removeprefix("tml-")  # the Tinker form of a key (tml-sk-…) names the same key
    matches = [key for key in await keys.list(user) if key.id == ident or key.prefix == ident]
    if len(matches) != 1:
        print(f"error: no single key of {user.email} has id or prefix {ident!r}", file=sys.stderr)
        return 1
    await keys.revoke(user, matches[0].id)
    print(f"revoked {matches[0].id} ({matches[0].prefix}…)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run the gateway, or make an API key.

python -m serving.gateway [--dev-key-file PATH]
    Serve: the API on the port, /metrics and /readyz on the metrics port (serving.gateway.http.server).
    Settings come from the environment (see serving.gateway.config.settings).
    --dev-key-file: with the in-memory key store only, make one key at start and write it
    to PATH (mode 0600; a symlink there is refused), since no other process can reach that
    store to create one.
python -m serving.gateway create-key --tenant T --name N [--model M ...]
    Print a new key, stored (hashed) in the Redis at LLMSTACK_REDIS_URL.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from serving.gateway.auth.keys import KeyStore, MemoryKeyStore, RedisKeyStore, create_key_sync
from serving.gateway.config.settings import REDIS_VAR, SettingsError, load_settings


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Access lines are JSON already: print them bare so log shippers can parse each line whole.
    access = logging.getLogger("llmstack.gateway.access")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False


def write_dev_key(path: Path, key: str) -> None:
    """Write `key` to `path`, readable by its owner only (0600), even if the file existed with
    wider permissions. A symlink at `path` is refused rather than followed: it could point the
    key somewhere others can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies to new files only
        file.write(key + "\n")


def _make_dev_key(store: KeyStore, path: Path) -> None:
    key, record = asyncio.run(store.create("local", "dev"))
    write_dev_key(path, key)
    logging.getLogger("llmstack.gateway").warning("wrote a dev key (key_id %s) to %s", record.key_id, path)


def serve(dev_key_file: Path | None) -> int:
    from serving.gateway.http import server
    from serving.gateway.http.app import create_apps

    settings = load_settings()
    store: KeyStore = RedisKeyStore(settings.redis_url) if settings.redis_url else MemoryKeyStore()
    if dev_key_file is not None:
        if store.shared_across_processes:
            print(
                f"--dev-key-file is for the in-memory store only; with {REDIS_VAR} set, use "
                "`python -m serving.gateway create-key`",
                file=sys.stderr,
            )
            return 2
        try:
            _make_dev_key(store, dev_key_file)
        except OSError as exc:  # ELOOP: a symlink there
            print(f"cannot write the dev key to {dev_key_file}: {exc.strerror} (a symlink is refused)", file=sys.stderr)
            return 2
    try:
        server.run(create_apps(settings, store), settings)
    except OSError as exc:
        print(f"llmstack gateway: {exc}", file=sys.stderr)
        return 1
    return 0


def create_key(tenant: str, name: str, models: list[str] | None) -> int:
    from redis.exceptions import RedisError

    try:
        key = create_key_sync(os.environ.get(REDIS_VAR) or None, tenant, name, allowed_models=models)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RedisError as exc:  # never print the URL: it may carry the AUTH token
        print(f"error: cannot store the key in the Redis at {REDIS_VAR}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(key)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.gateway", description="llmstack API gateway")
    parser.add_argument("--dev-key-file", type=Path, help="in-memory store only: write one new key here")
    commands = parser.add_subparsers(dest="command")
    make_key = commands.add_parser("create-key", help="print a new API key (stored hashed in Redis)")
    make_key.add_argument("--tenant", required=True, help="who owns the key")
    make_key.add_argument("--name", required=True, help="a label, e.g. ci-bot")
    make_key.add_argument("--model", action="append", dest="models", help="allow only this model (repeatable)")
    args = parser.parse_args(argv)

    _configure_logging()
    try:
        if args.command == "create-key":
            return create_key(args.tenant, args.name, args.models)
        return serve(args.dev_key_file)
    except SettingsError as exc:
        print(f"llmstack gateway: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Every Lua script the gateway runs is a .lua file read through one loader
(serving.gateway.redis.scripts): each one compiles in a real redis-server, and each one is in the
wheel, loaded from the installed package as the gateway image loads it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import redis

from serving.gateway.auth import keys
from serving.gateway.batch import store
from serving.gateway.limits import budgets, redis_limiter, usage_ledger
from serving.gateway.queue import fair_queue
from serving.gateway.redis.scripts import lua, shipped

ROOT = Path(__file__).resolve().parents[4]
# The scripts the gateway registers with Redis, each as the module builds it (some join files).
RUN = {
    "limits admit": redis_limiter.ADMIT_LUA,
    "limits settle": redis_limiter.SETTLE_LUA,
    "fair queue": fair_queue.LUA,
    "replace key": keys.REPLACE_LUA,
    **{
        f"batch {name}": getattr(store, f"{name.upper()}_LUA")
        for name in ("admit", "transition", "record", "ready", "claim", "delete_empty", "renew", "release")
    },
}


def test_every_lua_file_in_the_source_tree_is_found_by_the_loader():
    on_disk = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "serving" / "gateway").rglob("*.lua"))
    found = sorted(f"{package.replace('.', '/')}/{name}" for package, names in shipped().items() for name in names)
    assert found == on_disk
    assert len(found) >= 15


def test_every_script_compiles_in_redis(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    for name, script in RUN.items():
        assert client.script_load(script), name
    # The shared functions alone (the limiter's scripts join them in front of their own).
    for shared in (budgets.BUDGET_LUA, usage_ledger.LEDGER_LUA, lua("serving.gateway.limits", "limiter_prelude.lua")):
        assert client.script_load(shared + "\nreturn 1")


def test_an_installed_wheel_holds_and_loads_every_script(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(ROOT / "serving", source / "serving", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    code = (
        "import json, serving\n"
        "from serving.gateway.redis.scripts import lua, shipped\n"
        "import serving.gateway.limits.redis_limiter, serving.gateway.queue.fair_queue, serving.gateway.batch.store\n"
        "found = shipped()\n"
        "print(json.dumps({'from': serving.__file__, 'found': found,\n"
        "                  'sizes': {p + '/' + n: len(lua(p, n)) for p, names in found.items() for n in names}}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(result.stdout)
    assert report["from"].startswith(str(installed))
    assert report["found"] == shipped()
    for path, size in report["sizes"].items():
        package, name = path.rsplit("/", 1)
        assert size == len(lua(package, name)) > 0, path

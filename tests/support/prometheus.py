"""A real Prometheus (Debian's `prometheus` package, which `make test` installs with promtool) on
127.0.0.1, scraping the exports given to it once a second, always stopped. Tests that need it
skip when the binary is missing, saying how to install it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import httpx
import pytest
import yaml

from ops.harness.processes import background, free_port, wait_for_http
from tests.support.waiting import eventually


@contextmanager
def exports_served(texts: dict[str, str]) -> Iterator[dict[str, str]]:
    """Each text (Prometheus exposition format) at its own URL on one local server: name -> URL."""
    by_path = {f"/{name}/metrics": text for name, text in texts.items()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = by_path.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {name: f"127.0.0.1:{server.server_address[1]}/{name}/metrics" for name in texts}
    finally:
        server.shutdown()


@contextmanager
def prometheus_scraping(targets: dict[str, str], folder: Path) -> Iterator[str]:
    """Prometheus scraping each `host:port/path` target, labelled `pod=<name>` as the Prometheus
    community chart's `kubernetes-pods` job labels a pod's series; its base URL once every target
    has been scraped."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary: `make test` installs it (Debian/Ubuntu: apt-get install prometheus)")
    jobs = []
    for pod, target in targets.items():
        host, _, path = target.partition("/")
        jobs.append(
            {
                "job_name": pod,
                "scrape_interval": "1s",
                "metrics_path": f"/{path}",
                "static_configs": [{"targets": [host], "labels": {"pod": pod}}],
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": jobs}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}"]
    args += [f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with background(args, folder / "prometheus.log") as process:
        wait_for_http(f"{url}/-/ready", process, timeout_s=60, ok=lambda r: r.status_code == 200)

        every_target_up = f"count(up == 1) == {len(targets)}"

        def scraped() -> bool:
            answer = httpx.get(f"{url}/api/v1/query", params={"query": every_target_up}, timeout=5).json()
            return bool(answer["data"]["result"])

        eventually(scraped, f"Prometheus at {url} has scraped all {len(targets)} targets", poll_s=0.2)
        yield url

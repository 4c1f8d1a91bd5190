"""A local S3 (and STS) endpoint for the model cache tests and benchmark: moto's server mode.

It runs as its own process on 127.0.0.1 and a free port, so a benchmark's client and server
do not share one interpreter, and it is stopped (by its PID) when the block ends, pass or
fail. Clients reach it through boto3's standard `AWS_ENDPOINT_URL_<SERVICE>` variables,
which `endpoint_env` returns: the code under test builds its clients exactly as it does
against AWS. moto answers STS with account 123456789012.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ops.harness.processes import die_with_parent, free_port, terminate

MOTO_ACCOUNT = "123456789012"


@dataclass(frozen=True)
class LocalS3:
    endpoint: str

    def endpoint_env(self) -> dict[str, str]:
        """Environment for boto3 clients (ours, Ray's) to use this endpoint with dummy keys."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint,
            "AWS_ENDPOINT_URL_STS": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }


@contextmanager
def running_s3(timeout_s: float = 30) -> Iterator[LocalS3]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {endpoint}") from None
                time.sleep(0.1)
        yield LocalS3(endpoint)
    finally:
        terminate(process, grace_s=10)

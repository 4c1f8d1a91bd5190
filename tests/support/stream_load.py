"""Closed-loop streaming clients for the gateway-process tests: threads that each stream chat
completions one after another, every answer recorded in the order it ended."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tests.support.servers import HANG_BOUND_S


@dataclass(frozen=True)
class Answer:
    client: str  # the label the test gave the client that sent it (a tenant, a gateway)
    status: int
    queue_wait_ms: int  # x-queue-wait-ms, -1 when the answer has none


class StreamingClients:
    """One thread per (label, API base URL, key) in `clients`, each streaming chat completions of
    `model` back to back until the block ends."""

    def __init__(self, clients: Sequence[tuple[str, str, str]], model: str) -> None:
        self.model = model
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._answers: list[Answer] = []
        self._threads = [threading.Thread(target=self._client, args=client, daemon=True) for client in clients]

    def answers(self) -> list[Answer]:
        """Every answer so far, in the order they ended."""
        with self._lock:
            return list(self._answers)

    def _client(self, label: str, api: str, key: str) -> None:
        with httpx.Client(timeout=HANG_BOUND_S * 4) as client:
            while not self.stop.is_set():
                with client.stream(
                    "POST",
                    f"{api}/v1/chat/completions",
                    headers={"authorization": f"Bearer {key}"},
                    json={"model": self.model, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
                ) as response:
                    for _ in response.iter_bytes():
                        pass
                answer = Answer(label, response.status_code, int(response.headers.get("x-queue-wait-ms", "-1")))
                with self._lock:
                    self._answers.append(answer)

    def __enter__(self) -> StreamingClients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(HANG_BOUND_S * 4)

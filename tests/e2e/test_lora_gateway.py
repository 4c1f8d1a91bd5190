"""LoRA adapters through `make dev` (Ray Serve LLM, CPU vLLM, redis-server, the gateway) with the
official openai client: tenant A, granted `tiny-chat:sql` with `llmctl tenants set --adapter`, lists
and uses it; tenant B, granted nothing, gets 404 on the call, the list and a batch line, exactly as
for an unknown model, and never sees it; the usage lands on the adapter in the ledger and in
`llmctl cost report`.

Needs the adapters `make dev` serves on tiny-chat (`sql`, `pirate`: Pulumi.local.yaml's
`lora.adapters`); skipped with the reason when the stack file serves none."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
import yaml

from infra.spec.stack_file import PROJECT_ROOT

BASE, GRANTED, OTHER = "tiny-chat", "tiny-chat:sql", "tiny-chat:pirate"
MESSAGES = [{"role": "user", "content": "List three colours."}]


def served_adapters(stack_text: str) -> set[str]:
    """`<model id>:<adapter id>` for every adapter the stack file's models list under `lora.adapters`."""
    models = (yaml.safe_load(stack_text) or {}).get("config", {}).get("llmstack:models") or []
    return {
        f"{model.get('id')}:{adapter.get('id')}"
        for model in models
        for adapter in ((model.get("lora") or {}).get("adapters") or [])
        if isinstance(adapter, dict)
    }


pytestmark = pytest.mark.skipif(
    not {GRANTED, OTHER} <= served_adapters((PROJECT_ROOT / "Pulumi.local.yaml").read_text()),
    reason=f"Pulumi.local.yaml serves no LoRA adapters {GRANTED} and {OTHER} (issue 28's make dev adapters)",
)


def new_key(dev_stack, tenant: str) -> str:
    made = dev_stack.llmctl("keys", "create", "--tenant", tenant, "--name", "e2e-lora")
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().splitlines()[-1]


def client(dev_stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=dev_stack.ready["base_url"], api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tenants(dev_stack) -> dict[str, str]:
    """Keys of tenant A (granted tiny-chat:sql through its tenant record) and tenant B (nothing)."""
    granted = dev_stack.llmctl("tenants", "set", "e2e-lora-a", "--adapter", GRANTED)
    assert granted.returncode == 0, granted.stderr
    return {"a": new_key(dev_stack, "e2e-lora-a"), "b": new_key(dev_stack, "e2e-lora-b")}


def answer(llm: openai.OpenAI, model: str) -> str:
    reply = llm.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


def test_tenant_a_lists_and_uses_its_adapter_and_only_it(dev_stack, tenants) -> None:
    llm = client(dev_stack, tenants["a"])
    listed = {m.id: m for m in llm.models.list()}
    assert GRANTED in listed and OTHER not in listed and BASE in listed
    assert (listed[GRANTED].model_extra or {}).get("parent") == BASE
    answer(llm, GRANTED)
    with pytest.raises(openai.NotFoundError):
        answer(llm, OTHER)


def test_the_adapter_really_applies(dev_stack, tenants) -> None:
    llm = client(dev_stack, tenants["a"])
    assert answer(llm, GRANTED) != answer(llm, BASE)


def test_tenant_b_gets_404_like_an_unknown_model_on_call_list_and_batch(dev_stack, tenants) -> None:
    llm = client(dev_stack, tenants["b"])
    assert not [m.id for m in llm.models.list() if ":" in m.id]
    with pytest.raises(openai.NotFoundError) as unknown:
        answer(llm, "no-such-model")
    with pytest.raises(openai.NotFoundError) as adapter:
        answer(llm, GRANTED)
    expected = unknown.value.response.json()["error"]
    expected["message"] = expected["message"].replace(repr("no-such-model"), repr(GRANTED))
    assert adapter.value.response.json()["error"] == expected

    lines = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"model": m, "messages": MESSAGES}}
        for cid, m in (("adapter", GRANTED), ("unknown", "no-such-model"), ("base", BASE))
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = llm.files.create(file=("lora.jsonl", content), purpose="batch")
    batch = llm.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := llm.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed"
    errors = {
        x["custom_id"]: x["response"] for x in map(json.loads, llm.files.content(batch.error_file_id).text.splitlines())
    }
    assert set(errors) == {"adapter", "unknown"}
    assert errors["adapter"]["status_code"] == errors["unknown"]["status_code"] == 404
    message = errors["unknown"]["body"]["error"]["message"].replace(repr("no-such-model"), repr(GRANTED))
    assert errors["adapter"]["body"]["error"] == {**errors["unknown"]["body"]["error"], "message": message}


def test_usage_lands_on_the_adapter_in_the_ledger_and_the_showback(dev_stack, tenants, e2e_stack_file: Path) -> None:
    answer(client(dev_stack, tenants["a"]), GRANTED)
    report = dev_stack.llmctl("cost", "report", "--stack", str(e2e_stack_file), "--since", "1d", "--offline", "--json")
    assert report.returncode == 0, report.stderr
    rows = json.loads(report.stdout)["rows"]
    mine = [r for r in rows if r["tenant"] == "e2e-lora-a" and r["model"] == GRANTED]
    assert mine and all(r["kind"] == "usage" for r in mine)
    assert not [r for r in rows if r["tenant"] == "e2e-lora-b" and ":" in (r["model"] or "")]

"""How the kill benchmarks find a Serve replica's worker by the title Ray gives it."""

from __future__ import annotations

from ops.benchmarks.replicas import is_replica_title


def test_replica_titles():
    deployment = "LLMServer:tiny-chat"
    assert is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat"], deployment)
    assert is_replica_title(
        ["ray::ServeReplica:llm:LLMServer:tiny-chat.handle_request_with_rejection", "", "  "], deployment
    )
    assert is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat" + " " * 300], deployment)
    assert is_replica_title(
        ["ray::SERVE_REPLICA::llm#LLMServer:tiny-chat#w8kz8qmf:ServeReplica:llm:LLMServer:tiny-chat.__init__"],
        deployment,
    )
    assert not is_replica_title(["ray::ServeReplica:llm:LLMServer:tiny-chat-ngram"], deployment)
    assert not is_replica_title(["ray::ServeReplica:llm:OpenAiIngress"], deployment)
    assert not is_replica_title(["VLLM::EngineCore"], deployment) and not is_replica_title([], deployment)

"""`llmctl status`'s LoRA table: which adapters each replica holds, read from Ray's metrics export
in Prometheus text format (as a node's metrics port serves it, local) or through the Prometheus that
scrapes the Ray pods (cloud), and where Ray says the exports are."""

from __future__ import annotations

from pathlib import Path

from ops.llmctl.status.report import (
    AdapterRow,
    MetricsScrape,
    adapter_rows,
    adapters_from_query,
    loaded_adapters,
    ray_metrics_targets,
)

DATA = Path(__file__).parent / "data"
# node_b.prom: an excerpt of a live Ray 2.60 node's export (make dev's tiny-chat replica after a
# request to each adapter), verbatim. node_a.prom: the same series and labels for a replica that
# holds `sql` and has dropped `pirate` (0, as Serve sets it on unload), beside another model's.
NODE_EXPORT = (DATA / "node_a.prom").read_text()
SECOND_NODE = (DATA / "node_b.prom").read_text()


def test_a_node_export_names_the_adapters_its_replicas_hold_not_the_unloaded():
    assert loaded_adapters(NODE_EXPORT, "10.0.0.1") == [
        AdapterRow(model="tiny-chat", adapter="sql", replica="r1abc", node="10.0.0.1"),
        AdapterRow(model="other", adapter="legal", replica="r9xyz", node="10.0.0.1"),
    ]
    assert loaded_adapters("# no Serve replica on this node\n", "10.0.0.2") == []


def test_rows_per_replica_across_nodes_and_a_model_with_none_loaded():
    rows, note = adapter_rows(
        ["tiny-chat", "idle-chat"],
        [MetricsScrape(node="10.0.0.2", text=SECOND_NODE), MetricsScrape(node="10.0.0.1", text=NODE_EXPORT)],
    )
    assert [(r.model, r.adapter, r.replica, r.node) for r in rows] == [
        ("idle-chat", None, None, None),
        ("tiny-chat", "pirate", "8redenjb", "10.0.0.2"),
        ("tiny-chat", "sql", "r1abc", "10.0.0.1"),
        ("tiny-chat", "sql", "8redenjb", "10.0.0.2"),
    ]
    assert note is None  # every node read; `other` is not a model of this stack with lora


def test_an_unread_node_is_said_and_a_stack_without_lora_has_no_table():
    rows, note = adapter_rows(
        ["tiny-chat"], [MetricsScrape(node="ray-worker-1", error="HTTP 403 Forbidden: needs get on pods/proxy")]
    )
    assert rows == [AdapterRow(model="tiny-chat", adapter=None)]
    assert note == "Ray metrics not read from ray-worker-1 (HTTP 403 Forbidden: needs get on pods/proxy)"
    assert adapter_rows(["tiny-chat"], [])[1] == "no Ray node to read the loaded adapters from"
    assert adapter_rows([], [MetricsScrape(node="n", text=NODE_EXPORT)]) == ([], None)


def test_metrics_targets_are_the_live_nodes_export_ports():
    nodes = [
        {"Alive": True, "alive": True, "NodeManagerAddress": "127.0.0.1", "MetricsExportPort": 51234},
        {"Alive": False, "alive": False, "NodeManagerAddress": "10.0.0.9", "MetricsExportPort": 8080},
        {"Alive": True, "NodeManagerAddress": "fd00::5", "MetricsExportPort": 8080},
        {"Alive": True, "NodeManagerAddress": "10.0.0.3", "MetricsExportPort": -1},  # metrics collection off
    ]
    assert ray_metrics_targets(nodes) == [
        ("127.0.0.1", "http://127.0.0.1:51234/metrics"),
        ("fd00::5", "http://[fd00::5]:8080/metrics"),
    ]


def test_a_prometheus_answer_without_pod_labels_names_the_scrape_target():
    """(A real Prometheus's answer, with pod labels: tests/ops/llmctl/status/test_status.py.)"""
    answer = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"model_id": "m:a", "replica": "r", "instance": "10.0.0.7:8080"}, "value": [1.0, "1"]},
                {"metric": {"model_id": "m:b", "replica": "r", "instance": "10.0.0.7:8080"}, "value": [1.0, "0"]},
                {"metric": {"model_id": "base-only", "instance": "10.0.0.7:8080"}, "value": [1.0, "1"]},
            ],
        },
    }
    assert adapters_from_query(answer) == [AdapterRow(model="m", adapter="a", replica="r", node="10.0.0.7:8080")]
    assert adapters_from_query({"status": "success", "data": {"resultType": "vector", "result": []}}) == []

"""The nodes' figures as Prometheus families from scripted cluster snapshots, and request figures of a cut-off job (no engine)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from orchard.cluster.gateway.backend import ModelInfo
from orchard.cluster.gateway.jobs import Generation, Job
from orchard.cluster.gateway.metrics import GatewayMetrics
from orchard.node.types import CompletionOutput, RequestOutput, SamplingParams


def snapshot(generated: int, decisions: list[dict] | None = None, model: str = "m") -> dict:
    nodes = [{"node": "a", "model": "real/path", "generated_tokens": generated, "kv_blocks_used": 2, "kv_blocks_total": 8},
             {"node": "b", "model": "real/path", "generated_tokens": 5, "kv_blocks_used": 0, "kv_blocks_total": 0}]
    info = {"model": model, "nodes": nodes, "queue_depth": 0}
    if decisions is not None:
        info["coordinator"] = {"routing": {"decisions": decisions}}
    return info


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_kv_use_is_a_fraction_per_node_under_both_vllm_spellings():
    out = samples(GatewayMetrics().render(snapshot(10)))
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert out[(name, (("model_name", "m"), ("node", "a")))] == 0.25
        assert out[(name, (("model_name", "m"), ("node", "b")))] == 0.0  # no pool yet: not a division by zero


def test_a_node_counter_never_goes_down_between_scrapes():
    metrics = GatewayMetrics()
    key = ("vllm:generation_tokens_total", (("model_name", "m"), ("node", "a")))
    assert samples(metrics.render(snapshot(40)))[key] == 40
    assert samples(metrics.render(snapshot(0)))[key] == 40  # a heartbeat without the counter
    assert samples(metrics.render(snapshot(55)))[key] == 55


def test_routing_decisions_are_counted_by_node_and_reason_and_absent_without_a_coordinator():
    decisions = [{"node": "a", "reason": "prefix-hit", "count": 3}, {"node": "b", "reason": "load", "count": 1}]
    out = samples(GatewayMetrics().render(snapshot(1, decisions)))
    assert out[("orchard_routing_decisions_total", (("node", "a"), ("reason", "prefix-hit")))] == 3
    assert out[("orchard_routing_decisions_total", (("node", "b"), ("reason", "load")))] == 1
    assert not [k for k in samples(GatewayMetrics().render(snapshot(1))) if k[0].startswith("orchard_routing")]


def test_a_cluster_serving_several_models_labels_each_node_with_its_own():
    out = samples(GatewayMetrics().render(snapshot(1, model="x, y")))
    assert ("vllm:num_requests_running", (("model_name", "real/path"), ("node", "a"))) in out


class OneTokenThenWaits:
    """A backend whose job sends one token and then never finishes (until aborted)."""

    def __init__(self):
        self.aborted: list[str] = []

    async def generate(self, request_id, model, prompt_token_ids, params, session=None):
        yield RequestOutput(request_id, prompt_token_ids, [CompletionOutput(0, token_ids_delta=[7])], node_id="n1")
        await asyncio.Event().wait()

    async def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_job_cut_off_after_its_first_token_finishes_as_abort_on_its_node():
    backend, metrics = OneTokenThenWaits(), GatewayMetrics()
    generation = Generation(backend, ModelInfo("m", 64, None), None, metrics, timeout_s=None)

    async def first_output_then_leave():
        events = generation.outputs([Job("r1", [1, 2, 3])], SamplingParams(max_tokens=5))
        await anext(events)
        await events.aclose()

    asyncio.run(first_output_then_leave())
    out = samples(metrics.render({"nodes": []}))
    labels = (("finished_reason", "abort"), ("model_name", "m"), ("node", "n1"))
    assert out[("vllm:request_success_total", labels)] == 1 and backend.aborted == ["r1"]
    assert out[("vllm:prompt_tokens_total", (("model_name", "m"), ("node", "n1")))] == 3

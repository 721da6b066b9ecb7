"""Sticky sessions in the router: a conversation stays on its last node while that node has room."""

from __future__ import annotations

import pytest

from orchard.cluster.coordinator import router as router_module
from orchard.cluster.coordinator.membership import Membership, NodeInfo, NodeLoad
from orchard.cluster.coordinator.router import Router, RouteRequest

BS = 16


def cluster(*node_ids, max_num_seqs=4, kv_blocks_total=64):
    members = Membership(clock=lambda: 0.0)
    for node_id in node_ids:
        members.register(node_id, NodeInfo(model="m", block_size=BS, max_num_seqs=max_num_seqs, kv_blocks_total=kv_blocks_total))
        members.heartbeat(node_id, NodeLoad(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, kv_blocks_total=kv_blocks_total))
    return members


def ask(router, members, held, session="", num_tokens=256, policy=None):
    request = RouteRequest(model="m", num_tokens=num_tokens, block_size=BS, held=held, session=session)
    return router.route(request, members.candidates("m"), policy=policy)


def test_a_sessions_next_request_goes_to_its_last_node_although_another_holds_the_prompt():
    members, router = cluster("a", "b"), Router()
    first = ask(router, members, {"a": 8}, session="agent-1")
    assert (first.node_id, first.reason) == ("a", "prefix-hit")
    # The next turn's prefix is only indexed on b so far (a's KV events have not arrived): the
    # session still goes to a, where its conversation was computed.
    second = ask(router, members, {"b": 4}, session="agent-1")
    assert (second.node_id, second.reason) == ("a", "session")
    assert router.session_node("agent-1") == "a"
    # without the session the same request goes by its prefix
    assert ask(router, members, {"b": 4}).node_id == "b"


def test_a_full_node_hands_the_session_to_the_router_and_the_session_moves():
    members, router = cluster("a", "b", max_num_seqs=2), Router()
    assert ask(router, members, {"a": 8}, session="s").node_id == "a"
    members.heartbeat("a", NodeLoad(running=2, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, kv_blocks_total=64))
    moved = ask(router, members, {"b": 8}, session="s")
    assert (moved.node_id, moved.reason) == ("b", "prefix-hit")  # the prefix router's own choice
    members.heartbeat("a", NodeLoad(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, kv_blocks_total=64))
    back = ask(router, members, {"a": 8}, session="s")
    assert (back.node_id, back.reason) == ("b", "session")  # it stays where it moved


def test_a_node_without_kv_blocks_for_the_uncached_prompt_is_not_kept():
    members, router = cluster("a", "b", kv_blocks_total=64), Router()
    assert ask(router, members, {}, session="s", num_tokens=64).node_id in ("a", "b")
    home = router.session_node("s")
    full = NodeLoad(kv_blocks_used=60, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0, kv_blocks_total=64)
    members.heartbeat(home, full)
    assert ask(router, members, {}, session="s", num_tokens=64).reason == "session"  # 4 blocks fit in 4 free
    assert ask(router, members, {}, session="s", num_tokens=80).node_id != home  # 5 do not


@pytest.mark.parametrize("leave", ["drain", "dead"])
def test_a_drained_or_dead_node_loses_its_sessions(leave):
    members, router = cluster("a", "b"), Router()
    assert ask(router, members, {"a": 8}, session="s").node_id == "a"
    members.drain("a") if leave == "drain" else members.mark_dead("a", "test")
    assert ask(router, members, {"a": 8}, session="s").node_id == "b"


def test_baseline_policies_ignore_sessions():
    members, router = cluster("a", "b"), Router()
    nodes = {ask(router, members, {}, session="s", policy="round_robin").node_id for _ in range(4)}
    assert nodes == {"a", "b"}


def test_the_router_remembers_a_bounded_number_of_sessions(monkeypatch):
    monkeypatch.setattr(router_module, "SESSIONS_KEPT", 2)
    members, router = cluster("a", "b"), Router()
    for session in ("s1", "s2", "s3"):
        ask(router, members, {}, session=session)
    assert router.session_node("s1") is None
    assert router.session_node("s2") and router.session_node("s3")

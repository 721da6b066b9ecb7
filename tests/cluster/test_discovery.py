"""Signed advertisements, the cluster token, and the join agent's reconciliation (no network)."""

from __future__ import annotations

import json
import os
import stat
import subprocess

import pytest

from orchard.cluster.discovery import cluster_token as ct
from orchard.cluster.discovery.adverts import (
    SIGNED_KEYS,
    Advertisement,
    AdvertVerifier,
    BadSignature,
    MalformedField,
    MissingField,
    OtherCluster,
    ReplayedAdvert,
    StaleAdvert,
    signed_txt,
)
from orchard.node.serving.agent import (
    LABEL_CHIP,
    LABEL_DEVICE,
    LABEL_MEMORY,
    AgentConfig,
    HeadSighting,
    JoinAgent,
    label_value,
    node_labels,
    ray_environment,
    ray_start_command,
)

TOKEN = "t" * 40
KEY = ct.advert_key(TOKEN)
NOW = 1_800_000_000.0


class Clock:
    def __init__(self, t: float = NOW):
        self.t = t

    def __call__(self) -> float:
        return self.t


def advert(ts: float = NOW, **over) -> Advertisement:
    fields = dict(cluster="orchard", ray_address="10.213.0.2:6379", gateway_url="http://10.213.0.2:8000",
                  version="0.1.0", head_id="a1b2c3d4e5f6", timestamp=ts)
    return Advertisement(**{**fields, **over})


def txt_bytes(txt: dict[str, str]) -> dict[bytes, bytes]:
    """The shape zeroconf hands over."""
    return {k.encode(): v.encode() for k, v in txt.items()}


def verifier(clock: Clock | None = None, window: float = 60.0, cluster: str = "orchard", key: bytes = KEY):
    return AdvertVerifier(cluster, key, replay_window_s=window, clock=clock or Clock())


# ---- signing and checking -----------------------------------------------------------
def test_signed_advert_round_trips_through_zeroconf_bytes():
    a = advert()
    got = verifier().verify(txt_bytes(signed_txt(a, KEY)))
    assert got == a
    assert (got.ray_host, got.ray_port) == ("10.213.0.2", 6379)


@pytest.mark.parametrize("field,value", [
    ("ray", "10.213.0.66:6379"), ("gateway", "http://evil:8000"), ("cluster", "orchard "),
    ("version", "9.9.9"), ("head", "ffffffffffff"), ("ts", f"{NOW + 0.001:.3f}"), ("proto", "1 "),
])
def test_tampering_with_any_signed_field_breaks_the_signature(field, value):
    txt = signed_txt(advert(), KEY)
    txt[field] = value
    with pytest.raises((BadSignature, OtherCluster, MalformedField)) as exc:
        verifier().verify(txt)
    if field not in ("cluster", "proto"):
        assert exc.type is BadSignature


def test_every_field_but_the_signature_is_signed():
    assert set(SIGNED_KEYS) == set(advert().txt_fields())


def test_advert_signed_with_another_token_is_rejected():
    txt = signed_txt(advert(), ct.advert_key("x" * 40))
    with pytest.raises(BadSignature):
        verifier().verify(txt)


def test_raw_token_is_not_the_signing_key():
    txt = signed_txt(advert(), TOKEN.encode())
    with pytest.raises(BadSignature):
        verifier().verify(txt)


def test_advert_for_another_cluster_is_rejected_before_the_signature():
    other_key = ct.advert_key("o" * 40)
    txt = signed_txt(advert(cluster="lab"), other_key)
    with pytest.raises(OtherCluster, match="'lab'"):
        verifier().verify(txt)


@pytest.mark.parametrize("missing", [*SIGNED_KEYS, "sig"])
def test_missing_field_is_rejected_by_name(missing):
    txt = signed_txt(advert(), KEY)
    del txt[missing]
    with pytest.raises(MissingField, match=missing):
        verifier().verify(txt)


def test_field_without_value_counts_as_missing():
    txt = txt_bytes(signed_txt(advert(), KEY))
    txt[b"ray"] = None
    with pytest.raises(MissingField, match="ray"):
        verifier().verify(txt)


@pytest.mark.parametrize("age", [60.5, -60.5, 3600.0])
def test_timestamp_outside_the_window_is_stale(age):
    with pytest.raises(StaleAdvert):
        verifier(Clock(NOW + age)).verify(signed_txt(advert(), KEY))


@pytest.mark.parametrize("age", [59.9, -59.9, 0.0])
def test_timestamp_inside_the_window_either_side_is_accepted(age):
    assert verifier(Clock(NOW + age)).verify(signed_txt(advert(), KEY)).timestamp == NOW


def test_older_advert_after_a_newer_one_is_a_replay():
    clock = Clock(NOW + 20)
    v = verifier(clock)
    v.verify(signed_txt(advert(ts=NOW + 10, head_id="new000000000"), KEY))
    with pytest.raises(ReplayedAdvert):
        v.verify(signed_txt(advert(ts=NOW, head_id="old000000000"), KEY))


def test_repeated_identical_advert_is_accepted_again():
    v = verifier()
    txt = signed_txt(advert(), KEY)
    assert v.verify(txt) == v.verify(txt)


def test_rejected_advert_does_not_move_the_replay_mark():
    v = verifier(Clock(NOW + 20))
    forged = signed_txt(advert(ts=NOW + 30), ct.advert_key("x" * 40))
    with pytest.raises(BadSignature):
        v.verify(forged)
    assert v.verify(signed_txt(advert(ts=NOW + 5), KEY)).timestamp == NOW + 5


@pytest.mark.parametrize("ts", ["nan", "inf", "soon"])
def test_non_numeric_or_infinite_timestamp_is_malformed(ts):
    fields = advert().txt_fields() | {"ts": ts}
    from orchard.cluster.discovery.adverts import signature

    txt = {**fields, "sig": signature(fields, KEY)}
    with pytest.raises(MalformedField):
        verifier().verify(txt)


def test_ray_address_without_port_is_malformed():
    with pytest.raises(MalformedField, match="HOST:PORT"):
        verifier().verify(signed_txt(advert(ray_address="10.213.0.2"), KEY))


def test_signature_is_not_confused_by_field_boundaries():
    a = signed_txt(advert(ray_address="a:1", gateway_url="b"), KEY)
    b = signed_txt(advert(ray_address="a", gateway_url=":1b"), KEY)
    assert a["sig"] != b["sig"]


# ---- the cluster token --------------------------------------------------------------
@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ct.CONFIG_DIR_ENV, str(tmp_path / "cfg"))
    monkeypatch.delenv(ct.TOKEN_ENV, raising=False)
    return tmp_path / "cfg"


def test_first_start_creates_a_0600_token_and_later_starts_reuse_it(config_dir):
    token, created = ct.load_or_create_token("orchard")
    assert created and len(token) >= ct.MIN_TOKEN_CHARS
    path = config_dir / "orchard.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(config_dir.stat().st_mode) == 0o700
    assert ct.load_or_create_token("orchard") == (token, False)


def test_tokens_differ_per_creation(config_dir):
    assert ct.new_token() != ct.new_token()


def test_group_readable_token_file_is_refused(config_dir):
    ct.save_token("orchard", TOKEN)
    os.chmod(config_dir / "orchard.token", 0o640)
    with pytest.raises(ct.InsecureTokenFile, match="chmod 600"):
        ct.load_token("orchard")


def test_missing_token_says_where_to_put_it(config_dir):
    with pytest.raises(ct.TokenNotFound, match="orchard.token"):
        ct.load_token("orchard")


def test_env_token_wins_over_the_file(config_dir, monkeypatch):
    ct.save_token("orchard", TOKEN)
    monkeypatch.setenv(ct.TOKEN_ENV, "e" * 40)
    assert ct.load_token("orchard") == "e" * 40


def test_short_token_is_refused(config_dir):
    with pytest.raises(ct.WeakToken):
        ct.save_token("orchard", "short")


@pytest.mark.parametrize("name", ["", "-x", "a b", "a/b", "x" * 64, "../etc"])
def test_cluster_names_that_are_not_dns_labels_are_refused(name):
    with pytest.raises(ct.InvalidClusterName):
        ct.validate_cluster_name(name)


def test_token_comparison_and_derived_keys():
    assert ct.tokens_equal(TOKEN, "t" * 40) and not ct.tokens_equal(TOKEN, "t" * 39 + "u")
    ray_token = ct.ray_auth_token(TOKEN)
    assert len(ray_token) == 64 and int(ray_token, 16) >= 0
    assert ray_token != ct.advert_key(TOKEN).hex()
    assert ct.ray_auth_token(TOKEN) == ray_token  # deterministic: head and nodes agree


# ---- the join agent -----------------------------------------------------------------
class FakeRay:
    """Stands in for `ray start --block` processes; records commands and signals."""

    def __init__(self):
        self.started: list[FakeRay.Proc] = []

    class Proc:
        def __init__(self, cmd, env):
            self.cmd, self.env = cmd, env
            self.returncode = None
            self.terminated = False
            self.pid = 2**22 + len(cmd)  # above Linux's default pid_max: no real group has it

        def poll(self):
            return self.returncode

        def terminate(self):
            self.terminated = True
            self.returncode = 0

        def wait(self, timeout=None):
            return self.returncode

        def kill(self):
            self.returncode = -9

    def __call__(self, cmd, env, **kw):
        proc = FakeRay.Proc(cmd, env)
        self.started.append(proc)
        return proc


LABELS = {LABEL_CHIP: "Apple-M2-Max", LABEL_MEMORY: "96", LABEL_DEVICE: "metal"}


def make_agent(fake: FakeRay, clock: Clock, drain=None) -> JoinAgent:
    cfg = AgentConfig(num_cpus=1, backoff_initial_s=2.0, backoff_max_s=8.0)
    return JoinAgent(cfg, ray_token="r" * 64, drain=drain, labels=LABELS, spawn=fake, clock=clock)


def test_ray_start_command_carries_resource_labels_and_address():
    cmd = ray_start_command(AgentConfig(num_cpus=2, node_ip="10.213.0.3"), HeadSighting("10.213.0.2:6379", "h1"),
                            LABELS, ray="ray")
    assert cmd[:3] == ["ray", "start", "--block"]
    assert cmd[cmd.index("--address") + 1] == "10.213.0.2:6379"
    assert json.loads(cmd[cmd.index("--resources") + 1]) == {"orchard_node": 1}
    assert cmd[cmd.index("--labels") + 1] == "orchard/chip=Apple-M2-Max,orchard/memory-gib=96,orchard/mlx-device=metal"
    assert cmd[cmd.index("--num-cpus") + 1] == "2"
    assert cmd[cmd.index("--node-ip-address") + 1] == "10.213.0.3"


def test_ray_environment_turns_token_auth_on():
    env = ray_environment("r" * 64, base={"RAY_AUTH_TOKEN_PATH": "/x"})
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"] == "r" * 64
    assert "RAY_AUTH_TOKEN_PATH" not in env and env["RAY_USAGE_STATS_ENABLED"] == "0"


def test_detected_labels_are_valid_ray_labels():
    from ray._private.label_utils import validate_label_key, validate_label_value

    labels = node_labels({"orchard/rack": "shelf 2 (left)"})
    for k, v in labels.items():
        assert validate_label_key(k) is None
        validate_label_value(v)
    assert labels["orchard/rack"] == "shelf-2-left"
    assert labels[LABEL_DEVICE] in {"metal", "cuda", "cpu"}
    assert int(labels[LABEL_MEMORY]) >= 1


@pytest.mark.parametrize("raw,want", [("Apple M2 Max", "Apple-M2-Max"), ("  ", "unknown"),
                                      ("Intel(R) Xeon(R)", "Intel-R-Xeon-R"), ("x" * 80, "x" * 63)])
def test_label_value_sanitizes(raw, want):
    assert label_value(raw) == want


def test_agent_joins_once_per_head_and_not_before_one_is_seen():
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock)
    agent.reconcile()
    assert fake.started == []
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))  # a refresh of the same head
    agent.reconcile()
    assert len(fake.started) == 1
    assert fake.started[0].env["RAY_AUTH_TOKEN"] == "r" * 64
    assert agent.joined == HeadSighting("10.213.0.2:6379", "h1")


def test_head_restart_stops_the_old_node_and_joins_the_new_head():
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock)
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h2"))
    agent.reconcile()
    assert [p.terminated for p in fake.started] == [True, False]
    assert agent.joined.head_id == "h2"


def test_exited_node_rejoins_after_a_doubling_backoff():
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock)
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    fake.started[-1].returncode = 1
    agent.reconcile()  # notices the exit; retry at t=2
    assert agent.joined is None and len(fake.started) == 1
    clock.t = 2.0
    agent.reconcile()
    assert len(fake.started) == 2
    fake.started[-1].returncode = 1
    agent.reconcile()  # second failure: retry 4 s later
    clock.t = 5.9
    agent.reconcile()
    assert len(fake.started) == 2
    clock.t = 6.0
    agent.reconcile()
    assert len(fake.started) == 3


def test_new_head_skips_the_backoff():
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock)
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    fake.started[-1].returncode = 1
    agent.reconcile()
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h2"))
    agent.reconcile()
    assert len(fake.started) == 2 and agent.joined.head_id == "h2"


def test_leaving_drains_before_stopping_ray():
    order = []
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock, drain=lambda: order.append(("drain", fake.started[0].terminated)))
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    agent.leave()
    assert order == [("drain", False)] and fake.started[0].terminated


def test_failing_drain_still_stops_ray():
    fake, clock = FakeRay(), Clock(0)

    def broken_drain():
        raise ConnectionError("head gone")

    agent = make_agent(fake, clock, drain=broken_drain)
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    agent.leave()
    assert fake.started[0].terminated and agent.joined is None


def test_head_gone_keeps_the_running_node_but_stops_new_joins():
    fake, clock = FakeRay(), Clock(0)
    agent = make_agent(fake, clock)
    agent.head_seen(HeadSighting("10.213.0.2:6379", "h1"))
    agent.reconcile()
    agent.head_gone()
    agent.reconcile()
    assert not fake.started[0].terminated
    fake.started[0].returncode = 1
    clock.t = 100
    agent.reconcile()
    agent.reconcile()
    assert len(fake.started) == 1


def test_real_process_is_stopped_with_its_group(tmp_path):
    """A real child stands in for `ray start --block`: SIGTERM ends it within the grace."""
    script = tmp_path / "fake_ray.py"
    script.write_text("import time\nwhile True: time.sleep(0.1)\n")
    import sys

    agent = JoinAgent(AgentConfig(stop_grace_s=5), labels=LABELS,
                      spawn=lambda cmd, **kw: subprocess.Popen([sys.executable, str(script)], **kw))
    agent.head_seen(HeadSighting("127.0.0.1:1", "h1"))
    agent.reconcile()
    child = agent._child
    agent.leave()
    assert child.returncode == -15


def test_stopping_refuses_a_group_that_is_not_a_child_session():
    from orchard.node.serving.agent import stop_process_group

    class NotOurs:
        pid = 0

    with pytest.raises(ValueError, match="process group 0"):
        stop_process_group(NotOurs(), grace_s=1)


def test_stopping_waits_for_grandchildren_and_kills_those_that_ignore_sigterm(tmp_path):
    from orchard.node.serving.agent import _group_alive, stop_process_group

    child = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 30 & wait"], start_new_session=True)
    import time

    time.sleep(0.3)
    assert _group_alive(child.pid)
    stop_process_group(child, grace_s=1)
    assert not _group_alive(child.pid) and child.returncode is not None


# ---- `orchard head` pieces ----------------------------------------------------------
def _head_args(*argv: str):
    from orchard.cluster.cli.main import build_parser

    return build_parser().parse_args(["head", *argv])


def test_head_defaults_to_loopback_and_then_does_not_advertise(caplog):
    from orchard.cluster.cli.head import config_from_args
    from orchard.cluster.runtime.head import Head

    config = config_from_args(_head_args())
    assert (config.bind, config.ray_address, config.loopback) == ("127.0.0.1", "127.0.0.1:6379", True)
    head = Head(config, TOKEN)
    with caplog.at_level("WARNING"):
        head._advertise()
    assert head._advertiser is None and "not advertising" in caplog.text


def test_head_refuses_a_lan_bind_without_api_key_before_starting_ray(config_dir, capsys, monkeypatch):
    from orchard.cluster.cli import head

    monkeypatch.delenv("ORCHARD_API_KEYS", raising=False)
    monkeypatch.setattr(head.Head, "run", lambda *a: pytest.fail("Ray must not start"))
    assert head.run(_head_args("--bind", "10.213.0.2")) == 2
    assert "API key" in capsys.readouterr().err
    assert not (config_dir / "orchard.token").exists()


def test_head_ray_command_binds_as_asked_and_offers_orchard_node():
    from orchard.cluster.cli.head import config_from_args
    from orchard.cluster.runtime.head import ray_head_command

    cmd = ray_head_command(config_from_args(_head_args("--bind", "10.213.0.2", "--ray-port", "6380", "--num-cpus",
                                                       "1", "--ray-only")), ray="ray")
    assert cmd[cmd.index("--node-ip-address") + 1] == "10.213.0.2"
    assert cmd[cmd.index("--port") + 1] == "6380"
    assert json.loads(cmd[cmd.index("--resources") + 1]) == {"orchard_node": 1}
    assert "--include-dashboard=false" in cmd
    no_serve = ray_head_command(config_from_args(_head_args("--no-serve-here")), ray="ray")
    assert "--resources" not in no_serve


def test_serve_child_gets_the_head_address_and_only_the_options_set():
    from orchard.cluster.cli.head import config_from_args, serve_argv

    args = _head_args("--bind", "10.213.0.2", "--port", "8100", "--api-key", "k1", "--api-key", "k2",
                      "--max-num-seqs", "4")
    assert serve_argv(args, config_from_args(args)) == [
        "serve", "--address", "10.213.0.2:6379", "--host", "10.213.0.2", "--port", "8100",
        "--api-key", "k1", "--api-key", "k2", "--max-num-seqs", "4",
    ]


def test_stale_ray_address_file_is_removed_only_when_nothing_listens(tmp_path):
    import socket

    from orchard.cluster.runtime.head import HeadConfig, clear_stale_ray_address

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    config = HeadConfig(ray_port=port, ray_temp_dir=str(tmp_path))
    address_file = tmp_path / "ray_current_cluster"
    address_file.write_text(f"127.0.0.1:{port}")
    clear_stale_ray_address(config)
    assert address_file.exists()  # a live listener: leave it for Ray to report
    server.close()
    clear_stale_ray_address(config)
    assert not address_file.exists()
    address_file.write_text("10.0.0.9:6379")  # another cluster's: never ours to remove
    clear_stale_ray_address(config)
    assert address_file.read_text() == "10.0.0.9:6379"


def test_join_labels_and_static_head_address():
    from orchard.cluster.cli.join import parse_labels, static_head_address

    assert parse_labels(["orchard/rack=a", "x=y=z"]) == {"orchard/rack": "a", "x": "y=z"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_labels(["novalue"])
    assert static_head_address("10.213.0.2") == "10.213.0.2:6379"
    assert static_head_address("10.213.0.2:7000") == "10.213.0.2:7000"


def test_browser_logs_each_rejection_once_per_instance_and_reason(caplog):
    from orchard.cluster.discovery.adverts import AdvertBrowser

    class Info:
        def __init__(self, properties):
            self.properties = properties

    class FakeZeroconf:
        def __init__(self, txt):
            self.txt = txt

        def get_service_info(self, service_type, name, timeout):
            return Info(self.txt[name])

    from zeroconf import ServiceStateChange

    good = txt_bytes(signed_txt(advert(), KEY))
    forged = txt_bytes(signed_txt(advert(ray_address="10.213.0.4:6379"), ct.advert_key("x" * 40)))
    seen, gone = [], []
    browser = AdvertBrowser(verifier(), seen.append, gone.append)
    zc = FakeZeroconf({"rogue": forged, "head": good})
    with caplog.at_level("INFO", logger="orchard.discovery"):
        for _ in range(3):
            browser._on_change(zc, "_orchard._tcp.local.", "rogue", ServiceStateChange.Updated)
        browser._on_change(zc, "_orchard._tcp.local.", "head", ServiceStateChange.Added)
        browser._on_change(zc, "_orchard._tcp.local.", "head", ServiceStateChange.Removed)
    assert [a.ray_address for a in seen] == ["10.213.0.2:6379"] and gone == ["head"]
    assert list(browser.rejected) == [("rogue", "bad-signature")] * 3
    assert caplog.text.count("ignoring advertisement rogue") == 1

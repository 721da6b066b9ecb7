"""Finding the head on the local network: signed zeroconf advertisements.

The head announces `_orchard._tcp.local.` with TXT fields that say where its Ray and
gateway listen. Multicast DNS believes anyone, so the fields carry an HMAC-SHA256 keyed
by a key derived from the cluster token, and a timestamp the head refreshes every few
seconds. A joiner acts only on an advertisement that names its cluster, carries a valid
HMAC, is fresh (within the replay window, either side of its clock) and is not older
than one it already accepted (an old advertisement replayed after a head restart cannot
send nodes back to the previous head). Anything else is ignored and logged.

Signing and checking are plain functions over a dict of strings (tested without a
network); `Advertiser` and `AdvertBrowser` are the zeroconf I/O around them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

SERVICE_TYPE = "_orchard._tcp.local."
PROTOCOL = "1"
DEFAULT_REPLAY_WINDOW_S = 60.0
DEFAULT_REFRESH_S = 10.0

# TXT keys; every one except the signature is covered by it, in this order.
SIGNED_KEYS = ("proto", "cluster", "ray", "gateway", "version", "head", "ts")
SIGNATURE_KEY = "sig"

log = logging.getLogger("orchard.discovery")


class AdvertRejected(Exception):
    """An advertisement this node must not act on; `reason` is a short, loggable tag."""

    reason = "rejected"


class MissingField(AdvertRejected):
    reason = "missing-field"


class MalformedField(AdvertRejected):
    reason = "malformed-field"


class OtherCluster(AdvertRejected):
    reason = "other-cluster"


class BadSignature(AdvertRejected):
    reason = "bad-signature"


class StaleAdvert(AdvertRejected):
    reason = "stale-timestamp"


class ReplayedAdvert(AdvertRejected):
    reason = "replayed"


class NoHeadFound(TimeoutError):
    """No valid advertisement for the cluster arrived in time."""


def orchard_version() -> str:
    try:
        from importlib.metadata import version

        return version("mlx-orchard")
    except Exception:  # not installed as a distribution (running from a checkout)
        return "0+unknown"


@dataclass(frozen=True)
class Advertisement:
    """What a head says about itself. `head_id` is random per head start, so a new value
    means the head restarted and joined nodes must join again."""

    cluster: str
    ray_address: str
    gateway_url: str
    version: str
    head_id: str
    timestamp: float

    def txt_fields(self) -> dict[str, str]:
        return {
            "proto": PROTOCOL,
            "cluster": self.cluster,
            "ray": self.ray_address,
            "gateway": self.gateway_url,
            "version": self.version,
            "head": self.head_id,
            "ts": f"{self.timestamp:.3f}",
        }

    @property
    def ray_host(self) -> str:
        return self.ray_address.rsplit(":", 1)[0]

    @property
    def ray_port(self) -> int:
        return int(self.ray_address.rsplit(":", 1)[1])


def _signed_message(fields: Mapping[str, str]) -> bytes:
    # A JSON list is unambiguous: no value can pretend to end one field and start the next.
    return b"orchard-advert\n" + json.dumps([fields[k] for k in SIGNED_KEYS]).encode()


def signature(fields: Mapping[str, str], key: bytes) -> str:
    return hmac.new(key, _signed_message(fields), hashlib.sha256).hexdigest()


def signed_txt(advert: Advertisement, key: bytes) -> dict[str, str]:
    """The TXT record for an advertisement: its fields plus their HMAC."""
    fields = advert.txt_fields()
    return {**fields, SIGNATURE_KEY: signature(fields, key)}


def decode_txt(properties: Mapping[bytes | str, bytes | str | None]) -> dict[str, str]:
    """zeroconf hands TXT entries over as bytes; keys without a value are dropped."""
    out = {}
    for k, v in properties.items():
        if v is None:
            continue
        key = k.decode("utf-8", "replace") if isinstance(k, bytes) else k
        out[key] = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    return out


class AdvertVerifier:
    """Checks advertisements for one cluster and remembers the newest one it accepted."""

    def __init__(self, cluster: str, key: bytes, replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
                 clock: Callable[[], float] = time.time):
        self.cluster = cluster
        self._key = key
        self.replay_window_s = replay_window_s
        self._clock = clock
        self._newest: float | None = None
        self._lock = threading.Lock()

    def verify(self, txt: Mapping[bytes | str, bytes | str | None]) -> Advertisement:
        """The advertisement, or AdvertRejected saying why not. Order matters: a foreign
        cluster is told apart from a forgery before the HMAC is checked."""
        fields = decode_txt(txt)
        missing = [k for k in (*SIGNED_KEYS, SIGNATURE_KEY) if not fields.get(k)]
        if missing:
            raise MissingField(f"advertisement lacks {', '.join(missing)}")
        if fields["proto"] != PROTOCOL:
            raise MalformedField(f"protocol {fields['proto']!r}, expected {PROTOCOL!r}")
        if fields["cluster"] != self.cluster:
            raise OtherCluster(f"advertisement for cluster {fields['cluster']!r}, not {self.cluster!r}")
        if not hmac.compare_digest(signature(fields, self._key), fields[SIGNATURE_KEY]):
            raise BadSignature(f"HMAC does not match for cluster {self.cluster!r} (wrong token or tampered fields)")
        advert = _parse(fields)
        self._accept(advert.timestamp)
        return advert

    def _accept(self, ts: float) -> None:
        age = self._clock() - ts
        if abs(age) > self.replay_window_s:
            raise StaleAdvert(f"timestamp is {age:+.1f}s from now; window is +-{self.replay_window_s:g}s")
        with self._lock:
            if self._newest is not None and ts < self._newest:
                raise ReplayedAdvert(f"timestamp {ts:.3f} is older than the accepted {self._newest:.3f}")
            self._newest = ts


def _parse(fields: Mapping[str, str]) -> Advertisement:
    try:
        ts = float(fields["ts"])
    except ValueError as exc:
        raise MalformedField(f"timestamp {fields['ts']!r} is not a number") from exc
    if not math.isfinite(ts):
        raise MalformedField(f"timestamp {fields['ts']!r} is not finite")
    host, sep, port = fields["ray"].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise MalformedField(f"Ray address {fields['ray']!r} is not HOST:PORT")
    return Advertisement(fields["cluster"], fields["ray"], fields["gateway"], fields["version"], fields["head"], ts)


def instance_name(cluster: str, head_id: str) -> str:
    return f"{cluster}-{head_id}.{SERVICE_TYPE}"


class Advertiser:
    """Announces one head and re-signs its TXT record every `refresh_s` seconds, so the
    timestamp stays inside joiners' replay window."""

    def __init__(self, advert: Advertisement, key: bytes, address: str, refresh_s: float = DEFAULT_REFRESH_S,
                 clock: Callable[[], float] = time.time):
        self._advert = advert
        self._key = key
        self._address = address
        self._refresh_s = refresh_s
        self._clock = clock
        self._zc = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        from zeroconf import IPVersion, Zeroconf

        self._zc = Zeroconf(interfaces=[self._address], ip_version=IPVersion.V4Only)
        self._zc.register_service(self._info())
        self._thread = threading.Thread(target=self._refresh_loop, name="orchard-advertiser", daemon=True)
        self._thread.start()
        log.info("advertising %s at %s", self._advert.cluster, self._advert.ray_address)

    def close(self) -> None:
        """Stop refreshing and send a goodbye, so browsers forget the head at once."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._zc:
            self._zc.unregister_service(self._info())
            self._zc.close()
            self._zc = None

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self._refresh_s):
            try:
                self._zc.update_service(self._info())
            except Exception:  # a transient socket error must not end the announcements
                log.exception("refreshing the advertisement failed")

    def _info(self):
        from zeroconf import ServiceInfo

        advert = Advertisement(**{**self._advert.__dict__, "timestamp": self._clock()})
        return ServiceInfo(
            SERVICE_TYPE,
            instance_name(advert.cluster, advert.head_id),
            addresses=[socket.inet_aton(self._address)],
            port=advert.ray_port,
            properties=signed_txt(advert, self._key),
            server=f"orchard-{advert.head_id}.local.",
        )


class AdvertBrowser:
    """Watches the network for the cluster's head and calls `on_advert` with every valid
    advertisement (new heads and refreshes alike) and `on_gone` with the instance name
    of one that said goodbye. Rejections are logged once per instance and reason."""

    def __init__(self, verifier: AdvertVerifier, on_advert: Callable[[Advertisement], None],
                 on_gone: Callable[[str], None] = lambda name: None):
        self.verifier = verifier
        self._on_advert = on_advert
        self._on_gone = on_gone
        self._zc = None
        self._browser = None
        self._logged: set[tuple[str, str]] = set()
        self.rejected: deque[tuple[str, str]] = deque(maxlen=256)  # (instance, reason), newest last

    def start(self) -> None:
        from zeroconf import IPVersion, ServiceBrowser, Zeroconf

        self._zc = Zeroconf(ip_version=IPVersion.V4Only)
        self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])

    def close(self) -> None:
        if self._browser:
            self._browser.cancel()
        if self._zc:
            self._zc.close()
        self._zc = self._browser = None

    def _on_change(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            self._on_gone(name)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=3000)
        if info is None:
            return
        try:
            advert = self.verifier.verify(info.properties)
        except AdvertRejected as exc:
            self._note_rejection(name, exc)
            return
        self._on_advert(advert)

    def _note_rejection(self, name: str, exc: AdvertRejected) -> None:
        self.rejected.append((name, exc.reason))
        if (name, exc.reason) in self._logged:
            return
        if len(self._logged) >= 1024:  # a flood of made-up names must not grow memory forever
            self._logged.clear()
        self._logged.add((name, exc.reason))
        level = logging.INFO if isinstance(exc, OtherCluster) else logging.WARNING
        log.log(level, "ignoring advertisement %s: %s", name, exc)


def discover(verifier: AdvertVerifier, timeout_s: float) -> Advertisement:
    """Browse until one valid advertisement arrives; NoHeadFound after `timeout_s`."""
    found: list[Advertisement] = []
    arrived = threading.Event()

    def take(advert: Advertisement) -> None:
        found.append(advert)
        arrived.set()

    browser = AdvertBrowser(verifier, take)
    browser.start()
    try:
        if not arrived.wait(timeout_s):
            raise NoHeadFound(f"no valid advertisement for cluster {verifier.cluster!r} within {timeout_s:g}s")
        return found[0]
    finally:
        browser.close()

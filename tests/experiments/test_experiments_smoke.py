"""Smoke tests for the experiment scripts' own logic (tiny sizes; the figures come from the scripts)."""

import argparse

import numpy as np
import pytest

from experiments import cpu_elementwise, isolation, paged_vs_contiguous, ssd_streaming
from experiments.models import PUBLIC_SHAPES
from orchard.kernels import cpu as cpu_kernels


def test_llama8b_shape_holds_128_kib_of_kv_per_token():
    llama = next(s for s in PUBLIC_SHAPES if s.name == "Llama-3.1-8B")
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_streaming_bound_divides_bandwidth_by_bytes_per_step():
    assert ssd_streaming.bound(1.0, 1000, 1000) == 1000.0


def test_paged_waste_is_the_unfilled_tail_of_each_last_block():
    rows = paged_vs_contiguous.waste_rows(np.array([17, 32]), batch=2)
    assert rows[1][:2] == ["paged, block 16", f"{100 * 15 / 64:.1f} %"]


def test_storm_in_one_model_leaves_the_other_models_blocks_but_a_shared_pool_loses_them(tmp_path):
    args = argparse.Namespace(quota_mib=1, cold_mib=2, prefix_tokens=64, storm_sequences=40, storm_tokens=128)
    iso = isolation.isolated(args, tmp_path)
    assert iso["b_after"] == iso["b_before"]
    assert iso["b_after"]["hit_tokens"] == 4 * 64
    assert iso["a_evictions"] > 0 and iso["second_pool_for_A"].startswith("QuotaExceeded")
    assert len(iso["files"]) == 2
    shared = isolation.shared(args)
    assert shared["b_before"]["hit_tokens"] == 4 * 64
    assert shared["b_after"]["hit_tokens"] == 0


@pytest.mark.skipif(not cpu_kernels.loaded(), reason="the CPU kernels extension is not built here")
def test_the_elementwise_experiment_times_ops_that_agree_bit_for_bit():
    import mlx.core as mx

    with mx.stream(mx.cpu):
        row = cpu_elementwise.measure(rows=8, repeats=2)
    assert row["swiglu same bits"] and row["rope same bits"]
    assert all(row[k] > 0 for k in row if k.endswith(" ms"))


def test_thread_times_count_the_cpu_of_a_receive_thread_that_ended(monkeypatch):
    import threading

    from experiments import kv_pull_profile
    from orchard.node.serving import kv_link

    if kv_pull_profile._schedstat(threading.get_native_id()) is None:
        pytest.skip("no per-thread schedstat here (Linux's)")
    times = kv_pull_profile.ThreadTimes()
    monkeypatch.setattr(kv_link.LinkStream, "_receive", lambda stream: sum(i * i for i in range(300_000)))
    times.keep_receive_threads()
    before = times.now()
    receiver = threading.Thread(target=kv_link.LinkStream._receive, args=(None,), name="kv-link-recv")
    receiver.start()
    receiver.join()
    used = {name: (cpu, wait) for name, cpu, wait in times.since(before)}
    assert used["kv-link-recv"][0] > 1e-3  # its CPU, though the thread is gone
    assert "kv-link-recv" not in {name for name, _, _ in times.since(times.now())}  # counted once, with its pull


def test_a_cores_idle_time_within_a_pull_is_read_from_the_idle_tasks_runs():
    from experiments import pull_core_sharing

    timehist = ("   100.010000 [0001]  <idle>                              0.000      0.000      4.000 \n"
                "   100.012000 [0000]  python[12/10]                       0.100      0.010      2.000 \n"
                "   100.020000 [0000]  <idle>                              0.000      0.000      3.000 \n")
    runs = pull_core_sharing.idle_runs(timehist)
    assert runs == [(100.01, 1, 0.004), (100.02, 0, 0.003)]
    idle = pull_core_sharing.idle_in(runs, 100.008, 100.018, cores=2)  # core 0 idled from 100.017, core 1 until 100.010
    assert idle == pytest.approx([0.001, 0.002])


def test_the_lending_experiment_switches_a_pull_between_queued_and_lent_engine_calls():
    from experiments import kv_pull_lending
    from orchard.node.async_engine import AsyncEngine
    from orchard.node.serving import direct_path

    built = AsyncEngine.call_here_if_idle, direct_path._ChunkLander.placed
    try:
        kv_pull_lending.use("lent, listed as landed")
        assert AsyncEngine.call_here_if_idle is built[0] and direct_path._ChunkLander.placed is not built[1]
        kv_pull_lending.use("queued")
        assert AsyncEngine.call_here_if_idle is not built[0] and direct_path._ChunkLander.placed is built[1]
        calls = []

        class Engine:
            def call_from_thread(self, fn, settle, publish=False):
                calls.append(publish)

        AsyncEngine.call_here_if_idle(Engine(), None, None, True)  # queued, whether or not the engine idles
        assert calls == [True]
    finally:
        kv_pull_lending.use("lent")
    assert (AsyncEngine.call_here_if_idle, direct_path._ChunkLander.placed) == built


def test_a_pulls_timeline_reads_each_mark_from_the_pulls_start_and_the_fastest_fifths_median():
    import asyncio

    from experiments import kv_pull_timeline as tl

    def step(x):
        return x + 1

    async def astep(x):
        return x + 2

    marked, amarked = tl._marked(step, "source: run pinned", "end"), tl._marked(astep, "target: pull entered", "start")
    tl.take_marks()
    assert marked(1) == 2 and asyncio.run(amarked(1)) == 3
    assert [key for key, _ in tl.take_marks()] == ["source: run pinned", "target: pull entered"]

    def pull(start, wall):
        marks = [("source: request read", start - 1.0),  # the request before this pull's: left out
                 ("target: pull entered", start), ("source: chunk sent", start + 0.001),
                 ("source: chunk sent", start + 0.003), ("target: pull returned", start + wall)]
        return wall, tl.offsets(marks)

    wall, offsets = pull(100.0, 0.004)
    assert offsets == pytest.approx({"target: pull entered": 0.0, "source: chunk sent (first)": 1.0,
                                     "source: chunk sent (last)": 3.0, "target: pull returned": 4.0})
    pulls = [pull(10.0 * i, 0.004 + 0.001 * i) for i in range(10)]  # the fastest fifth: the first two
    rows = {key: (fast, everyone) for key, fast, everyone in tl.timeline(pulls)}
    assert rows["target: pull returned"] == pytest.approx((4.5, 8.5))
    assert [key for key, _, _ in tl.timeline(pulls)][0] == "target: pull entered"


def test_the_floors_raw_steps_each_carry_a_replys_bytes_whole(monkeypatch):
    """Each raw step of `kv_pull_floor` moves the source's bytes into the target's slice (each connection's part
    into its own, where a step has two), the checksummed ones with their checksum compared, and a checksum that
    differs is refused."""
    import socket

    from experiments import kv_pull_floor as floor

    monkeypatch.setattr(floor, "REGION_BYTES", 4 << 20)
    nbytes = 300_000
    for step in floor.STEPS:
        asker = floor._Asker(floor._answer("serve", (step, nbytes)), step, nbytes)
        try:
            assert asker.once() > 0 and asker.once() > 0
            assert sum(part.nbytes for part in asker.parts) == nbytes
            for part in asker.parts:
                at = part.slices.at * part.slices.nbytes  # the slice the last reply landed in
                assert bytes(part.slices.view[at : at + part.nbytes]) == bytes([floor.SENT_BYTE]) * part.nbytes, step
        finally:
            asker.close()
    a, b = socket.socketpair()
    with a, b:
        a.sendall(bytes(100) + bytes(16))  # a payload whose checksum is not its bytes'
        with pytest.raises(ValueError, match="checksum differs"):
            floor._receive_checksummed(b, memoryview(bytearray(116)), None)


def test_the_checksum_rates_time_the_links_own_checksum_and_a_copy_from_both_places():
    """`checksum_rates` hashes as a link's end does (its digest is the wire format's one-shot xxh3_128 of the
    bytes, whatever the batch size) and times the hash and a copy, from cache and from memory, at each size."""
    import xxhash

    from experiments import checksum_rates

    data = memoryview(np.random.default_rng(1).integers(0, 256, 1_000_003, dtype=np.uint8))
    assert checksum_rates.stream_digest(data, batch_bytes=65_536) == xxhash.xxh3_128_digest(data)
    assert checksum_rates.stream_digest(data) == xxhash.xxh3_128_digest(data)
    rows = checksum_rates.measure([4096, 65_536], region_bytes=1 << 20, repeats=3)
    assert {(r["bytes"], r["from"], r["work"]) for r in rows} == {
        (size, where, work) for size in (4096, 65_536) for where in ("cache", "memory")
        for work in ("xxh3_128, the link's batches", "copy")}
    assert all(r["best_Bps"] >= r["median_Bps"] > 0 for r in rows)


def test_the_checksum_rates_hash_pieces_alone_and_beside_a_busy_thread_that_stops(monkeypatch):
    """The second table's two rates come back, and its busy thread ends with the measurement."""
    import threading

    from experiments import checksum_rates

    monkeypatch.setattr(checksum_rates, "PIECES_BYTES", 1 << 20)
    before = threading.active_count()
    alone, beside = checksum_rates.pieces_rates(64 << 10, repeats=3)
    assert alone > 0 and beside > 0 and threading.active_count() == before


@pytest.mark.parametrize("name", ["thread, Event", "thread, SimpleQueue", "event loop, call_soon_threadsafe",
                                  "process, TCP, blocking", "process, TCP, spinning"])
def test_each_wake_latency_hand_over_comes_back_once_a_hand_over_and_takes_positive_time(name):
    """Every hand-over `wake_latency` times arrives, each read after it was handed (a delay read before the
    hand-over, as an operand order mistake would give, is negative), and nothing it started lingers."""
    import threading

    from experiments import wake_latency

    before = threading.active_count()
    delays = wake_latency.HAND_OVERS[name](5, 0.001)
    assert len(delays) == 5 and all(0 < d < 1.0 for d in delays)
    assert threading.active_count() == before
    assert set(wake_latency.summary(delays)) == {"median_us", "p10_us", "p90_us"}


def test_pool_addresses_times_both_ways_of_reading_the_same_addresses():
    from experiments import pool_addresses

    row = pool_addresses.measure(2, "bfloat16", repeats=3, num_blocks=4)
    assert row["layers"] == 2 and row["views_s"] > 0 and row["buffers_s"] > 0


def test_a_timeline_printed_before_is_read_back_and_drawn(tmp_path, monkeypatch):
    """`kv_pull_timeline --plot`: the fastest fifth's ms of each mark, a mark named otherwise by an earlier run as
    named now, a repeated mark's last left out where it came with its first; drawn into docs/img."""
    import experiments.common as common
    from experiments import kv_pull_timeline as tl

    printed = tmp_path / "run.txt"
    printed.write_text("# a header\n| mark | ms, fastest fifth | ms, all |\n|---|---|---|\n"
                       "| target: pull entered | 0.00 | 0.00 |\n| source: request read (first) | 0.35 | 0.38 |\n"
                       "| source: request read (last) | 0.35 | 0.38 |\n| source: run pinned (first) | 0.58 | 0.60 |\n"
                       "| source: run pinned (last) | 0.99 | 1.02 |\n| target: taken seen, size read (first) | 1.25 | 1.3 |\n"
                       "| target: pull returned | 4.43 | 5.26 |\n")
    assert tl.read_printed(str(printed)) == {
        "target: pull entered": 0.0, "source: request read (first)": 0.35, "source: run pinned (first)": 0.58,
        "source: run pinned (last)": 0.99, "target: chunk's size read (first)": 1.25, "target: pull returned": 4.43}
    monkeypatch.setattr(common, "IMG_DIR", tmp_path)
    assert tl.main(["--plot", f"a run={printed}", "--plot-name", "drawn"]) == 0
    assert (tmp_path / "drawn.png").stat().st_size > 0


def test_a_pulls_marks_per_thread_make_each_threads_series_and_a_printed_run_is_read_back_and_drawn(tmp_path, monkeypatch):
    """`kv_pull_series`: each tagged mark's n-th reaching, the median over the fastest fifth, as far as every one of
    those pulls reached it; a series printed before is read back by mark and drawn into docs/img."""
    import experiments.common as common
    from experiments import kv_pull_series as ks

    def pull(wall, extra):
        marks = [(0.0, "target: pull entered"), (0.5, "source: send< #0"), (1.0 + extra, "source: send< #0"),
                 (0.7, "source: send< #1"), (0.9, "target: lookup done")]
        return wall, sorted(marks + ([(1.5, "source: send< #1")] if wall < 0.002 else []))

    pulls = [pull(0.001, 0.0), pull(0.0011, 0.2)] + [pull(0.01 + i, 1.0) for i in range(8)]  # fastest fifth: two
    made = ks.series(pulls)
    assert list(made) == ["source: send< #0", "source: send< #1"]
    assert made["source: send< #0"] == pytest.approx([0.5, 1.1]) and made["source: send< #1"] == pytest.approx([0.7, 1.5])
    printed = tmp_path / "run.txt"
    printed.write_text("connections 2: wall fastest fifth median 5.80 ms, all 6.17\n"
                       "source: send< #0 (3): 1.53 1.72 1.83\nsource: send< #1 (2): 1.58 1.78\n"
                       "target: recv< #1 (1): 1.65\none pull (5.82 ms), every mark:\n    0.000  target: pull entered\n")
    assert ks.read_printed(str(printed)) == {"source: send< #0": [1.53, 1.72, 1.83], "source: send< #1": [1.58, 1.78],
                                             "target: recv< #1": [1.65]}
    monkeypatch.setattr(common, "IMG_DIR", tmp_path)
    assert ks.main(["--plot", f"two={printed}", f"again={printed}", "--plot-name", "drawn"]) == 0
    assert (tmp_path / "drawn.png").stat().st_size > 0


def test_the_size_sweep_reads_each_pulls_share_of_raw_tcp_and_draws_saved_runs(tmp_path, monkeypatch):
    """`kv_pull_sizes`: a pull's best over raw TCP's best and its median over raw TCP's median, one row a size, and
    saved runs drawn into docs/img."""
    import json

    import experiments.common as common
    from experiments import kv_pull_sizes as sizes
    from experiments.kv_pull_floor import CHECKSUMMED_TWO, RAW_HOT

    run = {"bytes": 8 << 20, RAW_HOT: [4e9, 8e9, 6e9], CHECKSUMMED_TWO: [5e9, 5e9, 5e9], sizes.PULL: [2e9, 4e9, 2.4e9]}
    small = {"bytes": 4 << 20, RAW_HOT: [8e9], CHECKSUMMED_TWO: [5e9], sizes.PULL: [2e9]}
    assert sizes.shares(run) == pytest.approx((0.5, 0.4))
    assert sizes.shares(small) == pytest.approx((0.25, 0.25))
    printed = sizes.table({2048: run, 1024: small}).splitlines()
    assert printed[2] == "| 2048 | 8.0 | 8.00 / 6.00 | 5.00 / 5.00 | 4.00 / 2.40 | 50 % | 40 % |"
    assert printed[3] == "| 1024 | 4.0 | 8.00 / 8.00 | 5.00 / 5.00 | 2.00 / 2.00 | 25 % | 25 % |"
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"machine": "Linux x86_64, 16 cores, load 0.1", "date": "2026-12-06 09:35",
                                 "runs": {"2048": run, "1024": small}}))
    monkeypatch.setattr(common, "IMG_DIR", tmp_path)
    assert sizes.main(["--plot", str(saved), str(saved), "--plot-name", "drawn"]) == 0
    assert (tmp_path / "drawn.png").stat().st_size > 0
    drawn = []
    monkeypatch.setattr(sizes, "save_figure", lambda fig, name, **_: drawn.append(fig) or tmp_path / f"{name}.png")
    sizes.plot([f"before={saved}", f"after={saved}", f"after={saved}"], "labelled")
    lines = drawn[0].axes[0].get_lines()
    assert [line.get_label() for line in lines if not line.get_label().startswith("_")] == [
        "best / raw's best, before", "median / raw's median, before", "best / raw's best, after",
        "median / raw's median, after", "issue 19's target"]  # one legend entry a label, one colour a label
    assert len({line.get_color() for line in lines[:6]}) == 2 and lines[2].get_color() == lines[4].get_color()
    large = tmp_path / "large.json"
    large.write_text(json.dumps({"machine": "Linux x86_64, 16 cores", "date": "2026-12-06 17:00", "size": "large",
                                 "runs": {"512": run}}))
    sizes.plot([str(saved), str(large)], "unlabelled")  # a run saved without its size pulled the small model's KV
    assert [line.get_label() for line in drawn[1].axes[0].get_lines()][::2][:2] == [
        "best / raw's best, 2026-12-06 09:35, small", "best / raw's best, 2026-12-06 17:00, large"]


def test_the_cpu_accounting_reads_perfs_samples_and_sums_them_by_phase_side_thread_and_kind_of_code():
    """`kv_pull_cpu`: a `perf script` line parsed; each sample's function sorted into a kind of code; ms a pull summed
    by phase (its time window), side (its process) and thread, samples of other processes or outside every phase
    left out."""
    from experiments import kv_pull_cpu as cpu

    line = " kv-link-recv  3088/3129    325.400000123:     333444  ffffffff81234567 _copy_to_iter ([kernel.kallsyms])"
    sample = cpu._SAMPLE.match(line)
    assert (sample["comm"], sample["pid"], sample["time"], sample["period"], sample["sym"], sample["dso"]) == (
        "kv-link-recv", "3088", "325.400000123", "333444", "_copy_to_iter", "[kernel.kallsyms]")
    functions = [("_copy_from_iter", "[kernel.kallsyms]"), ("tcp_sendmsg_locked", "[kernel.kallsyms]"),
                 ("XXH3_update_avx512", "/site/xxhash/_xxhash.cpython-312-x86_64-linux-gnu.so"),
                 ("_PyEval_EvalFrameDefault", "/usr/bin/python3.12"), ("[unknown]", "/usr/lib/libpython3.11.so.1.0"),
                 ("__memmove_avx_unaligned_erms", "/usr/lib/x86_64-linux-gnu/libc.so.6"),
                 ("PyArray_NewFromDescr_int", "/site/numpy/_core/_multiarray_umath.cpython-312-x86_64-linux-gnu.so")]
    assert [cpu.kind_of(*f) for f in functions] == [*cpu.KINDS[:4], cpu.KINDS[3], cpu.KINDS[4], cpu.KINDS[4]]
    rows = [(10, "kv-link-recv", 1.5, 2_000_000, "_copy_to_iter", "[kernel.kallsyms]"),
            (10, "kv-link-recv", 1.6, 1_000_000, "XXH3_update_avx512", "_xxhash.so"),
            (11, "kv-link-conn", 2.5, 4_000_000, "tcp_sendmsg_locked", "[kernel.kallsyms]"),
            (12, "kv-link-conn", 2.5, 4_000_000, "tcp_sendmsg_locked", "[kernel.kallsyms]"),  # another process
            (10, "kv-link-recv", 3.5, 4_000_000, "_copy_to_iter", "[kernel.kallsyms]")]  # after the last phase
    phases = [(1.0, 2.0, 8 << 20, 2e9, 1e9), (2.0, 3.0, 8 << 20, 2e9, 1e9)]
    by_kind, by_sym = cpu.tally(rows, {10: "target", 11: "source"}, phases, pulls=2)
    assert by_kind == {(0, "target", "kv-link-recv", "kernel: copies"): 1.0,
                       (0, "target", "kv-link-recv", "checksum"): 0.5, (1, "source", "kv-link-conn", "kernel: other"): 2.0}
    assert by_sym[1, "source", "kv-link-conn", ("tcp_sendmsg_locked", "[kernel.kallsyms]")] == 2.0
    saved = cpu.report(by_kind, by_sym, phases, top=5)
    assert saved["pull, 2 connections | target | kv-link-recv"] == {
        "by_kind": {"kernel: copies": 1.0, "kernel: other": 0.0, "checksum": 0.5, "Python": 0.0, "other user": 0.0},
        "functions": [["_copy_to_iter", "[kernel.kallsyms]", 1.0], ["XXH3_update_avx512", "_xxhash.so", 0.5]]}


def test_threads_started_once_named_carry_their_python_name_to_the_os(monkeypatch):
    """`kv_pull_cpu.name_threads`: what perf reports as a thread's `comm` is its Python name, spaces dropped."""
    import threading
    from pathlib import Path

    from experiments import kv_pull_cpu as cpu

    if not Path(f"/proc/self/task/{threading.get_native_id()}/comm").exists():
        pytest.skip("no /proc task names here")
    monkeypatch.setattr(threading.Thread, "_bootstrap_inner", threading.Thread._bootstrap_inner)  # undone after
    cpu.name_threads()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                                                         .read_text().strip()), name="kv-link-recv 2")
    thread.start()
    thread.join()
    assert seen == ["kv-link-recv2"]


def test_pull_bookkeeping_times_each_call_warm_and_cooled_and_leaves_the_pools_as_it_found_them(monkeypatch):
    from experiments import pull_bookkeeping

    made = []
    real_cache = pull_bookkeeping._cache
    monkeypatch.setattr(pull_bookkeeping, "_cache", lambda n: made.append(real_cache(n)) or made[-1])
    rows = pull_bookkeeping.measure(tokens=256, parts=2, repeats=3, cold_mib=1)
    assert [r["end"] for r in rows] == ["source"] * 4 + ["target"] * 5
    assert all(r[k] > 0 for r in rows for k in ("warm_median_us", "warm_tenth_us", "cold_median_us", "cold_tenth_us"))
    source, target = made
    # Every pin was undone and every landing adopted or released: nothing is held in either pool.
    assert source.manager.num_used == 0 and target.manager.num_used == 0
    assert not pull_bookkeeping._COOL

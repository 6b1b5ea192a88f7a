"""The hang watchdog's parts in one process: the lighthouse's status page read from a real
lighthouse, the verdict, a watched wait given up, the vote's fence; the stop plans of
`freescale local`; the slow-group report on hand-made commit files; the slow fault."""

import re
import threading
import time
from datetime import timedelta

import pytest
import torch

from freescale.config import ConfigError, load_config
from freescale.faults import FaultInjector
from freescale.ft.lighthouse import LighthouseOptions, LighthouseStatus, QuorumLog, address_of, read_status, start_lighthouse
from freescale.ft.watchdog import STORE_RETRY_S, HungReplica, Watchdog, verdict
from freescale.local import DEFAULT_STOP_S, own_step_s, own_step_times, parse_stops, slow_groups
from helpers.launch import REPO

FT_LOCAL = REPO / "configs" / "ft_local.yaml"


def test_the_status_page_of_a_real_lighthouse_reads_as_its_quorum_and_heartbeats():
    from torchft.coordination import LighthouseClient

    lighthouse = start_lighthouse(LighthouseOptions(bind="127.0.0.1:0", heartbeat_timeout_ms=500))
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    try:
        client = LighthouseClient(address, timedelta(seconds=5))
        members = ["replica0:aaaa", "replica1:bbbb"]
        for m in members:
            client.heartbeat(m)  # both known before either asks, so the quorum waits for both
        threads = [threading.Thread(target=lambda m=m: LighthouseClient(address, timedelta(seconds=5)).quorum(
            m, timedelta(seconds=10), address="x", store_address="y", step=1, world_size=1, shrink_only=False))
            for m in members]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(0.3)
        client.heartbeat("replica0:aaaa")
        status = read_status(address, timeout=5)
    finally:
        lighthouse.shutdown()
    assert status.quorum_id == 1
    assert sorted(status.members) == members
    assert status.heard["replica0:aaaa"] < 0.2 < status.heard["replica1:bbbb"] < 5


def _status(quorum_id, *groups) -> LighthouseStatus:
    return LighthouseStatus(quorum_id, tuple(f"{g}:{quorum_id:04x}" for g in groups) if quorum_id else (), {})


def test_the_lighthouse_logs_a_line_when_the_groups_change_and_a_summary_of_the_other_quorums():
    log = QuorumLog(summary_s=60)
    assert log.update(_status(None), 0.0) == []
    assert log.update(_status(1, "replica1", "replica0"), 1.0) == [
        "lighthouse: quorum 1 of 2 group(s): replica0, replica1 (replica0, replica1 joined)"]
    # Quorums 2..50 of the same groups (failed steps, a held group): no line each.
    assert [line for q in range(2, 51) for line in log.update(_status(q, "replica0", "replica1"), float(q))] == []
    assert log.update(_status(50, "replica0", "replica1"), 50.5) == []  # (the same page read again)
    assert log.update(_status(51, "replica0"), 51.0) == ["lighthouse: quorum 51 of 1 group(s): replica0 (replica1 left)"]
    assert log.update(_status(52, "replica0"), 61.0) == [
        "lighthouse: 50 more quorum(s) of the same groups in the last 61 s (each failed step forms one), the last 52"]
    assert log.update(_status(52, "replica0"), 130.0) == []  # none formed since the summary
    assert log.update(_status(53, "replica2", "replica0"), 131.0) == [
        "lighthouse: quorum 53 of 2 group(s): replica0, replica2 (replica2 joined)"]


def test_the_lighthouse_names_an_address_other_hosts_can_reach():
    import socket

    assert address_of(LighthouseOptions(bind="127.0.0.1:29510")) == "http://127.0.0.1:29510"
    assert address_of(LighthouseOptions(bind="10.1.2.3:29510")) == "http://10.1.2.3:29510"
    for wildcard in ("0.0.0.0", "::", "[::]"):
        assert address_of(LighthouseOptions(bind=f"{wildcard}:29510")) == f"http://{socket.getfqdn()}:29510"


def test_the_verdict_gives_up_a_quorum_with_a_silent_member_or_one_formed_without_this_group():
    status = LighthouseStatus(quorum_id=4, members=("replica0:a", "replica1:b", "replica2:c"),
                              heard={"replica0:a": 0.05, "replica1:b": 0.1, "replica2:c": 1.4, "replica2:old": 60.0})
    assert "replica group replica2 of quorum 4 sent no heartbeat for 1.4 s" in verdict(status, 4, "replica0", 1.0)
    assert verdict(status, 4, "replica0", 2.0) == ""  # not silent long enough
    assert verdict(status, 3, "replica0", 1.0) == ""  # a newer quorum with this group: the next step's
    assert verdict(status, None, "replica0", 1.0) == ""  # no quorum yet
    newer = LighthouseStatus(quorum_id=5, members=("replica0:a", "replica1:b"), heard=status.heard)
    assert "formed quorum 5 without this group" in verdict(newer, 4, "replica2", 1.0)
    assert verdict(newer, 4, "replica1", 1.0) == ""


class _Work:
    """A collective in flight that ends when told."""

    def __init__(self):
        self.future = torch.futures.Future()

    def get_future(self):
        return self.future

    def wait(self):
        return self.future.wait()


def _raised(call):
    try:
        return call()
    except Exception as e:
        return e


def test_a_watched_wait_ends_with_the_collective_or_raises_once_its_quorum_is_given_up():
    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)  # (its thread never started)
    done = _Work()
    threading.Timer(0.05, lambda: done.future.set_result(7)).start()
    assert watchdog.wait(done, quorum_id=3) == 7
    hung, outcome = _Work(), []  # (the work never completes: the wait must give up)
    waiter = threading.Thread(target=lambda: outcome.append(_raised(lambda: watchdog.wait(hung, quorum_id=3))),
                              daemon=True)
    waiter.start()
    time.sleep(0.05)
    watchdog.give_up(3, "replica group replica2 is hung")
    waiter.join(timeout=10)
    assert isinstance(outcome[0], HungReplica) and "replica2 is hung" in str(outcome[0]), outcome
    with pytest.raises(HungReplica):
        watchdog.wait(_Work(), quorum_id=3)  # a later collective of the same quorum
    other = _Work()
    other.future.set_result(1)
    assert watchdog.wait(other, quorum_id=4) == 1  # the next quorum is not given up


def test_the_vote_fails_in_a_quorum_given_up_or_one_the_process_was_stopped_in_and_no_other():
    from torchft import ProcessGroupGloo

    from freescale.ft.watchdog import WatchedProcessGroup

    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)  # (nothing listens there)
    watchdog.pg = pg = WatchedProcessGroup(ProcessGroupGloo(), watchdog)
    pg._quorum_id = watchdog._turn_quorum = 2
    watchdog._ran_at = time.monotonic()
    assert watchdog.cause(2) == ""
    watchdog.give_up(2, "replica group replica1 is hung")
    assert watchdog.cause(2) == "replica group replica1 is hung" and watchdog.cause(3) == ""
    # Stopped in quorum 3 (the thread's last turn, 0.6 s ago, saw it): its vote fails, before the
    # thread's next turn and after it; quorum 4, built once the process runs again, is not touched.
    pg._quorum_id = watchdog._turn_quorum = 3
    pg.configured_at = watchdog._ran_at = time.monotonic() - 0.6
    assert "did not run for 0.6 s" in watchdog.cause(3)
    pg._quorum_id, pg.configured_at = 4, time.monotonic()
    assert watchdog.cause(4) == ""
    watchdog._turn()
    assert "did not run for 0.6 s" in watchdog.cause(3) and watchdog.cause(4) == ""


def test_stop_plans_parse_and_bad_ones_name_the_item():
    stops = parse_stops("2@100:5, 0@30, 1@50+0.5", replicas=3, steps=1000)
    assert [(s.replica, s.step, s.seconds, s.after) for s in stops] == [(0, 30, DEFAULT_STOP_S, 0.0),
                                                                        (1, 50, DEFAULT_STOP_S, 0.5), (2, 100, 5.0, 0.0)]
    assert parse_stops("", replicas=2, steps=100) == []
    for text, message in [("2-10", "expected REPLICA@STEP"), ("all@3", "expected REPLICA@STEP"),
                          ("1@5:x", "expected REPLICA@STEP"), ("1@5+x:3", "expected REPLICA@STEP"),
                          ("1@5+-1", r"expected \+AFTER seconds >= 0"), ("3@10", "replica 3 does not exist"),
                          ("0@100", "expected a step in 1..99"), ("0@5:0", "expected seconds > 0")]:
        with pytest.raises(ConfigError, match=message):
            parse_stops(text, replicas=2, steps=100)


def commits(step_s: float, blocked_s: float, steps: int = 20, start: float = 1000.0) -> list[dict]:
    return [{"step": s, "next_batch": s, "trained": True, "time": start + s * step_s, "blocked_s": blocked_s}
            for s in range(1, steps + 1)]


def test_a_group_three_times_slower_is_named_with_its_factor_and_a_healthy_run_has_none():
    # Lockstep, as the groups train: every group commits every 0.15 s; the fast ones wait 0.1 s
    # of it for the slow one, which waits for nobody.
    fast, slow = commits(0.15, 0.1), commits(0.15, 0.0)
    fast[5]["blocked_s"] = 3.0  # one step waiting long (a quorum change) does not move the median
    own = {0: own_step_times(fast), 1: own_step_times(fast), 2: own_step_times(slow)}
    assert own_step_s(own[0]) == pytest.approx(0.05) and own_step_s(own[2]) == pytest.approx(0.15)
    assert slow_groups(own, factor=1.5) == [{"replica": 2, "times_slower": 3.0, "own_step_s": 0.15,
                                             "others_step_s": 0.05}]
    healthy = {g: own_step_times(commits(0.05, 0.001 * g)) for g in range(3)}
    assert slow_groups(healthy, factor=1.5) == []


def test_a_group_is_compared_over_the_steps_the_others_trained_with_it():
    # Group 2 is away for steps 21-249 (stopped, then caught up); groups 0 and 1, with its
    # cores to themselves, step in 0.02 s then, and in 0.05 s like group 2 while all three run.
    # Group 2's own median (0.05 s) is 2.5 times theirs over the whole run, yet no slower than
    # theirs in the steps they trained alike.
    def run(steps, step_s):
        return [{"step": s, "next_batch": s, "trained": True, "time": 1000.0 + s, "blocked_s": 1.0 - step_s(s)}
                for s in steps]
    together = lambda s: 0.05 if s <= 20 or s > 250 else 0.02  # noqa: E731
    own = {g: own_step_times(run(range(1, 271), together)) for g in (0, 1)}
    own[2] = own_step_times(run([*range(1, 21), *range(250, 271)], lambda s: 0.05))
    assert own_step_s(own[2]) == pytest.approx(2.5 * own_step_s(own[0]))
    assert slow_groups(own, factor=1.5) == []
    own[2] = own_step_times(run([*range(1, 21), *range(250, 271)], lambda s: 0.1))  # twice as slow: named
    assert slow_groups(own, factor=1.5) == [{"replica": 2, "times_slower": 2.0, "own_step_s": 0.1,
                                             "others_step_s": 0.05}]


def test_own_time_counts_only_steps_trained_right_after_the_previous_commit():
    steps = commits(0.1, 0.0, steps=4)
    steps[2]["trained"] = False  # a catch-up
    steps[3]["step"] = 9  # the group was away in between
    assert own_step_times(steps) == {2: pytest.approx(0.1)}
    assert own_step_times(steps[:1]) == {} and own_step_s({}) is None
    assert slow_groups({0: {}, 1: {5: 0.1}}, factor=1.5) == []
    assert slow_groups({0: {4: 0.5}, 1: {5: 0.1}}, factor=1.5) == []  # no step in common: no verdict


def test_a_slow_fault_stalls_every_step_from_its_own_on(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    injector = FaultInjector(at_step=3, kind="slow", rank=0, delay_s=0.2, marker="/nonexistent/never-written")
    for step in range(1, 7):
        injector.before_step(step)
    assert slept == [0.2] * 4


def test_hang_timeout_config_is_checked():
    assert load_config(str(FT_LOCAL), ["ft.hang_timeout_s=0"]).ft.hang_timeout_s == 0
    with pytest.raises(ConfigError, match="ft.hang_timeout_s: expected 0 .* or at least 0.2 s"):
        load_config(str(FT_LOCAL), ["ft.hang_timeout_s=0.1"])


def test_the_watched_group_reports_the_given_up_quorum_as_its_error_which_the_vote_asks():
    from torchft import ProcessGroupGloo

    from freescale.ft.watchdog import WatchedProcessGroup

    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)
    pg = WatchedProcessGroup(ProcessGroupGloo(), watchdog)
    pg._quorum_id = 6  # (what torchft's configure sets)
    watchdog._ran_at = time.monotonic()
    assert pg.errored() is None
    watchdog.give_up(6, "replica group replica2 is hung")
    assert isinstance(pg.errored(), HungReplica) and "replica2 is hung" in str(pg.errored())


def test_a_group_that_aborts_its_collectives_tells_the_others_through_the_quorums_store():
    # Two groups' watchdogs over one real TCPStore, as torchft's quorum gives them: group 1's
    # collective fails on its own and it aborts; group 0, in a collective of the same quorum that
    # would never end (gloo wakes it only if it waits on the closed sockets at that moment), gives
    # the quorum up at the notice. The notice stays in its quorum: the next one is not given up.
    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    quorum_store = f"127.0.0.1:{server.port}/torchft/5/0"
    watchdogs = [Watchdog("http://127.0.0.1:9", f"replica{g}", hang_timeout_s=1.0) for g in range(2)]
    for w in watchdogs:
        w.watch(ProcessGroupGloo())  # (the group itself is never built: only its quorum and store are set)
        w.pg._quorum_id, w.pg.store = 5, (5, quorum_store)
    try:
        hung, outcome = _Work(), []
        waiter = threading.Thread(target=lambda: outcome.append(_raised(lambda: watchdogs[0].wait(hung, quorum_id=5))),
                                  daemon=True)
        waiter.start()
        time.sleep(0.3)
        assert not outcome and not watchdogs[0].given_up(5)
        watchdogs[1].pg.abort()
        waiter.join(timeout=5)
        assert outcome and isinstance(outcome[0], HungReplica), outcome
        assert "replica group replica1 aborted quorum 5's collectives" in str(outcome[0])
        assert "replica1 aborted" in str(watchdogs[0].pg.errored())  # (the vote fails too)
        time.sleep(0.3)
        assert not watchdogs[1].given_up(5)  # its own notice: it failed the step already, and its
        # abort tore its group down (a group given up is detached instead)
        for w in watchdogs:
            w.pg._quorum_id, w.pg.store = 6, (6, f"127.0.0.1:{server.port}/torchft/6/0")
        time.sleep(0.3)
        assert not watchdogs[0].given_up(6)
    finally:
        for w in watchdogs:
            w.close()


def test_a_slow_status_page_does_not_read_as_this_process_stopped():
    # The lighthouse answers each status read after 0.45 s (a busy host): the watchdog's thread
    # waits for it, then pauses between turns; it never stopped, so no vote may fail for that.
    import http.server

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            time.sleep(0.45)
            try:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"Previous quorum id: 3 <br>")
            except OSError:  # (the reader gave up first)
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from torchft import ProcessGroupGloo

    watchdog = Watchdog(f"http://127.0.0.1:{server.server_address[1]}", "replica0", hang_timeout_s=1.0)
    watchdog.watch(ProcessGroupGloo())
    watchdog.pg._quorum_id = 3
    try:
        time.sleep(2.0)
        assert watchdog.cause(3) == ""
    finally:
        watchdog.close()
        server.shutdown()


def test_a_store_out_of_reach_keeps_the_notices_thread_no_longer_than_close_waits():
    # The quorum's store is gone (its group died) while this rank waits in a collective: each
    # check fails within half of ft.hang_timeout_s, so close() finds the thread out of the
    # store's client, not left inside it as the interpreter ends (which aborts the process).
    import socket

    from torchft import ProcessGroupGloo

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (nothing listens there once closed)
    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)
    watchdog.watch(ProcessGroupGloo())
    watchdog.pg._quorum_id, watchdog.pg.store = 5, (5, f"127.0.0.1:{port}/torchft/5/0")
    threading.Thread(target=lambda: _raised(lambda: watchdog.wait(_Work(), quorum_id=5)), daemon=True).start()
    time.sleep(1.5)
    watchdog.give_up(5, "the test is over")
    watchdog.close()
    assert not watchdog._notices.is_alive()


def test_close_waits_out_a_store_connection_as_long_as_c10d_takes_to_fail(monkeypatch):
    # c10d's client tries twice, with a pause of up to STORE_RETRY_S between, before a store
    # that is gone fails: close() called as the notices thread starts such a connection waits
    # for the thread to leave it.
    import torchft.process_group
    from torchft import ProcessGroupGloo

    entered = threading.Event()

    def connect(store_addr, timeout):
        entered.set()
        time.sleep(2 * timeout.total_seconds() + STORE_RETRY_S)
        raise RuntimeError("The client socket has timed out")

    monkeypatch.setattr(torchft.process_group, "create_store_client", connect)
    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)
    watchdog.watch(ProcessGroupGloo())
    watchdog.pg._quorum_id, watchdog.pg.store = 5, (5, "127.0.0.1:1/torchft/5/0")
    threading.Thread(target=lambda: _raised(lambda: watchdog.wait(_Work(), quorum_id=5)), daemon=True).start()
    assert entered.wait(30)
    watchdog.give_up(5, "the test is over")
    watchdog.close()
    assert not watchdog._notices.is_alive()


def test_a_process_group_build_gives_up_with_its_quorum_and_what_it_makes_late_is_kept_unused():
    # Quorum 5 has two groups; the other never connects (it died, or hangs, after the quorum
    # formed): gloo's build would wait for it for several tries of the timeout. Once the quorum
    # is given up, configure raises at once; the next quorum (this group alone) builds and works;
    # and when quorum 5's peer does connect, the abandoned build's group is kept, never used.
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import AllreduceOptions
    from torchft import ProcessGroupGloo

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def store(q: int) -> str:
        return f"127.0.0.1:{server.port}/torchft/{q}/0"

    watchdog = Watchdog("http://127.0.0.1:9", "replica0", hang_timeout_s=1.0)
    pg = watchdog.watch(watchdog.gloo(timedelta(seconds=8)))
    try:
        threading.Timer(0.5, lambda: watchdog.give_up(5, "replica group replica1 of quorum 5 is hung")).start()
        started = time.monotonic()
        with pytest.raises(HungReplica, match="replica1 of quorum 5 is hung"):
            pg.configure(store(5), "replica0", 0, 2, 5)
        assert time.monotonic() - started < 4.0  # (the build alone waits 8 s for the peer's address)

        pg.configure(store(6), "replica0", 0, 1, 6)
        ones = torch.ones(3)
        pg.allreduce([ones], AllreduceOptions()).wait()
        assert ones.tolist() == [1.0, 1.0, 1.0] and pg.size() == 1

        late = threading.Thread(target=lambda: ProcessGroupGloo(timeout=timedelta(seconds=8)).configure(
            store(5), "replica1", 1, 2, 5), daemon=True)
        late.start()
        late.join(timeout=10)
        deadline = time.monotonic() + 5
        while not watchdog._abandoned and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(watchdog._abandoned) == 1 and watchdog._abandoned[0].size() == 2
        assert pg.size() == 1  # the group in use is still quorum 6's
    finally:
        watchdog.close()


def test_freescale_lighthouse_prints_the_quorums_groups_not_every_heartbeat():
    # Two groups beat every 50 ms for 3 s and form a quorum: torchft's own log would be a line or
    # more per heartbeat and request (over 20 a second); the command prints its address and the
    # quorum's groups.
    import os
    import socket
    import subprocess
    import sys

    from torchft.coordination import LighthouseClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    proc = subprocess.Popen([sys.executable, "-m", "freescale", "lighthouse", "--bind", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    try:
        address = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                read_status(address, timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        members = ["replica0:aaaa", "replica1:bbbb"]
        first = LighthouseClient(address, timedelta(seconds=10))
        for m in members:
            first.heartbeat(m)  # both known before either asks, so the quorum waits for both
        stop = time.monotonic() + 3

        def group(member):
            client = LighthouseClient(address, timedelta(seconds=10))
            client.quorum(member, timedelta(seconds=10), address="x", store_address="y", step=1, world_size=1,
                          shrink_only=False)
            while time.monotonic() < stop:
                client.heartbeat(member)
                time.sleep(0.05)

        threads = [threading.Thread(target=group, args=(m,)) for m in members]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        time.sleep(1.5)  # (the command reads its status page once a second)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"lighthouse at http://127.0.0.1:{port} "), out[-2000:]
    # (a busy host may form a quorum of the first group alone before the second one joins it)
    assert 1 <= len(lines[1:]) <= 2 and all(line.startswith("lighthouse: quorum ") for line in lines[1:]), out[-2000:]
    assert re.fullmatch(r"lighthouse: quorum \d+ of 2 group\(s\): replica0, replica1 \((replica0, )?replica1 joined\)",
                        lines[-1]), out[-2000:]

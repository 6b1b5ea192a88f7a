"""``freescale local``: a lighthouse and R replica groups of N ranks on this host, with kills.

Each replica group is one ``freescale train --nproc N`` process, torchrun's launcher and its
ranks (its own process session, so a kill takes the agent and all its ranks, as a lost host
would), training into ``<run>/replica<r>/``. The launcher
watches every group's committed steps (its data cursor, ``ft_cursor.json``), SIGKILLs group R
once it has trained S batches of its own shard (``--kill R@S``: S committed steps on its own
data; a group that joins late catches up first, so the kill always lands on real work;
``--kill all@S``: every group at once, when the first has trained S), starts it again after
``--restart-delay`` seconds, and restarts a group that crashes the same way (up to
``--max-restarts`` times; never one that exits with a usage error). A restarted group catches
up from a live peer, or, when no group is left alive, resumes from the job's newest checkpoint
(the trainer decides: ``ReplicaLayer.join``); with ``--resume`` it resumes from its own last
checkpoint instead. ``--stop R@S[+AFTER][:SECONDS]`` hangs a group instead: every process of
group R is SIGSTOPped once it has trained S batches of its shard, or AFTER seconds later (inside
its next step rather than between two); its sockets stay open, as a frozen host's do; it is
SIGCONTed SECONDS later (15 by default), finds its step failed and catches up. A group is not
restarted once every other group has finished the run: there is no live run left to rejoin. The launcher prints a progress line per group, waits for
the end and writes ``<run>/local_summary.json``:

- per group: committed steps, steps that trained its own batch, exit code, console log;
- per failure: when it was killed (or stopped) and restarted (or continued), the time to rejoin
  (restart to its first commit), and every other group's *stall*: the longest gap between two
  of its commits while the failed group was away (kill to rejoin);
- each group's own time per step (the median over its steps of the time between two commits
  less the time it waited for the other groups: ``blocked_s`` in its commit lines) and the
  groups whose own time is ``ft.slow_factor`` times the others' or more over the steps they
  trained alike (``slow``);
- the ledger check over all groups: every batch of every group's shard up to its cursor
  trained exactly once (``samples_lost``, ``samples_repeated``), and whether every group
  reached the last step (``complete``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from freescale.config import ConfigError, ExperimentConfig, load_config
from freescale.ft.lighthouse import LighthouseOptions, start_lighthouse
from freescale.ft.files import COMMITS_FILE, ReplicaFiles
from freescale.io import write_json_atomic
from freescale.progress import bar, say
from freescale.train.ledger import audit, exactly_once, expected_samples, read_ledger

SUMMARY_FILE = "local_summary.json"
EXIT_USAGE = 2  # a group that exits with it (bad config or input) is not restarted


ALL = -1  # a kill of every group at once


@dataclass(frozen=True)
class Kill:
    replica: int
    """The group, or ``ALL``."""
    step: int


def parse_kills(text: str, replicas: int, steps: int) -> list[Kill]:
    """``"1@10,0@30,all@50"`` -> kills (group, batches of its shard trained); one-line errors name the bad item."""
    kills = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        replica, at, step = item.partition("@")
        if not at or not (replica.isdigit() or replica == "all") or not step.isdigit():
            raise ConfigError(f"--kill: expected REPLICA@STEP or all@STEP items (e.g. 1@10), got {item!r}")
        kill = Kill(ALL if replica == "all" else int(replica), int(step))
        if kill.replica >= replicas:
            raise ConfigError(f"--kill {item}: replica {kill.replica} does not exist (--replicas {replicas})")
        if not 1 <= kill.step < steps:
            raise ConfigError(f"--kill {item}: expected a step in 1..{steps - 1} (train.steps is {steps})")
        kills.append(kill)
    return sorted(kills, key=lambda k: (k.replica, k.step))


DEFAULT_STOP_S = 15.0


@dataclass(frozen=True)
class Stop:
    replica: int
    step: int
    seconds: float
    after: float = 0.0  # seconds from the group's S-th batch to the stop


def parse_stops(text: str, replicas: int, steps: int) -> list[Stop]:
    """``"2@100:15,0@300,1@50+0.5"`` -> stops (group, batches of its shard trained, seconds
    stopped, ``DEFAULT_STOP_S`` when left out; seconds after the batch, 0 when left out);
    one-line errors name the bad item."""
    stops = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        replica, at, rest = item.partition("@")
        when, colon, seconds = rest.partition(":")
        step, plus, after = when.partition("+")
        try:
            stop = Stop(int(replica), int(step), float(seconds) if colon else DEFAULT_STOP_S, float(after) if plus else 0.0)
        except ValueError:
            stop = None
        if not at or stop is None or not replica.isdigit() or not step.isdigit():
            raise ConfigError(f"--stop: expected REPLICA@STEP[+AFTER][:SECONDS] items (e.g. 2@100:15), got {item!r}")
        if stop.replica >= replicas:
            raise ConfigError(f"--stop {item}: replica {stop.replica} does not exist (--replicas {replicas})")
        if not 1 <= stop.step < steps:
            raise ConfigError(f"--stop {item}: expected a step in 1..{steps - 1} (train.steps is {steps})")
        if not 0 < stop.seconds < float("inf"):
            raise ConfigError(f"--stop {item}: expected seconds > 0, got {seconds}")
        if not 0 <= stop.after < float("inf"):
            raise ConfigError(f"--stop {item}: expected +AFTER seconds >= 0, got {after}")
        stops.append(stop)
    return sorted(stops, key=lambda s: (s.replica, s.step))


@dataclass
class Failure:
    step: int
    killed_at: float
    cause: str = "killed"
    restarted_at: float | None = None


@dataclass
class Group:
    """One replica group's launcher (``freescale train --nproc N``) and its ranks, across its restarts."""

    replica: int
    cmd: list[str]
    run_dir: str
    console: str
    env: dict
    proc: subprocess.Popen | None = None
    kills: list[int] = field(default_factory=list)  # batches of its shard it is to be killed after, in order
    stops: list[Stop] = field(default_factory=list)  # its stops, in order
    stopped: list[int] | None = None  # the processes it stopped (SIGSTOP), until they continue
    stop_due: float | None = None  # when its next stop strikes, once it trained the stop's batches
    continue_at: float | None = None
    failures: list[Failure] = field(default_factory=list)
    restart_at: float | None = None
    exit_code: int | None = None

    def start(self, extra: tuple[str, ...] = ()) -> None:
        with open(self.console, "a") as out:
            self.proc = subprocess.Popen([*self.cmd, *extra], stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def kill(self) -> None:
        """SIGKILL the agent and every rank (a rank started as a fresh process is in a session of its own)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.exit_code = self.proc.wait()  # -9 until a restart finishes
        self.proc = None
        self.stopped = self.continue_at = None

    def stop(self, seconds: float) -> None:
        """SIGSTOP the agent and every rank (a hang: their sockets stay open), SIGCONT in ``seconds``."""
        self.stopped = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in self.stopped:
            _signal(pid, signal.SIGSTOP)
        self.continue_at = time.time() + seconds

    def resume(self) -> None:
        for pid in self.stopped:
            _signal(pid, signal.SIGCONT)
        self.stopped = self.continue_at = None

    def cursor(self) -> dict:
        try:
            cursor = ReplicaFiles(self.run_dir).read_cursor()
        except ValueError:
            cursor = None  # (never seen half-written: the cursor is replaced atomically)
        return cursor or {"step": 0, "next_batch": 0}

    def step(self) -> int:
        """The last step this group committed."""
        return self.cursor()["step"]

    def state(self, now: float) -> str:
        if self.stopped is not None:
            return f"step {self.step()}, stopped (continues in {max(0.0, self.continue_at - now):.1f} s)"
        if self.proc is not None:
            return f"step {self.step()}"
        if self.restart_at is not None:
            return f"down (restarts in {max(0.0, self.restart_at - now):.1f} s)"
        return "done" if self.exit_code == 0 else f"failed (exit {self.exit_code})"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, []))
    return out


def run_local(config: str, overrides: list[str], *, replicas: int, nproc: int, kills: str = "", stops: str = "",
              restart_delay: float = 1.0, max_restarts: int = 3, resume: bool = False, timeout_s: float = 3600.0,
              progress_every_s: float = 5.0, out=sys.stdout) -> dict:
    """Run the experiment as ``replicas`` groups of ``nproc`` ranks; returns the summary also written.

    ``resume``: a restarted group resumes from its own last checkpoint instead of catching up
    from a live peer (what a job without the replica layer must do)."""
    if replicas < 1 or nproc < 1:
        raise ConfigError(f"--replicas and --nproc: expected values >= 1, got {replicas} and {nproc}")
    if restart_delay < 0:
        raise ConfigError(f"--restart-delay: expected seconds >= 0, got {restart_delay}")
    overrides = [o[2:] if o.startswith("--") else o for o in overrides]
    ft = ["ft.enable=true", f"ft.num_replicas={replicas}"]
    cfg = load_config(config, [*overrides, *ft])
    plan = parse_kills(kills, replicas, cfg.train.steps)
    hangs = parse_stops(stops, replicas, cfg.train.steps)
    run_dir = cfg.run.dir or os.path.join(
        cfg.run.out_dir, f"{cfg.run.name}-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}")
    os.makedirs(run_dir, exist_ok=True)

    os.environ.setdefault("RUST_LOG", "warn")  # the in-process lighthouse would log every quorum
    options = LighthouseOptions(bind="127.0.0.1:0", min_replicas=cfg.ft.min_replicas)
    lighthouse = start_lighthouse(options)
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("TORCHFT_LIGHTHOUSE", None)
    groups = []
    for r in range(replicas):
        group_dir = os.path.join(run_dir, f"replica{r}")
        cmd = [sys.executable, "-m", "freescale", "train", f"--nproc={nproc}", "--config", config, *(f"--{o}" for o in overrides),
               *(f"--{o}" for o in ft), f"--ft.replica_id={r}", f"--ft.lighthouse={address}", f"--run.dir={group_dir}"]
        groups.append(Group(r, cmd, group_dir, os.path.join(run_dir, f"replica{r}.console.log"), env,
                            kills=[k.step for k in plan if k.replica == r], stops=[s for s in hangs if s.replica == r]))
    kill_all = sorted(k.step for k in plan if k.replica == ALL)
    print(f"[local] {replicas} replica group(s) x {nproc} rank(s), lighthouse {address}, run folder {run_dir}"
          + (f", kills {kills}" if plan else "") + (f", stops {stops}" if hangs else ""), file=out, flush=True)

    started = time.time()
    previous = _on_terminate(_raise_exit)  # a SIGTERM tears the groups down, as Ctrl-C does
    try:
        for g in groups:
            g.start()
        _watch(groups, kill_all, cfg, restart_delay, max_restarts, resume, started + timeout_s, progress_every_s, out)
    finally:
        for g in groups:
            if g.proc is not None:
                g.kill()
        lighthouse.shutdown()
        _on_terminate(previous)
    summary = summarize(run_dir, cfg, groups, nproc, wall_s=time.time() - started, address=address)
    write_json_atomic(os.path.join(run_dir, SUMMARY_FILE), summary)
    _print_summary(summary, out)
    return summary


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _on_terminate(handler):
    """Install ``handler`` for SIGTERM (in the main thread only); the one it replaces."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _watch(groups: list[Group], kill_all: list[int], cfg: ExperimentConfig, restart_delay: float, max_restarts: int,
           resume: bool, deadline: float, progress_every_s: float, out) -> None:
    last_line = 0.0
    progress = bar(total=cfg.train.steps, desc="local", unit="step")  # the furthest group's committed step

    def tell(message: str) -> None:
        say(progress, message, file=out)

    while True:
        now = time.time()
        progress.update(max(max(g.step() for g in groups), progress.n) - progress.n)
        if kill_all and any(g.proc is not None and g.cursor()["next_batch"] >= kill_all[0] for g in groups):
            trained = kill_all.pop(0)
            running = [g for g in groups if g.proc is not None]
            for g in running:
                _kill(g, restart_delay)
            tell(f"[local] every group killed (SIGKILL) once one had trained {trained} batches of its shard, at "
                  f"committed steps {', '.join(str(g.step()) for g in running)}; restart in {restart_delay:.1f} s")
        for g in groups:
            if g.stopped is not None and now >= g.continue_at:
                g.resume()
                g.failures[-1].restarted_at = time.time()
                tell(f"[local] replica {g.replica} continued (SIGCONT)")
            elif g.proc is not None and g.stopped is None and g.stops and g.cursor()["next_batch"] >= g.stops[0].step:
                if g.stop_due is None:
                    g.stop_due = now + g.stops[0].after
                if now >= g.stop_due:
                    stop, g.stop_due = g.stops.pop(0), None
                    g.stop(stop.seconds)
                    g.failures.append(Failure(step=g.step(), killed_at=time.time(), cause="stopped"))
                    tell(f"[local] replica {g.replica} stopped (SIGSTOP) {f'{stop.after:g} s ' if stop.after else ''}after "
                         f"{stop.step} batches of its shard, at committed step {g.step()}; continues in {stop.seconds:g} s")
            if g.proc is not None and g.kills and g.cursor()["next_batch"] >= g.kills[0]:
                trained = g.kills.pop(0)
                _kill(g, restart_delay)
                tell(f"[local] replica {g.replica} killed (SIGKILL) after {trained} batches of its shard, at "
                      f"committed step {g.step()}; restart in {restart_delay:.1f} s")
            elif g.proc is None and g.restart_at is not None and now >= g.restart_at:
                g.restart_at = None
                others = [o for o in groups if o is not g]
                if others and all(o.proc is None and o.restart_at is None and o.exit_code == 0 for o in others):
                    tell(f"[local] replica {g.replica} is not restarted: every other group finished the run "
                          f"(step {cfg.train.steps}) while it was down, so there is no live run to rejoin")
                    continue
                if not any(o.proc is not None for o in others) and not resume:
                    tell(f"[local] replica {g.replica} restarts with no other group running: it resumes from the "
                          f"job's newest checkpoint")
                g.failures[-1].restarted_at = time.time()
                g.start((f"--checkpoint.resume={g.run_dir}",) if resume else ())
                tell(f"[local] replica {g.replica} restarted")
            elif g.proc is not None and g.proc.poll() is not None:
                g.exit_code, g.proc = g.proc.returncode, None
                if g.exit_code:
                    crashes = sum(1 for f in g.failures if f.cause != "killed")
                    again = g.exit_code != EXIT_USAGE and crashes < max_restarts
                    tell(f"[local] replica {g.replica} failed with exit code {g.exit_code} (see {g.console})"
                          + (f"; restart in {restart_delay:.1f} s" if again else ""))
                    if again:
                        g.failures.append(Failure(step=g.step(), killed_at=time.time(), cause=f"exit {g.exit_code}"))
                        g.restart_at = time.time() + restart_delay
        if all(g.proc is None and g.restart_at is None for g in groups):
            progress.close()
            return
        if now - last_line >= progress_every_s:
            last_line = now
            tell("[local] " + " | ".join(f"replica {g.replica} {g.state(now)}" for g in groups)
                  + f" (of {cfg.train.steps})")
        if now > deadline:
            raise TimeoutError("the replica groups did not finish within --timeout")
        time.sleep(0.05)


def _kill(g: Group, restart_delay: float) -> None:
    g.kill()
    g.failures.append(Failure(step=g.step(), killed_at=time.time()))
    g.restart_at = time.time() + restart_delay


def read_commits(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, COMMITS_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest interval between consecutive ``times`` that overlaps [start, end]."""
    times = sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return max(gaps, default=0.0)


def own_step_times(commits: list[dict]) -> dict[int, float]:
    """A group's own time in each step it trained right after its previous commit: the time
    between the two commits less the time it waited for the other groups in between
    (``blocked_s``)."""
    return {b["step"]: b["time"] - a["time"] - b.get("blocked_s", 0.0) for a, b in zip(commits, commits[1:])
            if b["trained"] and b["step"] == a["step"] + 1}


def _median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def own_step_s(own: dict[int, float]) -> float | None:
    """A group's own time per step: the median of its :func:`own_step_times`; None without any."""
    return _median(own.values()) if own else None


def slow_groups(own: dict[int, dict[int, float]], factor: float) -> list[dict]:
    """The groups whose own time per step (``own``: each group's :func:`own_step_times`) is
    ``factor`` times the others' or more, compared over the steps the group and another trained
    alike: a group's median there against the median, over the same steps, of the others'
    median in each. (A period some groups trained without it, e.g. while it was down, with
    fewer processes on the cores, is no measure of it.)"""
    slow = []
    for g, mine in own.items():
        shared = {s: [o[s] for k, o in own.items() if k != g and s in o] for s in mine}
        shared = {s: t for s, t in shared.items() if t}
        if not shared:
            continue
        mine_s, theirs_s = _median(mine[s] for s in shared), _median(_median(t) for t in shared.values())
        if mine_s >= factor * theirs_s:
            slow.append({"replica": g, "times_slower": round(mine_s / theirs_s, 2), "own_step_s": round(mine_s, 4),
                         "others_step_s": round(theirs_s, 4)})
    return slow


def summarize(run_dir: str, cfg: ExperimentConfig, groups: list[Group], nproc: int, *, wall_s: float,
              address: str) -> dict:
    commits = {g.replica: read_commits(g.run_dir) for g in groups}
    own = {g.replica: own_step_times(commits[g.replica]) for g in groups}
    per_group = []
    for g in groups:
        failures = []
        for f in g.failures:
            after = [c["time"] for c in commits[g.replica] if f.restarted_at and c["time"] >= f.restarted_at]
            rejoined = min(after) if after else None
            until = rejoined if rejoined is not None else time.time()
            failures.append({
                "cause": f.cause,
                "at_step": f.step,
                "down_at": round(f.killed_at, 3),
                "rejoined_at": round(rejoined, 3) if rejoined else None,
                "restart_delay_s": round(f.restarted_at - f.killed_at, 3) if f.restarted_at else None,
                "time_to_rejoin_s": round(rejoined - f.restarted_at, 3) if rejoined else None,
                "stall_s": {f"replica{o.replica}": round(longest_gap([c["time"] for c in commits[o.replica]],
                                                                   f.killed_at, until), 3)
                            for o in groups if o is not g},
            })
        per_group.append({
            "replica": g.replica,
            "exit_code": g.exit_code,
            "committed_steps": len(commits[g.replica]),
            "trained_steps": sum(1 for c in commits[g.replica] if c["trained"]),
            "last_step": g.step(),
            "own_step_s": None if not own[g.replica] else round(own_step_s(own[g.replica]), 4),
            "failures": failures,
            "console": g.console,
        })
    return {"run_dir": run_dir, "lighthouse": address, "replicas": len(groups), "ranks_per_replica": nproc,
            "steps": cfg.train.steps, "wall_s": round(wall_s, 3), "groups": per_group,
            "max_stall_s": max((s for p in per_group for f in p["failures"] for s in f["stall_s"].values()), default=0.0),
            "slow_factor": cfg.ft.slow_factor, "slow": slow_groups(own, cfg.ft.slow_factor),
            "ledger": ledger_check(cfg, groups, nproc) if cfg.train.ledger else None}


def ledger_check(cfg: ExperimentConfig, groups: list[Group], nproc: int) -> dict:
    """Every batch of every group's shard before its cursor, trained exactly once, and every
    group at the last step."""
    records, expected = [], {}
    reached = {g.replica: g.step() for g in groups}
    for g in groups:
        cursor = ReplicaFiles(g.run_dir).read_cursor()
        positions = range(cursor["next_batch"] if cursor else 0)
        expected.update(expected_samples(cfg, [p * len(groups) + g.replica for p in positions], nproc))
        try:
            records += read_ledger(g.run_dir)
        except FileNotFoundError:
            pass
    return audit(records, expected, reached=reached, last_step=cfg.train.steps) | {"batches": len(expected)}


def _print_summary(summary: dict, out) -> None:
    for p in summary["groups"]:
        print(f"[local] replica {p['replica']}: exit {p['exit_code']}, {p['committed_steps']} committed steps "
              f"({p['trained_steps']} on its own batches), last step {p['last_step']}", file=out)
        for f in p["failures"]:
            stalls = ", ".join(f"{k} {v:.2f} s" for k, v in f["stall_s"].items())
            back = (f"for {f['restart_delay_s']} s, rejoined {f['time_to_rejoin_s']} s after it continued"
                    if f["cause"] == "stopped" else f"rejoined {f['time_to_rejoin_s']} s after its restart")
            print(f"[local]   {f['cause']} at step {f['at_step']}: {back}; longest stall of the others: {stalls}",
                  file=out)
    for slow in summary["slow"]:
        print(f"[local] replica {slow['replica']} is slow: {slow['times_slower']}x the others' own time per step "
              f"({slow['own_step_s']} s against {slow['others_step_s']} s)", file=out)
    if not summary["slow"]:
        print(f"[local] slow groups: none (own time per step {summary['slow_factor']}x the others' or more)", file=out)
    ledger = summary["ledger"]
    if ledger:
        unfinished = (f"; INCOMPLETE: replica(s) {', '.join(map(str, ledger['unfinished']))} did not reach step "
                      f"{summary['steps']}" if not ledger["complete"] else "")
        print(f"[local] ledger: {ledger['batches']} batches, samples lost {ledger['samples_lost']}, "
              f"repeated {ledger['samples_repeated']}{unfinished}", file=out)
    print(f"[local] wrote {os.path.join(summary['run_dir'], SUMMARY_FILE)}", file=out, flush=True)


def succeeded(summary: dict) -> bool:
    ledger = summary["ledger"]
    return all(p["exit_code"] == 0 for p in summary["groups"]) and (ledger is None or exactly_once(ledger))

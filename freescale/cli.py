"""``freescale`` command line: each subcommand loads the config and calls one library function.

    freescale train  --config PATH [--nproc N] [--section.key=value ...]
    freescale verify --config PATH [--nproc N] [--pipelines A,B] [--set-b K=V]   two pipelines, bit for bit
    freescale report RUN_DIR [RUN_DIR_B]                          bubble report (or B against A)
    freescale calibrate --config PATH [--out PATH]               fit the per-sample cost model
    freescale balance --lengths X.npy --ranks N [--partition P]  partition quality of a global batch
    freescale config [--config PATH] [--section.key=value ...]   print the resolved config
    freescale lighthouse [--bind HOST:PORT] [--min-replicas N]    torchft's lighthouse for replica groups
                         [--until-done RUN_DIR --replicas R]     ... until the run's R groups finish
    freescale local --config PATH --replicas R --nproc N [--kill R@S,...] [--stop R@S[+AFTER][:SECONDS],...] [--restart-delay S]
                                                                 R replica groups on this host, with kills
    freescale prepare --input PATH... --format F --out DIR [...]  an interaction log as Parquet sample files
    freescale prepare --synthetic N --out DIR [--synthetic.key=value ...]   the synthetic stream, as files

Bad input (unknown key, wrong type, out-of-range value, missing or malformed file, malformed
YAML) exits with status 2 and one line on stderr naming what was wrong. A run that fails
after it started exits with status 1 and one line naming the cause and the rank's log file,
which holds the traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import uuid

from freescale.config import TOP_LEVEL_KEYS, ConfigError, describe, dump_yaml, load_config
from freescale.errors import first_line

EXIT_USAGE = 2
EXIT_FAILED = 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="freescale", description="Distributed trainer for sequence recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (standalone, N ranks on this host with --nproc, or under torchrun)",
                           epilog="Any config key can be overridden as --section.key=value; see `freescale config --keys`.")
    train.add_argument("--config", required=True, help="experiment YAML file")
    train.add_argument("--nproc", type=int, default=0, metavar="N",
                       help="N ranks on this host: the config is checked here, then torchrun's launcher starts them "
                            "(for several hosts, run torchrun -m freescale train on each)")
    report = sub.add_parser("report", help="bubble report of a run folder, or two side by side (B against A)")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run folder, or two to compare")
    report.add_argument("--out", help="output folder (default: RUN/report, or RUN_B/report/compare-<A>)")
    report.add_argument("--warmup-steps", type=int, help="steps left out of the means (default: the run's profile.warmup_steps)")
    report.add_argument("--gantt-steps", type=int, default=6, help="steps shown in the Gantt chart")
    bal = sub.add_parser("balance", help="partition a global batch of UIH lengths and report each partition's imbalance")
    bal.add_argument("--lengths", required=True, help=".npy file: 1-D UIH lengths of a global batch, in time order")
    bal.add_argument("--candidates", help=".npy file: candidate counts per sample (default: 1 each)")
    bal.add_argument("--ranks", type=int, required=True, help="ranks to partition across")
    bal.add_argument("--partition", default="all", help="a partition name, or all")
    bal.add_argument("--cost-model", default="", help="cost model JSON (default: the built-in model)")
    bal.add_argument("--json", action="store_true", help="print one JSON object keyed by partition")
    cal = sub.add_parser("calibrate", help="fit the per-sample cost model on this machine")
    cal.add_argument("--config", required=True, help="experiment YAML file (the model to measure)")
    cal.add_argument("--out", default="", help="where to write the cost model JSON (default: <run.out_dir>/cost_model-<run.name>.json)")
    cal.add_argument("--repeats", type=int, default=5, help="timed repetitions per grid point")
    ver = sub.add_parser("verify", help="train the same data with two pipelines (default: sync and prioritized) and "
                         "compare every step's loss and all state; exit 0 only if bitwise equal (or within --tolerance)",
                         epilog="Any config key can be overridden as --section.key=value (both runs). Runs standalone, with --nproc, "
                         "or under torchrun. Not under the replica layer (ft.enable).")
    ver.add_argument("--config", required=True, help="experiment YAML file")
    ver.add_argument("--steps", type=int, default=20, help="steps to train each way (default 20)")
    ver.add_argument("--nproc", type=int, default=0, metavar="N",
                     help="N ranks on this host, as train --nproc starts them (default: standalone, or torchrun's ranks)")
    ver.add_argument("--pipelines", default="sync,prioritized", metavar="A,B",
                     help="the two pipelines to compare, over the same kind of tables: sync and prioritized "
                          "(FreeScale's own), or sparse_dist, base and pec (TorchRec's) (default sync,prioritized)")
    ver.add_argument("--uncorrected", action="store_true",
                     help="run pec as TorchRec 1.8.0 ships it (train.pec_corrections=false), for the record: "
                          "it trains other numbers than sparse_dist (docs/pec.md)")
    ver.add_argument("--set-b", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="a config override for run B alone (repeatable): does this setting change the numbers?")
    ver.add_argument("--tolerance", type=float, default=0.0,
                     help="pass when every loss and state difference is at most this (default 0: bit for bit; "
                          "for a GPU run, whose kernels need not be bitwise reproducible)")
    lh = sub.add_parser("lighthouse", help="run torchft's lighthouse, which forms the quorum of the replica groups")
    lh.add_argument("--bind", default="127.0.0.1:29510", help="HOST:PORT to listen on (default 127.0.0.1:29510; "
                    "bind an address the other hosts reach for a multi-host job)")
    lh.add_argument("--min-replicas", type=int, default=1, help="replica groups a quorum needs (default 1)")
    lh.add_argument("--heartbeat-timeout-ms", type=int, default=500,
                    help="a group silent this long is dead to the quorum (default 500)")
    lh.add_argument("--join-timeout-ms", type=int, default=1000,
                    help="how long a quorum waits for a heartbeating group to join (default 1000)")
    lh.add_argument("--until-done", metavar="RUN_DIR", default="",
                    help="exit once every replica group in RUN_DIR (RUN_DIR/replica<r>/) has finished the run "
                         "(default: run until SIGTERM)")
    lh.add_argument("--replicas", type=int, default=0, help="the replica groups --until-done waits for")
    loc = sub.add_parser("local", help="a lighthouse and R replica groups of N ranks on this host, with kills and restarts",
                         epilog="Any config key can be overridden as --section.key=value.")
    loc.add_argument("--config", required=True, help="experiment YAML file")
    loc.add_argument("--replicas", type=int, required=True, help="replica groups (a freescale train --nproc N process each)")
    loc.add_argument("--nproc", type=int, required=True, help="ranks per replica group")
    loc.add_argument("--kill", default="", help="REPLICA@STEP,...: SIGKILL the group once it has trained STEP batches "
                     "of its shard; all@STEP: every group at once, when the first has")
    loc.add_argument("--stop", default="", help="REPLICA@STEP[+AFTER][:SECONDS],...: SIGSTOP every process of the group "
                     "once it has trained STEP batches of its shard (AFTER seconds later: inside its next step), a hang; "
                     "SIGCONT after SECONDS (default 15)")
    loc.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a killed group restarts (default 1)")
    loc.add_argument("--resume", action="store_true",
                     help="a restarted group resumes from its own last checkpoint instead of catching up from a live "
                     "peer (what a job without the replica layer does)")
    loc.add_argument("--max-restarts", type=int, default=3, help="restarts of a group that crashes (default 3)")
    loc.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds (default 3600)")
    simp = sub.add_parser("simulate", help="project step time, bubbles and effective training time to 8 .. 100K ranks "
                          "(baseline against the config's techniques)")
    simp.add_argument("--config", required=True, help="experiment YAML file (its sim section holds the machine)")
    simp.add_argument("--out", default="", help="write the projection as JSON here too")
    simp.add_argument("--plot", default="", help="draw bubbles and effective training time against ranks into this PNG")
    exp = sub.add_parser("export", help="an inference model from a run's checkpoint: tables quantized row-wise, the "
                         "dense part as a torch.export program; it loads with torch, torchrec and fbgemm alone")
    exp.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (any pipeline, any number of ranks)")
    exp.add_argument("--step", type=int, help="the checkpoint's step (default: the newest)")
    exp.add_argument("--out", required=True, help="the export folder to write (must not exist, or be empty)")
    exp.add_argument("--quantize", default="int8", help="the tables' row-wise quantization: fp32, fp16, int8 "
                     "(default) or int4")
    sb = sub.add_parser("serve-bench", help="an export's latency (p50/p99), queries/s, held-out AUC/NE against the "
                        "trained fp32 model's, and size")
    sb.add_argument("export_dir", metavar="DIR", help="an export folder (freescale export)")
    sb.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256], help="requests of these many "
                    "samples (default 1 16 64 256)")
    sb.add_argument("--threads", type=int, help="intra-op threads (default: torch's)")
    sb.add_argument("--json", default="", help="write the result as JSON here too")
    _prepare_parser(sub)
    show = sub.add_parser("config", help="print the resolved config (or every key with its docs)")
    show.add_argument("--config", help="experiment YAML file")
    show.add_argument("--keys", action="store_true", help="list every key with its default and description")
    return parser


def _prepare_parser(sub) -> None:
    from freescale.data.log_formats import FORMATS, TIME_UNITS
    from freescale.data.prepare import Engine, Layout, SampleSettings

    d, lay, eng = SampleSettings(), Layout(), Engine()  # numpy at most: the parser is built for every command
    prep = sub.add_parser(
        "prepare", help="cut an interaction log (or the synthetic stream) into a prepared dataset: Parquet sample "
        "files and a manifest (docs/data.md)",
        epilog="Synthetic settings are --synthetic.KEY=VALUE (the keys of data.synthetic, see `freescale config "
        "--keys`). A second run asking for what --out already holds writes nothing.")
    what = prep.add_argument_group("what to read")
    what.add_argument("--input", nargs="+", metavar="PATH", help="the log's files (globs allowed; matches in name order)")
    what.add_argument("--format", choices=FORMATS, help="the log's format (ml100k without --input: the cached "
                      "MovieLens-100K with its user and item features)")
    what.add_argument("--ml100k", action="store_true", help="MovieLens-100K from the recbole wheel, with its user and "
                      "item features (same as --format ml100k without --input)")
    what.add_argument("--synthetic", type=int, metavar="N", help="N training samples of the synthetic stream instead of a log")
    what.add_argument("--users", help="user side-feature file (MovieLens u.user, ml-100k.user or users.dat)")
    what.add_argument("--items", help="item side-feature file (MovieLens u.item, ml-100k.item or movies.dat)")
    what.add_argument("--columns", default="", help="csv/events: ROLE=COLUMN,... with roles user, item, time, rating")
    what.add_argument("--time-unit", default="s", choices=list(TIME_UNITS), help="events: the unit of a numeric time column")
    what.add_argument("--labels", default="", help="kuairand: the 0/1 columns that become labels, comma-separated "
                      "(default is_click,long_view,is_like)")
    what.add_argument("--cache", default="runs/cache", help="where MovieLens-100K is cached (default runs/cache)")
    cut = prep.add_argument_group("how samples are cut (defaults: the config's)")
    cut.add_argument("--out", required=True, help="the dataset folder to write")
    cut.add_argument("--task", default=d.task, choices=["ranking", "retrieval"])
    cut.add_argument("--min-uih-len", type=int, default=d.min_uih_len)
    cut.add_argument("--max-uih-len", type=int, default=d.max_uih_len)
    cut.add_argument("--num-candidates", type=int, default=d.num_candidates, help="ranking: candidates per sample")
    cut.add_argument("--holdout-fraction", type=float, default=d.holdout_fraction, help="ranking: the latest samples held out")
    cut.add_argument("--positive-rating", type=float, default=d.positive_rating, help="ranking: label 0 is rating >= this")
    cut.add_argument("--more-labels", type=float, nargs="*", default=list(d.more_labels), metavar="R",
                     help="ranking: further thresholds, one label each")
    cut.add_argument("--window-stride", type=int, default=d.window_stride,
                     help="retrieval: training windows end this many events apart (0: --max-uih-len)")
    cut.add_argument("--eval-samples", type=int, default=2048, help="synthetic: held-out samples (default 2048)")
    cut.add_argument("--seed", type=int, default=0, help="synthetic: the stream's seed (run.seed)")
    res = prep.add_argument_group("files and resources")
    res.add_argument("--rows-per-file", type=int, default=lay.rows_per_file)
    res.add_argument("--rows-per-group", type=int, default=lay.rows_per_group)
    res.add_argument("--memory-limit", default=eng.memory_limit, help=f"DuckDB's memory limit (default {eng.memory_limit}); "
                     "it spills to <out>.tmp-<pid>/_work beyond it")
    res.add_argument("--threads", type=int, default=eng.threads, help=f"DuckDB's threads (default {eng.threads}: the cores)")


def _prepare(args, extra: list[str]) -> None:
    import duckdb

    from freescale.data.log_formats import LogOptions
    from freescale.data.ml100k import ensure_ml100k, ensure_ml100k_features
    from freescale.data.errors import DataError
    from freescale.data.prepare import Engine, Layout, SampleSettings, prepare_log, prepare_synthetic
    from freescale.data.sample_files import SampleFileError

    settings = SampleSettings(task=args.task, min_uih_len=args.min_uih_len, max_uih_len=args.max_uih_len,
                              num_candidates=args.num_candidates, holdout_fraction=args.holdout_fraction,
                              positive_rating=args.positive_rating, more_labels=tuple(args.more_labels),
                              window_stride=args.window_stride)
    layout = Layout(rows_per_file=args.rows_per_file, rows_per_group=args.rows_per_group)
    ml100k = args.ml100k or (args.format == "ml100k" and not args.input)
    sources = [name for name, given in (("--input", bool(args.input)), ("--ml100k", args.ml100k),
                                        ("--synthetic", args.synthetic is not None)) if given]
    if len(sources) > 1:
        _fail(f"{sources[0]} and {sources[1]}: give one source")
    try:
        if args.synthetic is not None:
            overrides = _split_overrides(extra)
            bad = [a for a in overrides if not a.startswith("--synthetic.")]
            if bad:
                _fail(f"unrecognized argument '{bad[0]}' (synthetic settings look like --synthetic.key=value)")
            try:
                cfg = load_config(None, ["--data." + a[2:] for a in overrides]).data.synthetic
            except ConfigError as e:
                _fail(first_line(e).replace("data.synthetic.", "synthetic."))
            result = prepare_synthetic(args.out, args.synthetic, args.eval_samples, cfg, seed=args.seed,
                                       settings=settings, layout=layout)
        else:
            if extra:
                _fail(f"unrecognized argument '{extra[0]}'")
            if not ml100k and not args.input:
                _fail("give --input PATH... with --format, --ml100k, or --synthetic N")
            if not ml100k and not args.format:
                _fail("--format: required with --input")
            users, items, inputs = args.users, args.items, args.input
            if ml100k:
                inputs = [ensure_ml100k(args.cache)]
                default_users, default_items = ensure_ml100k_features(args.cache)
                users, items = users or default_users, items or default_items
            columns = _columns(args.columns)
            options = LogOptions(columns=columns, time_unit=args.time_unit,
                                 signals=tuple(s.strip() for s in args.labels.split(",") if s.strip()))
            result = prepare_log(args.out, "ml100k" if ml100k else args.format, inputs, settings, options=options,
                                 users=users, items=items, layout=layout,
                                 engine=Engine(memory_limit=args.memory_limit, threads=args.threads))
    except (ConfigError, DataError, SampleFileError) as e:
        _fail(first_line(e))
    except (duckdb.Error, MemoryError, OSError) as e:  # a resource ran out (memory, disk): not the input's fault
        hint = " (raise --memory-limit, or lower --threads)" if isinstance(e, (duckdb.OutOfMemoryException, MemoryError)) else ""
        print(f"freescale: error: prepare failed: {first_line(e)}{hint}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    m = result.manifest
    if result.up_to_date:
        print(f"{result.path} is up to date ({m.splits['train']['rows']} train and {m.splits['eval']['rows']} eval "
              f"samples from the same inputs and settings); nothing written")
        return
    rate = f", {result.events / result.seconds:,.0f} events/s" if result.events else ""
    print(f"wrote {result.path}: {m.splits['train']['rows']} train and {m.splits['eval']['rows']} eval {m.task} samples, "
          f"{m.num_users} users, {m.num_items} items in {result.seconds:.1f} s{rate}")


def _columns(text: str) -> dict[str, str]:
    """``--columns user=a,item=b`` as {role: column}."""
    columns = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        role, sep, name = part.partition("=")
        if not sep or not role.strip() or not name.strip():
            _fail(f"--columns: expected ROLE=COLUMN pairs separated by commas, got {part!r}")
        columns[role.strip()] = name.strip()
    return columns


def _split_overrides(extra: list[str]) -> list[str]:
    """``--a.b=1`` and ``--a.b 1`` forms, and a top-level key's (``--faults=[...]``); anything else
    is a usage error."""
    overrides = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        key = arg.split("=", 1)[0]
        if not arg.startswith("--") or ("." not in key and key[2:] not in TOP_LEVEL_KEYS):
            raise ConfigError(f"unrecognized argument '{arg}' (config overrides look like --section.key=value)")
        if "=" not in arg:
            if i + 1 >= len(extra):
                raise ConfigError(f"override '{arg}': expected a value (--section.key=value)")
            arg = f"{arg}={extra[i + 1]}"
            i += 1
        overrides.append(arg)
        i += 1
    return overrides


def _fail(message: str) -> None:
    _error(message)
    sys.exit(EXIT_USAGE)


def _error(message: str) -> None:
    """``freescale: error: MESSAGE`` on stderr in one write: the ranks of a job share the stream,
    and with ``PYTHONUNBUFFERED`` ``print`` writes the line and its newline apart, so two ranks
    failing at once would interleave them."""
    sys.stderr.write(f"freescale: error: {message}\n")
    sys.stderr.flush()


def _fail_once(message: str) -> None:
    """``_fail`` for an error every rank of a torchrun job finds alike (the config's): rank 0
    says it, the others exit with the same status.

    Under torchrun's agent the others wait to be stopped (up to ``_SAID_WAIT_S``): a rank that
    exited first would have the agent stop rank 0, which may start later on a busy machine,
    before it said anything. Rank 0's exit has the agent stop them."""
    if int(os.environ.get("RANK") or 0) != 0:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            time.sleep(_SAID_WAIT_S)
        sys.exit(EXIT_USAGE)
    _fail(message)


_SAID_WAIT_S = 60.0


def _launch(nproc: int, argv: list[str], cfg) -> None:
    """``freescale train|verify --nproc N``: the config was checked here; torchrun's launcher now
    starts N ranks of the command on this host, in this process. A rank that fails has said why
    (one line); this exits with its status, without torchrun's own report of it.

    On CPU the ranks are forked from this process once it has imported what a rank imports
    (``RANK_IMPORTS``): each starts with torch, TorchRec, fbgemm and the trainer in memory
    instead of importing them again, about 4 s of CPU a rank. A run that may use CUDA starts
    its ranks as fresh processes, as ``torchrun -m freescale`` does: CUDA does not survive a
    fork (``forks_ranks``)."""
    import logging

    if nproc < 1:
        _fail(f"--nproc: expected a value >= 1, got {nproc}")
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        _fail("--nproc: this is already a rank of a torchrun job (drop --nproc under torchrun)")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser, run

    levels = {}  # (torchrun's agent logs its banner, each rank's exit, the ranks it stops; a forked rank gets these back)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed", "torch.multiprocessing")):
            levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(logging.CRITICAL)
    ranks = _without_nproc(argv)
    fork = forks_ranks(cfg)
    args = get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}",
                                         *(["--start-method=fork"] if fork else []), "-m", "freescale", *ranks])
    try:
        if fork:
            import importlib

            for name in RANK_IMPORTS:
                importlib.import_module(name)
            # What torch.distributed.run.run does with --standalone, the entrypoint being a function.
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
            config, _, _ = config_from_args(args)
            elastic_launch(config=config, entrypoint=_forked_rank)(ranks, levels)
        else:
            run(args)
    except ChildFailedError as e:
        # A rank that exited with a status said why; the others may then have been stopped by
        # torchrun's signal, and a stopped rank can sort first.
        said = {rank: f for rank, f in e.failures.items() if f.exitcode > 0}
        rank, failure = min((said or e.failures).items())
        if failure.exitcode > 0:  # (the rank printed its error)
            sys.exit(failure.exitcode)
        print(f"freescale: error: rank {rank} ended by signal {-failure.exitcode} (pid {failure.pid})", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except SignalException as e:  # (torchrun's agent stopped the ranks first)
        print(f"freescale: stopped by {signal.Signals(e.sigval).name}, and the ranks with it", file=sys.stderr)
        sys.exit(128 + int(e.sigval))


RANK_IMPORTS = ("freescale.train.trainer", "freescale.train.verify", "torchrec.metrics.auc", "numpy.ma",
                "torch.distributed.optim")
"""What a rank of ``train`` or ``verify`` imports, some of it only once it runs (the evaluation's
metrics, the optimizers): ``--nproc`` on CPU imports it in the launcher, before forking the ranks."""


def forks_ranks(cfg) -> bool:
    """Whether ``--nproc`` forks the ranks from the launcher: when the run is on CPU
    (``run.device: cpu``, or ``auto`` with a torch built without CUDA). A CUDA process that forks
    after CUDA is initialized gives children that cannot use it, and importing TorchRec and
    fbgemm may initialize it."""
    import torch

    return cfg.run.device == "cpu" or (cfg.run.device == "auto" and not torch.backends.cuda.is_built())


def _forked_rank(argv: list[str], levels: dict[str, int]) -> None:
    """A rank forked by ``_launch``: the command, ended as ``run`` ends it. It starts with the
    launcher's signal handlers (torchrun's agent turns SIGTERM into an exception, which a rank
    blocked in a collective would never see) and its quieted loggers: both are put back first.
    A failure ends the process with its status; a rank that passed returns, for torchrun's
    agent to collect."""
    import logging

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    code = _finish(_status(argv))
    if code:
        os._exit(code)


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line with ``--nproc N`` (or ``--nproc=N``) taken out: what each rank runs."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def _report(args) -> None:
    from freescale.profile.report import write_comparison, write_report

    if len(args.runs) > 2:
        _fail(f"report takes one run folder or two to compare, got {len(args.runs)}")
    for run in args.runs:
        if not os.path.isdir(run):
            _fail(f"run folder not found: {run}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        _fail(f"--warmup-steps: expected a value >= 0, got {args.warmup_steps}")
    try:
        if len(args.runs) == 1:
            path = write_report(args.runs[0], warmup_steps=args.warmup_steps, gantt_steps=args.gantt_steps, out_dir=args.out)
        else:
            path = write_comparison(args.runs[0], args.runs[1], out_dir=args.out, warmup_steps=args.warmup_steps)
    except (FileNotFoundError, ValueError) as e:
        _fail(str(e))
    print(f"wrote {path}")


def _load_array(path: str, what: str):
    import numpy as np

    if not os.path.isfile(path):
        _fail(f"{what} file not found: {path}")
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        _fail(f"{path}: not a .npy array ({str(e).splitlines()[0]})")
    if arr.ndim != 1:
        _fail(f"{path}: expected a 1-D array of {what}, got shape {arr.shape}")
    if arr.size and (not np.issubdtype(arr.dtype, np.number) or (arr < 0).any()):
        _fail(f"{path}: {what} must be numbers >= 0")
    return arr


def _balance(args) -> None:
    import json

    import numpy as np

    from freescale.balance.cost import CostModelError, load_cost_model
    from freescale.balance.partition import PARTITIONS, evaluate

    lengths = _load_array(args.lengths, "UIH lengths")
    candidates = _load_array(args.candidates, "candidate counts") if args.candidates else np.ones_like(lengths)
    if len(candidates) != len(lengths):
        _fail(f"--candidates: expected {len(lengths)} values (one per sample), got {len(candidates)}")
    if args.ranks < 1:
        _fail(f"--ranks: expected a value >= 1, got {args.ranks}")
    if args.ranks > len(lengths):
        _fail(f"--ranks: {args.ranks} ranks but only {len(lengths)} samples in {args.lengths}")
    names = sorted(PARTITIONS) if args.partition == "all" else [args.partition]
    if names[0] not in PARTITIONS:
        _fail(f"--partition: expected one of {', '.join(sorted(PARTITIONS))} or all; got {args.partition!r}")
    try:
        model = load_cost_model(args.cost_model)
    except CostModelError as e:
        _fail(str(e))
    result = evaluate(model.cost(lengths, candidates), args.ranks, names)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{len(lengths)} samples on {args.ranks} ranks (lower bound on imbalance {result[names[0]]['lower_bound']:.4f})")
    print(f"{'partition':<16}{'imbalance':>10}{'max cost':>12}{'mean cost':>12}{'counts':>12}{'ms':>9}")
    for name, r in result.items():
        counts = f"{r['min_count']}-{r['max_count']}"
        print(f"{name:<16}{r['imbalance']:>10.4f}{r['max_cost']:>12.4g}{r['mean_cost']:>12.4g}{counts:>12}{1e3 * r['seconds']:>9.2f}")


def _calibrate(args, cfg) -> None:
    from freescale.balance.calibrate import calibrate
    from freescale.data.readers import DataError

    if args.repeats < 1:
        _fail(f"--repeats: expected a value >= 1, got {args.repeats}")
    out = args.out or os.path.join(cfg.run.out_dir, f"cost_model-{cfg.run.name}.json")
    try:
        model = calibrate(cfg, repeats=args.repeats)
    except DataError as e:
        _fail(str(e))
    model.save(out)
    print(f"cost(L, C) = {model.a:.4g}*L + {model.b:.4g}*L^2 + {model.c:.4g}*C + {model.d:.4g}  (seconds)")
    print(f"fit: R^2 {model.fit['r2']:.4f}, worst relative error {100 * model.fit['worst_relative_error']:.1f}% "
          f"over {model.fit['points']} points")
    print(f"wrote {out}")


def _simulate(args, cfg) -> None:
    from freescale.balance.cost import CostModelError, load_cost_model
    from freescale.data.readers import DataError
    from freescale.io import write_json_atomic
    from freescale.sim.simulator import format_table, plot, project

    try:
        result = project(cfg, load_cost_model(cfg.balance.cost_model), log=lambda m: print(m, file=sys.stderr))
    except (DataError, CostModelError) as e:
        _fail(str(e))
    print(format_table(result))
    if args.out:
        write_json_atomic(args.out, result)
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


def run(argv: list[str] | None = None) -> None:
    """The ``freescale`` command: ``main``, then out of the process without Python's teardown.

    Once a command has ended (its files written and closed, its status known), tearing down the
    modules torch and TorchRec loaded costs about a second of CPU per process: every rank of
    every launch paid it after its last step. What a normal exit does first still happens here,
    in its order: the threads still running are waited for, the exit handlers run (logging's
    flush, weakref finalizers, torch's own), and the streams are flushed. An exception that
    escapes ``main`` ends the process as usual, with its traceback.
    """
    os._exit(_finish(_status(argv, catch=False)))


def _status(argv: list[str] | None, catch: bool = True) -> int:
    """``main(argv)``'s exit status; ``catch``: an exception that escapes it is printed and is status 1."""
    import traceback

    try:
        main(argv)
        return 0
    except SystemExit as e:
        code = e.code
    except Exception:
        if not catch:
            raise
        traceback.print_exc()
        return 1
    if code is None:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code


def _finish(code: int) -> int:
    """What a normal exit does before Python's teardown: the threads still running are waited
    for, the exit handlers run, the streams are flushed. Returns ``code``."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main(argv: list[str] | None = None) -> None:
    from freescale.logging import quiet_known_warnings

    quiet_known_warnings()
    args, extra = _parser().parse_known_args(argv)
    if args.command in ("report", "balance", "lighthouse", "export", "serve-bench"):
        if extra:
            _fail(f"unrecognized argument '{extra[0]}'")
        {"report": _report, "balance": _balance, "lighthouse": _lighthouse, "export": _export,
         "serve-bench": _serve_bench}[args.command](args)
        return
    if args.command == "local":
        _local(args, extra)
        return
    if args.command == "prepare":
        _prepare(args, extra)
        return
    if args.command == "verify":
        _verify(args, extra, sys.argv[1:] if argv is None else argv)
        return
    try:
        cfg = load_config(args.config, _split_overrides(extra))
    except ConfigError as e:
        _fail_once(str(e))

    if args.command == "calibrate":
        _calibrate(args, cfg)
        return
    if args.command == "simulate":
        _simulate(args, cfg)
        return
    if args.command == "config":
        if args.keys:
            for key, value, doc in describe(cfg):
                print(f"{key} = {value!r}\n    {doc}")
        else:
            print(dump_yaml(cfg), end="")
        return

    if args.nproc:
        _launch(args.nproc, sys.argv[1:] if argv is None else argv, cfg)
        return
    _train(cfg)


def _export(args) -> None:
    from freescale.serve.checks import ExportError, check_export

    try:  # (from the files alone, before torch is imported)
        check_export(args.run_dir, args.out, args.step, args.quantize)
    except ExportError as e:
        _fail(str(e))
    from freescale.data.readers import DataError
    from freescale.serve.export import export

    try:
        manifest = export(args.run_dir, args.out, step=args.step, quantize=args.quantize)
    except (ExportError, DataError) as e:
        _fail(str(e))
    held = manifest["heldout"]
    if manifest["model"]["task"] == "retrieval":
        from freescale.train.retrieval import retrieval_line

        figures = retrieval_line(held, manifest["config"]["task"]["eval_ks"]).removeprefix("eval ")
    else:
        figures = f"AUC {held['auc']:.4f}, NE {held['ne']:.4f} over {held['samples']} samples"
    print(f"exported step {manifest['source']['step']} of {args.run_dir} ({manifest['quantize']}, "
          f"{manifest['size_bytes'] / 2**20:.2f} MiB) to {args.out}; trained model's held-out {figures}")


def _serve_bench(args) -> None:
    from freescale.serve.checks import ExportError, check_bench

    try:  # (before torch is imported)
        check_bench(args.export_dir, args.batch_sizes, args.threads)
    except ExportError as e:
        _fail(str(e))
    from freescale.io import write_json_atomic
    from freescale.serve.bench import bench, format_result

    try:
        result = bench(args.export_dir, args.batch_sizes, threads=args.threads)
    except ExportError as e:
        _fail(str(e))
    print(format_result(result))
    if args.json:
        write_json_atomic(args.json, result)
        print(f"wrote {args.json}")


def _lighthouse(args) -> None:
    from freescale.ft.lighthouse import LighthouseOptions, RunWatch, serve

    if bool(args.until_done) != bool(args.replicas):
        _fail("--until-done RUN_DIR and --replicas R go together (the run folder and the groups it holds)")
    try:
        watch = RunWatch(args.until_done, args.replicas) if args.until_done else None
        serve(LighthouseOptions(bind=args.bind, min_replicas=args.min_replicas,
                                heartbeat_timeout_ms=args.heartbeat_timeout_ms, join_timeout_ms=args.join_timeout_ms),
              watch)
    except ValueError as e:
        _fail(str(e))


def _local(args, extra: list[str]) -> None:
    from freescale.local import run_local, succeeded

    try:
        overrides = _split_overrides(extra)
        summary = run_local(args.config, overrides, replicas=args.replicas, nproc=args.nproc, kills=args.kill,
                            stops=args.stop,                            restart_delay=args.restart_delay, max_restarts=args.max_restarts, resume=args.resume,
                            timeout_s=args.timeout)
    except (ConfigError, ValueError) as e:
        _fail(str(e))
    except TimeoutError as e:
        print(f"freescale: error: {e}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    sys.exit(0 if succeeded(summary) else EXIT_FAILED)


def _verify(args, extra: list[str], argv: list[str]) -> None:
    from freescale.train.pairs import check_runs, pipeline_pair

    # The arguments and both configs first, from the files alone: a mistake is one line before
    # torch is imported.
    if args.steps < 2:
        _fail(f"--steps: expected at least 2 (the pipeline overlaps consecutive steps), got {args.steps}")
    if not args.tolerance >= 0:
        _fail(f"--tolerance: expected a number at least 0, got {args.tolerance}")
    try:
        a, b = pipeline_pair(args.pipelines)
        overrides = _split_overrides(extra)
        if any(item.removeprefix("--").split("=", 1)[0] == "train.pipeline" for item in [*overrides, *args.set_b]):
            raise ConfigError("train.pipeline: freescale verify trains the two pipelines of --pipelines")
        if args.uncorrected and "pec" not in (a, b):
            raise ConfigError(f"--uncorrected: it runs train.pipeline pec as shipped; --pipelines {a},{b} has no pec")
        shipped = ["--train.pec_corrections=false"] if args.uncorrected else []
        cfg_a = load_config(args.config, [*overrides, f"--train.pipeline={a}", *(shipped if a == "pec" else [])])
        cfg_b = load_config(args.config, [*overrides, *args.set_b, f"--train.pipeline={b}",
                                          *(shipped if b == "pec" else [])])
        check_runs(cfg_a, cfg_b)
    except ConfigError as e:
        _fail(str(e))
    if args.nproc:
        _launch(args.nproc, argv, cfg_a)
        return

    import torch.distributed as dist

    from freescale import distributed
    from freescale.balance.cost import CostModelError
    from freescale.data.readers import DataError
    from freescale.train.verify import print_verdict, verify

    try:
        verdict = verify(cfg_a, cfg_b, args.steps)
    except (ConfigError, DataError, CostModelError) as e:
        _fail(str(e))
    if int(os.environ.get("RANK", 0)) == 0:
        if args.set_b:
            print(f"run B ({b}) with {' '.join(args.set_b)}")
        if args.uncorrected:
            print("pec as TorchRec 1.8.0 ships it (train.pec_corrections=false)")
        print_verdict(verdict, args.tolerance)
        sys.stdout.flush()
    # Every rank exits with the verdict, once rank 0 has printed it: torchrun stops the other
    # ranks when the first one exits with 1.
    dist.barrier()
    distributed.shutdown()
    sys.exit(0 if verdict.within(args.tolerance) else EXIT_FAILED)


def _train(cfg) -> None:
    from freescale import distributed
    from freescale.balance.cost import CostModelError
    from freescale.data.readers import DataError
    from freescale.train.checkpoint import CheckpointError
    from freescale.train.trainer import TrainingError, train

    bad_input = (ConfigError, DataError, CheckpointError, CostModelError)
    try:
        train(cfg)
    except bad_input as e:
        _fail(str(e))
    except TrainingError as e:
        if isinstance(e.__cause__, bad_input):
            _fail(str(e.__cause__))
        _error(f"{first_line(str(e))} (traceback in {e.log_path})")
        sys.exit(EXIT_FAILED)
    distributed.shutdown()  # while Python still runs: gloo's threads must not outlive the interpreter


if __name__ == "__main__":
    main()

"""The `swarmtrain` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmtrain import __version__
from swarmtrain.core import hardware
from swarmtrain.errors import SwarmError

if TYPE_CHECKING:
    from swarmtrain.transport.tls import TLSConfig

__all__ = ["main", "build_parser"]

log = logging.getLogger("swarmtrain")


def _setup_logging(level: str, json_logs: bool = False) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    if json_logs:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_JsonFormatter())
    else:
        from rich.logging import RichHandler

        handler = RichHandler(show_path=False, rich_tracebacks=False, log_time_format="%H:%M:%S")
    logging.basicConfig(level=lvl, handlers=[handler], format="%(message)s", force=True)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": record.created, "level": record.levelname.lower(),
                "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def _tls_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS (optional; all three or none, made by `swarmtrain keys`)")
    g.add_argument("--tls-cert", help="this node's certificate (PEM)")
    g.add_argument("--tls-key", help="this node's private key (PEM)")
    g.add_argument("--tls-ca", help="the cluster CA certificate (ca.pem)")


def _common(p: argparse.ArgumentParser, *, compression: bool = True) -> None:
    """Flags of the training roles; ``compression=False`` leaves out --compression and
    --topk-ratio (peer mode compresses its all-reduce with --wire instead)."""
    p.add_argument("--config", help="TOML config file (CLI flags override it)")
    p.add_argument("--secret-file", help="file holding the cluster secret (or set SWARMTRAIN_SECRET)")
    _tls_flags(p)
    p.add_argument("--insecure", action="store_true", default=None,
                   help="run an open cluster with no secret (anyone who can reach the port can join)")
    p.add_argument("--task", help="digits, textlm, or package.module:factory")
    p.add_argument("--data", dest="data_path", help="JSONL data file replacing the task's built-in data")
    if compression:
        p.add_argument("--compression", choices=["none", "fp16", "topk", "qsgd"])
        p.add_argument("--topk-ratio", type=float)
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", help="machine-readable JSON log lines")
    p.add_argument("--run-log", dest="run_log", metavar="PATH",
                   help="JSONL log of metrics and events for `swarmtrain plot` (default auto = "
                        "runs/<date-time>/<role>.jsonl; none = off)")


def _http_flags(p: argparse.ArgumentParser, *, dashboard: bool = True) -> None:
    pages = "Prometheus /metrics, /api/status (JSON)" + (" and a live dashboard at /" if dashboard else "")
    p.add_argument("--http-port", type=int,
                   help=f"serve {pages} on this port (read-only, no secret; default 0 = off)")
    p.add_argument("--http-host", help="address of the HTTP port (default 127.0.0.1; trusted networks only)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Train one PyTorch model across many unequal machines.")
    parser.add_argument("--version", action="version", version=f"swarmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("coordinator", help="hold the master weights and serve workers")
    _common(c)
    c.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    c.add_argument("--port", type=int, help="port to listen on (default 7100; 0 = any free port)")
    c.add_argument("--min-workers", type=int)
    c.add_argument("--max-steps", type=int, help="stop after this many applied updates (0 = never)")
    c.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float)
    c.add_argument("--eval-interval", dest="eval_interval_sec", type=float)
    c.add_argument("--checkpoint-dir")
    c.add_argument("--checkpoint-interval", type=int)
    c.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    c.add_argument("--port-file", help=argparse.SUPPRESS)
    c.add_argument("--summary-file", help="write the final status as JSON here on exit")
    c.add_argument("--status-file", help="keep the current status as JSON here (rewritten every second)")
    c.add_argument("--export", metavar="PATH",
                   help="write the final weights here as safetensors when the run ends (default auto = "
                        "model.safetensors next to the run log; none = off)")
    _http_flags(c)

    w = sub.add_parser("worker", help="compute gradients for a coordinator")
    _common(w)
    w.add_argument("--host", help="the coordinator's address")
    w.add_argument("--port", type=int, help="the coordinator's port (default 7100)")
    w.add_argument("--batch-size", type=int, help="0 = from the hardware profile")
    w.add_argument("--accumulation-steps", type=int, help="micro-batches per gradient (0 = auto)")
    w.add_argument("--message-compute-ms", type=float,
                   help="auto accumulation: ms of compute per gradient message (0 = off)")
    w.add_argument("--threads", dest="num_threads", type=int, help="0 = all cores")
    w.add_argument("--shard", dest="shard_index", type=int, help="-1 = assigned by the coordinator")
    w.add_argument("--worker-id")
    w.add_argument("--speed", type=float, help="run at this fraction of full speed (rehearse a slow box)")
    w.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"],
                   help="where to compute (default auto: CUDA, else MPS, else CPU)")
    w.add_argument("--reconnect-attempts", type=int)
    w.add_argument("--reconnect-delay", dest="reconnect_delay_sec", type=float)

    pe = sub.add_parser("peer", help="train with no coordinator: peers find each other and average")
    _common(pe, compression=False)
    pe.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    pe.add_argument("--port", type=int, help="control port (default 7200; 0 = any free port)")
    pe.add_argument("--run", help="run name: only peers of the same run are joined")
    pe.add_argument("--min-peers", type=int, help="peers (including this one) to wait for")
    pe.add_argument("--peers", help="static peer list host:port,... (when multicast is blocked)")
    pe.add_argument("--mode", choices=["diloco", "step"])
    pe.add_argument("--inner-steps", type=int, help="DiLoCo: inner steps per round")
    pe.add_argument("--inner-seconds", type=float, help="DiLoCo: inner loop length in seconds")
    pe.add_argument("--wire", choices=["fp32", "fp16", "int8"],
                    help="all-reduce wire format: peer mode's compression (default fp32)")
    pe.add_argument("--max-rounds", type=int)
    pe.add_argument("--batch-size", type=int)
    pe.add_argument("--threads", dest="num_threads", type=int,
                    help="torch threads (default 0 = the cores, shared out among the swarmtrain "
                         "peers on this machine)")
    pe.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float)
    pe.add_argument("--eval-every", type=int)
    pe.add_argument("--speed", type=float, help="run at this fraction of full speed")
    pe.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"],
                    help="where to compute (default auto: CUDA, else MPS, else CPU)")
    pe.add_argument("--status-file", help="keep this peer's status as JSON here")
    _http_flags(pe)

    d = sub.add_parser("demo", help="a small local cluster training a real model (digits)")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--task", default="digits")
    d.add_argument("--steps", type=int, default=0, help="updates to run (default: the task's demo length)")
    d.add_argument("--compression", default="none", choices=["none", "fp16", "topk", "qsgd"])
    d.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])

    k = sub.add_parser("ctl", help="control a running coordinator")
    k.add_argument("action", choices=["status", "pause", "resume", "checkpoint", "shutdown"])
    k.add_argument("--host", default="127.0.0.1")
    k.add_argument("--port", type=int, default=7100)
    k.add_argument("--secret-file")
    _tls_flags(k)
    k.add_argument("--json", action="store_true", help="print the raw status as JSON")
    k.add_argument("--status-file", help="status only: read it from this file (the coordinator's "
                   "--status-file) instead of asking the coordinator, and say when it is stale")

    s = sub.add_parser("secret", help="create a new random cluster secret file")
    s.add_argument("--out", required=True, help="file to write (mode 0600)")

    ky = sub.add_parser("keys", help="create a cluster CA and a TLS certificate for each node")
    ky.add_argument("--out", required=True, help="directory to write the keys to (created if missing)")
    ky.add_argument("--names", default="coordinator,worker1",
                    help="comma-separated node names, one certificate each (default: coordinator,worker1)")

    _pipeline_parsers(sub)

    _run_parsers(sub)

    pr = sub.add_parser("profile", help="show detected hardware and recommended settings")
    pr.add_argument("--task", default="digits")
    pr.add_argument("--probe-seconds", type=float, default=1.0)
    return parser


_ROUTE_HELP = ("the stage servers: HOST:PORT of each replica, ',' between replicas of one stage, "
               "';' between stages, e.g. \"10.0.0.2:7300;10.0.0.3:7300,10.0.0.4:7300;10.0.0.5:7300\"")


_CLUSTER_HELP = ("the pipeline's name, announced by its stages on the LAN (mDNS); the same on every stage "
                 "and trainer of one pipeline (default swarmtrain)")


def _discovery_flags(p: argparse.ArgumentParser) -> None:
    """--route is optional: without it, the stages of --cluster are found by mDNS."""
    p.add_argument("--route", default="", help=_ROUTE_HELP + "; without it, the stages of --cluster are "
                   "found on the LAN by mDNS (and the route found is logged)")
    p.add_argument("--cluster", default="swarmtrain", help=_CLUSTER_HELP)
    p.add_argument("--discover-timeout", type=_positive_float, default=10.0, metavar="SECONDS",
                   help="without --route: look for the stages this long at most (default 10)")


def _pipeline_common(p: argparse.ArgumentParser, *, model: bool = True) -> None:
    p.add_argument("--secret-file", help="file holding the cluster secret (or set SWARMTRAIN_SECRET)")
    _tls_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-json", action="store_true", help="machine-readable JSON log lines")
    if not model:
        return
    p.add_argument("--task", default="textlm", help="textlm (default), or package.module:factory")
    g = p.add_argument_group("model shape (textlm; every stage and client must give the same)")
    g.add_argument("--context", type=int, help="tokens the model sees at once (default 128)")
    g.add_argument("--d-model", type=int, help="width of the residual stream (default 128)")
    g.add_argument("--n-heads", type=int, help="attention heads (default 4)")
    g.add_argument("--n-layers", type=int, help="transformer blocks (default 4)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


#: `swarmtrain stage` flags that set StageServerConfig fields of the same names (None = its default)
_STAGE_LIMIT_KEYS = ("max_request_mb", "max_connections", "max_connections_per_address",
                     "max_failed_auth", "max_bad_in_row")


def _stage_limit_flags(st: argparse.ArgumentParser) -> None:
    g = st.add_argument_group("limits (against floods and misbehaving clients)")
    g.add_argument("--max-request-mb", type=_positive_float,
                   help="MiB one request of a trainer or generation client may carry (default 256); a "
                        "micro-batch x context x width x 4 bytes over it closes the connection")
    g.add_argument("--max-connections", type=_positive_int,
                   help="open connections at most, handshakes included (default 256)")
    g.add_argument("--max-connections-per-address", type=_positive_int,
                   help="open connections at most from one IP address (default 32)")
    g.add_argument("--max-failed-auth", type=_positive_int,
                   help="failed handshakes from one address within a minute before it is refused "
                        "for a minute (default 10)")
    g.add_argument("--max-bad-in-row", type=_positive_int,
                   help="close a connection whose requests were refused this many times in a row for "
                        "what they carried (default 5)")


def stage_server_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~swarmtrain.roles.stage.StageServerConfig` fields the `swarmtrain stage` limit
    flags set (flags not given are left out: the config's defaults hold)."""
    return {key: getattr(args, key) for key in _STAGE_LIMIT_KEYS if getattr(args, key) is not None}


def _pipeline_parsers(sub: Any) -> None:
    st = sub.add_parser(
        "stage", help="serve one stage of a pipeline (a range of the model's layers)",
        description="Serve layers of the model to `swarmtrain pipeline` and `swarmtrain generate` until "
                    "SIGINT/SIGTERM. Every stage computes its layer range from --stage/--stages alone, so "
                    "start every stage and replica with the same --task, --seed and model flags.")
    _pipeline_common(st)
    st.add_argument("--stage", type=int, required=True, help="index of the stage served (0 = the first)")
    st.add_argument("--stages", type=int, required=True, help="number of stages in the pipeline")
    st.add_argument("--seed", type=int, default=0, help="model initialisation seed (same on every stage)")
    st.add_argument("--layers", help="serve layers START:STOP instead of the planned range")
    st.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    st.add_argument("--port", type=int, default=7300, help="port to listen on (default 7300; 0 = any free)")
    st.add_argument("--sync-with", action="append", default=[], metavar="HOST:PORT",
                    help="a replica of the same stage to average parameters with (repeatable; "
                         "configure each pair on one side only)")
    st.add_argument("--sync-every", type=int, default=10,
                    help="optimizer steps between averages (default 10)")
    st.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=0.0,
                    help="AdamW learning rate (default: the task's)")
    st.add_argument("--threads", type=int, default=0, help="PyTorch threads (default 0 = all cores)")
    st.add_argument("--kv-cache-mb", type=float, default=256.0,
                    help="MiB of generation sessions' attention caches kept at most (default 256)")
    st.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"], default="auto",
                    help="where this stage's layers compute (default auto: CUDA, else MPS, else CPU)")
    st.add_argument("--status-file", default="", help="keep this stage's status as JSON here (every second)")
    g = st.add_argument_group("checkpoints (the stage's weights, optimizer state and step counters)")
    g.add_argument("--checkpoint-dir", default="", metavar="DIR",
                   help="where this stage's checkpoints go (default checkpoints/stage{I} in the working "
                        "directory; none = no checkpoints)")
    g.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="optimizer steps between checkpoints (default 10; 0 = only on SIGINT/SIGTERM)")
    g.add_argument("--keep-checkpoints", type=int, default=3, metavar="K",
                   help="newest checkpoints kept on disk (default 3)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest valid checkpoint in --checkpoint-dir (without it, a "
                        "directory that holds checkpoints is left alone)")
    _http_flags(st, dashboard=False)
    st.add_argument("--insecure", action="store_true",
                    help="serve with no secret on a reachable address "
                         "(anyone who can reach the port can use it)")
    _stage_limit_flags(st)
    g = st.add_argument_group("announcing (mDNS, so trainers find the stage without --route)")
    g.add_argument("--cluster", default="swarmtrain", help=_CLUSTER_HELP)
    g.add_argument("--no-announce", dest="announce", action="store_false",
                   help="do not announce this stage on the LAN (trainers then need --route)")

    pl = sub.add_parser(
        "pipeline", help="train a model whose layers are served by `swarmtrain stage` processes",
        description="Drive micro-batches through the stages of --route (or, without it, those of --cluster "
                    "found on the LAN) and back, failing over between replicas of a stage. Give the same "
                    "--task and model flags as the stages.")
    _pipeline_common(pl)
    _discovery_flags(pl)
    pl.add_argument("--microbatches", type=int, default=200, help="micro-batches to train (default 200)")
    pl.add_argument("--batch-size", type=int, default=16, help="samples per micro-batch (default 16)")
    pl.add_argument("--schedule", choices=("sync", "async"), default="sync",
                    help="sync (default): one optimizer step per --chunks micro-batches, all in flight at "
                         "once and flushed, so the run is one process's at a batch of chunks x "
                         "batch-size; async: --max-inflight micro-batches in flight, every stage "
                         "stepping per micro-batch on weights that moved since its forward")
    pl.add_argument("--chunks", type=int, default=8,
                    help="with --schedule sync: micro-batches per optimizer step (default 8)")
    pl.add_argument("--max-inflight", type=int, default=4,
                    help="with --schedule async: micro-batches in the pipeline at once (default 4)")
    pl.add_argument("--grad-clip", type=float, default=1.0,
                    help="with --schedule sync: clip the whole model's gradient norm to this before each "
                         "step, as one process does (default 1.0; 0 = no clipping)")
    pl.add_argument("--eval-every", type=int, default=50,
                    help="micro-batches between held-out evaluations (default 50; 0 = only at start and end; "
                         "with --schedule sync rounded up to whole groups of --chunks)")
    pl.add_argument("--eval-samples", type=int, default=64,
                    help="held-out windows per evaluation (default 64)")
    pl.add_argument("--seed", type=int, default=0, help="seed of the order training samples are drawn in")
    pl.add_argument("--request-timeout", type=float, default=30.0,
                    help="seconds a stage may take to answer before its replica is banned (default 30)")
    pl.add_argument("--stage-wait", type=float, default=300.0, metavar="SECONDS",
                    help="when no replica of a stage answers, wait this long for one to come back (restarted "
                         "with --resume, say) before giving up (default 300)")
    pl.add_argument("--status-file", default="",
                    help="keep the trainer's status (loss history, acknowledgements, resends) as JSON here")
    pl.add_argument("--run-log", default="auto", metavar="PATH",
                    help="JSONL log of losses and events for `swarmtrain plot` (default auto = "
                         "runs/<date-time>/pipeline.jsonl; none = off)")

    ge = sub.add_parser("generate", help="generate text through the stages of a pipeline",
                        description="Continue --prompt byte by byte through the stages of --route "
                                    "and print it.")
    _pipeline_common(ge)
    ge.add_argument("--route", required=True, help=_ROUTE_HELP)
    ge.add_argument("--prompt", required=True, help="the text to continue")
    ge.add_argument("--tokens", type=int, default=64, help="bytes to generate (default 64)")
    ge.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else sample")
    ge.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ge.add_argument("--no-cache", dest="cache", action="store_false",
                    help="rerun the whole window through every stage for each new byte instead of keeping "
                         "attention caches on the stages (same bytes, slower)")

    ss = sub.add_parser("status", help="show the stages of a pipeline: replicas, steps, buffers",
                        description="Ask every stage server of --route (or, without it, of --cluster found "
                                    "on the LAN) for its status and print a table; exits 1 if a replica "
                                    "does not answer.")
    _pipeline_common(ss, model=False)
    _discovery_flags(ss)
    ss.add_argument("--json", action="store_true", help="print the raw statuses as JSON")


def _run_parsers(sub: Any) -> None:
    pt = sub.add_parser("plot", help="PNG charts (loss, held-out metrics, throughput, bytes) of a run log",
                        description="Read a JSONL run log (runs/<date-time>/coordinator.jsonl, peer-*.jsonl "
                                    "or pipeline.jsonl) and write one PNG per chart that has data.")
    pt.add_argument("run_log", metavar="RUN.jsonl", help="the run log")
    pt.add_argument("--out", help="directory for the PNGs (default: the run log's directory)")

    ex = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file",
                        description="Export the model of the newest valid checkpoint in CHECKPOINT_DIR "
                                    "(or of one ckpt-* directory) for loading into the plain PyTorch "
                                    "model with safetensors.torch.load_file.")
    ex.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR",
                    help="the coordinator's --checkpoint-dir, or one ckpt-* directory in it")
    ex.add_argument("--out", default="model.safetensors", help="file to write (default model.safetensors)")


def cmd_plot(args: argparse.Namespace) -> int:
    from swarmtrain.app.plotting import plot_run_log

    for path in plot_run_log(args.run_log, args.out):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from swarmtrain.app.export import export_checkpoint

    path, ckpt = export_checkpoint(args.checkpoint_dir, args.out)
    print(f"wrote the model of {ckpt.path} (version {ckpt.step}) to {path}")
    return 0


def _overrides(args: argparse.Namespace, table: dict[str, str]) -> dict[str, Any]:
    return {dotted: getattr(args, attr) for attr, dotted in table.items()
            if getattr(args, attr, None) is not None}


_SHARED = {
    "task": "training.task", "data_path": "data.path", "compression": "compression.type",
    "topk_ratio": "compression.topk_ratio", "secret_file": "security.secret_file",
    "insecure": "security.insecure", "log_level": "logging.level",
    "tls_cert": "security.tls_cert", "tls_key": "security.tls_key", "tls_ca": "security.tls_ca",
    "run_log": "logging.run_log",
}
_COORD = {
    **_SHARED, "host": "network.host", "port": "network.port", "min_workers": "training.min_workers",
    "max_steps": "training.max_steps", "learning_rate": "training.learning_rate",
    "eval_interval_sec": "training.eval_interval_sec", "checkpoint_dir": "checkpointing.directory",
    "checkpoint_interval": "checkpointing.interval", "export": "checkpointing.export",
    "http_port": "ops.http_port", "http_host": "ops.http_host",
}
_WORKER = {
    **_SHARED, "host": "network.coordinator_host", "port": "network.coordinator_port",
    "batch_size": "training.batch_size", "accumulation_steps": "training.accumulation_steps",
    "message_compute_ms": "training.message_compute_ms",
    "num_threads": "hardware.num_threads", "shard_index": "data.shard_index",
    "worker_id": "training.worker_id", "speed": "training.speed", "device": "training.device",
    "reconnect_attempts": "network.reconnect_attempts", "reconnect_delay_sec": "network.reconnect_delay_sec",
}


def cmd_coordinator(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_coordinator
    from swarmtrain.config import load_coordinator_config

    cfg = load_coordinator_config(args.config, _overrides(args, _COORD))
    _setup_logging(cfg.logging.level, args.log_json)
    return run_coordinator(cfg, resume=args.resume, port_file=args.port_file,
                           summary_file=args.summary_file, status_file=args.status_file)


def cmd_worker(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_worker
    from swarmtrain.config import load_worker_config

    cfg = load_worker_config(args.config, _overrides(args, _WORKER))
    _setup_logging(cfg.logging.level, args.log_json)
    return run_worker(cfg)


_PEER = {
    "task": "training.task", "data_path": "data.path", "secret_file": "security.secret_file",
    "tls_cert": "security.tls_cert", "tls_key": "security.tls_key", "tls_ca": "security.tls_ca",
    "insecure": "security.insecure", "log_level": "logging.level", "host": "network.host",
    "port": "network.port", "run": "peer.run", "min_peers": "peer.min_peers", "peers": "peer.peers",
    "mode": "training.mode", "inner_steps": "training.inner_steps",
    "inner_seconds": "training.inner_seconds", "wire": "training.wire",
    "max_rounds": "training.max_rounds", "batch_size": "training.batch_size",
    "num_threads": "hardware.num_threads", "learning_rate": "training.learning_rate",
    "eval_every": "training.eval_every", "speed": "training.speed", "run_log": "logging.run_log",
    "http_port": "ops.http_port", "http_host": "ops.http_host", "device": "training.device",
}


def cmd_peer(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_peer
    from swarmtrain.config import load_peer_config

    cfg = load_peer_config(args.config, _overrides(args, _PEER))
    _setup_logging(cfg.logging.level, args.log_json)
    return run_peer(cfg, status_file=args.status_file)


def cmd_ctl(args: argparse.Namespace) -> int:
    from swarmtrain.app.ui import print_status
    from swarmtrain.roles.ps.ctl import ctl_request

    if args.status_file:
        return _ctl_status_file(args)
    reply = asyncio.run(ctl_request(args.host, args.port, args.action, secret=_cli_secret(args),
                                    tls=_cli_tls(args)))
    data = {k: v for k, v in reply.fields().items()}
    if args.json:
        print(json.dumps(data, default=str, indent=2))
    elif "status" in data:
        print_status(data["status"])
    else:
        print(data)
    return 0 if data.get("ok", True) else 1


def _ctl_status_file(args: argparse.Namespace) -> int:
    """``ctl status --status-file F``: the status a coordinator last wrote, marked stale when
    its writer has stopped (exit 1 then)."""
    from swarmtrain.app.ui import print_status, stale_note

    if args.action != "status":
        raise SwarmError(f"--status-file only reads a status; 'ctl {args.action}' must reach the "
                         "coordinator (drop --status-file)")
    try:
        status = json.loads(Path(args.status_file).read_text())
    except (OSError, ValueError) as exc:
        raise SwarmError(f"cannot read the status file {args.status_file}: {exc}; is it the "
                         "coordinator's --status-file?") from None
    now = time.time()
    stale = stale_note(status, now)
    if args.json:
        print(json.dumps({"status": status, "stale": stale}, default=str, indent=2))
    else:
        print_status(status, now=now)
    return 1 if stale else 0


def cmd_secret(args: argparse.Namespace) -> int:
    path = Path(args.out)
    if path.exists():
        raise SwarmError(f"{path} exists already; remove it first or choose another --out")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    print(f"wrote a new cluster secret to {path} (mode 0600); copy it to every machine and pass "
          f"--secret-file {path}")
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from swarmtrain.transport.tls import generate_cluster_keys

    names = [n.strip() for n in args.names.split(",") if n.strip()]
    keys = generate_cluster_keys(args.out, names)
    print(f"wrote the cluster CA {keys.ca} and its key {keys.ca_key} (mode 0600; keep the CA key "
          "off the nodes, it is needed only to add nodes later)")
    for name, (cert, key) in keys.nodes.items():
        print(f"  {name}: certificate {cert}, key {key} (mode 0600)")
    print(f"CA fingerprint (SHA-256): {keys.fingerprint}")
    print("copy to each node its NAME.pem, NAME-key.pem and ca.pem, then add to its config:")
    for name in keys.nodes:
        print(f"\n# {name}\n[security]\ntls_cert = \"{name}.pem\"\ntls_key = \"{name}-key.pem\"\n"
              'tls_ca = "ca.pem"')
    print("\n(or pass --tls-cert, --tls-key and --tls-ca; the cluster secret is still needed)")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from swarmtrain.app.ui import print_profile

    print_profile(args.task, args.probe_seconds)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from swarmtrain.app.demo import run_demo

    return run_demo(workers=args.workers, task=args.task, steps=args.steps,
                    compression=args.compression, log_level=args.log_level)


def _cli_tls(args: argparse.Namespace) -> TLSConfig | None:
    from swarmtrain.config import SecurityConfig, resolve_tls

    return resolve_tls(SecurityConfig(tls_cert=args.tls_cert or "", tls_key=args.tls_key or "",
                                      tls_ca=args.tls_ca or ""))


def _cli_secret(args: argparse.Namespace) -> bytes | None:
    """The secret of a command that takes only --secret-file (or SWARMTRAIN_SECRET)."""
    from swarmtrain.config import SecurityConfig, resolve_secret

    return resolve_secret(SecurityConfig(secret_file=args.secret_file or ""))


def _pipeline_task(args: argparse.Namespace) -> Any:
    from swarmtrain.app.pipeline_session import load_pipeline_task

    return load_pipeline_task(args.task, context=args.context, d_model=args.d_model,
                              n_heads=args.n_heads, n_layers=args.n_layers)


def cmd_stage(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import StageOptions, parse_layer_range, run_stage
    from swarmtrain.roles.stage.route import parse_host_port

    _setup_logging(args.log_level, args.log_json)
    opts = StageOptions(
        stage=args.stage, stages=args.stages, seed=args.seed, host=args.host, port=args.port,
        layers=parse_layer_range(args.layers) if args.layers else None,
        sync_with=tuple(parse_host_port(a, "--sync-with") for a in args.sync_with),
        sync_every=args.sync_every,
        learning_rate=args.learning_rate, kv_cache_mb=args.kv_cache_mb, threads=args.threads,
        status_file=args.status_file,
        http_port=args.http_port or 0, http_host=args.http_host or "127.0.0.1",
        server_limits=stage_server_settings(args), device=args.device,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, cluster=args.cluster,
        announce=args.announce)
    return run_stage(_pipeline_task(args), opts, secret=_cli_secret(args), insecure=args.insecure,
                     tls=_cli_tls(args))


def cmd_pipeline(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import PipelineOptions, run_pipeline
    from swarmtrain.roles.stage.route import parse_route

    _setup_logging(args.log_level, args.log_json)
    opts = PipelineOptions(
        microbatches=args.microbatches, batch_size=args.batch_size, schedule=args.schedule,
        chunks=args.chunks, max_inflight=args.max_inflight, grad_clip=args.grad_clip,
        eval_every=args.eval_every, eval_samples=args.eval_samples, seed=args.seed,
        request_timeout=args.request_timeout, stage_wait=args.stage_wait,
        status_file=args.status_file, route=parse_route(args.route) if args.route else [],
        run_log=args.run_log, cluster=args.cluster, discover_timeout=args.discover_timeout)
    return run_pipeline(_pipeline_task(args), opts, secret=_cli_secret(args), tls=_cli_tls(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import run_generate
    from swarmtrain.roles.stage.route import parse_route

    _setup_logging(args.log_level, args.log_json)
    return run_generate(_pipeline_task(args), parse_route(args.route), args.prompt, tokens=args.tokens,
                        temperature=args.temperature, seed=args.seed, secret=_cli_secret(args),
                        tls=_cli_tls(args), cache=args.cache)


def cmd_status(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import run_status
    from swarmtrain.roles.stage.route import parse_route

    _setup_logging(args.log_level, args.log_json)
    return run_status(parse_route(args.route) if args.route else [], secret=_cli_secret(args),
                      tls=_cli_tls(args), as_json=args.json, cluster=args.cluster,
                      discover_timeout=args.discover_timeout)


_COMMANDS = {
    "stage": cmd_stage, "pipeline": cmd_pipeline, "generate": cmd_generate, "status": cmd_status,
    "coordinator": cmd_coordinator, "worker": cmd_worker, "ctl": cmd_ctl, "secret": cmd_secret,
    "keys": cmd_keys, "profile": cmd_profile, "demo": cmd_demo, "peer": cmd_peer,
    "plot": cmd_plot, "export": cmd_export,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hardware.tune_allocator()  # every role allocates and frees tensor-sized temporaries each step
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SwarmError as exc:
        print(f"swarmtrain {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The `swarmtrain` command line.

The flags of the modes (``coordinator``, ``worker``, ``peer``, ``stage``, ``pipeline``) are
generated from their config (:data:`swarmtrain.config.MODES`): every key has one flag, with the
key's help, default, choices and bounds (:func:`add_config_flags`); a flag given on the command
line overrides the config file and the environment (:func:`config_overrides`). Only what is not
config is declared here by hand: --config, --log-json, one-shot actions (--resume) and files a
run writes (--status-file).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmtrain import __version__
from swarmtrain.config import (
    MODES,
    ClientSecurityConfig,
    CoordinatorConfig,
    FieldInfo,
    ModelConfig,
    PipelineConfig,
    field_infos,
    resolve_secret,
    resolve_tls,
    section_values,
)
from swarmtrain.core import hardware
from swarmtrain.errors import ConfigError, SwarmError

if TYPE_CHECKING:
    from swarmtrain.transport.tls import TLSConfig

__all__ = ["add_config_flags", "build_parser", "config_flag_keys", "config_overrides", "main"]

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


class _ConfigFlag(argparse.Action):
    """Stores a config key's value and notes that the flag was given: only given flags
    override the config file and the environment (the namespace's other values are the
    keys' defaults, for reading and for ``--help``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given: set[str] = set(getattr(namespace, _GIVEN, ()))
        if self.nargs == 0:
            values = self.const
        elif isinstance(self.default, tuple):  # a list key: the flag is repeatable
            values = (*(getattr(namespace, self.dest) if self.dest in given else ()), values)
        setattr(namespace, self.dest, values)
        setattr(namespace, _GIVEN, given | {self.dest})


#: namespace attributes: the config flags given, and each config flag's dest -> dotted key
_GIVEN, _FLAG_KEYS = "_config_flags_given", "_config_flag_keys"


def _flag_type(info: FieldInfo) -> Callable[[str], Any]:
    """The argparse ``type`` of a key's flag: parses the text and checks the value against the
    key's bounds and choices, so a bad value is refused with the key's own message."""
    base = str if info.type == tuple[str, ...] else info.type

    def parse(text: str) -> Any:
        try:
            value = base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}") from None
        if base is not info.type:  # one element of a list
            return value
        try:
            return info.check(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = base.__name__  # argparse names it in "invalid int value"
    return parse


_METAVARS: dict[Any, str] = {int: "N", float: "X"}


def _flag_help(info: FieldInfo) -> str:
    where = f"[{info.section}] {info.key}"
    if info.type is bool:
        text = f"do not {info.help}" if info.default else info.help
        return f"{text} ({where})".replace("%", "%%")
    default = "none" if info.default in ("", ()) else info.default
    state = "required" if info.required else f"default {default}"
    more = "; repeatable" if info.type == tuple[str, ...] else ""
    return f"{info.help} ({where}, {state}{more})".replace("%", "%%")


def add_config_flags(p: argparse.ArgumentParser, cls: type, *, sections: Sequence[str] | None = None,
                     keys: Sequence[str] | None = None, required: Mapping[str, str] | None = None) -> None:
    """One flag for every key of the config class ``cls`` (a value of
    :data:`swarmtrain.config.MODES`) that has one, grouped by section; ``sections`` or ``keys``
    (dotted) choose some only, and the flags of the dotted keys in ``required`` must be given
    (each with the help it maps to, for a command where the key's default means nothing).
    Each flag's value is checked as its key's, and its default is the key's default."""
    required = required or {}
    flag_keys = config_flag_keys(p)
    taken = {a.dest for a in p._actions} | set(flag_keys)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for info in field_infos(cls, sections):
        if not info.cli or (keys is not None and info.dotted not in keys):
            continue
        dest = info.key if info.key not in taken else f"{info.section}_{info.key}"
        taken.add(dest)
        flag_keys[dest] = info.dotted
        if info.section not in groups:
            doc = " ".join((info.section_cls.__doc__ or "").split("\n\n")[0].split()).replace("``", "")
            about = doc.split(": ", 1)[1] if doc.startswith("[") and ": " in doc else doc
            groups[info.section] = p.add_argument_group(f"[{info.section}]", about)
        kwargs: dict[str, Any] = {"dest": dest, "default": info.default, "action": _ConfigFlag,
                                  "help": required.get(info.dotted) or _flag_help(info),
                                  "required": info.dotted in required}
        if info.type is bool:
            kwargs.update(nargs=0, const=not info.default)
        else:
            listed = info.choices is not None and not info.open_choices  # argparse checks them
            shown = f"{{{','.join(map(str, info.choices or ()))},...}}" if info.open_choices else None
            kwargs.update(type=_flag_type(info), choices=info.choices if listed else None,
                          metavar=None if listed else shown or info.metavar or _METAVARS.get(
                              info.type, info.key.upper()))
        groups[info.section].add_argument(*info.flags, **kwargs)
    p.set_defaults(**{_FLAG_KEYS: flag_keys})


def config_flag_keys(p: argparse.ArgumentParser) -> dict[str, str]:
    """The config flags :func:`add_config_flags` gave ``p``: each one's dest -> dotted key."""
    return dict(p.get_default(_FLAG_KEYS) or {})


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dotted config keys the config flags given on the command line set."""
    keys: dict[str, str] = getattr(args, _FLAG_KEYS, {})
    return {keys[dest]: getattr(args, dest) for dest in getattr(args, _GIVEN, ()) if dest in keys}


def _flag_section(args: argparse.Namespace, section_cls: type, section: str) -> Any:
    """A section built from its flags' values alone (defaults where not given), for the
    commands that are not a mode with a config file (``ctl``, ``generate``, ``status``)."""
    keys: dict[str, str] = getattr(args, _FLAG_KEYS, {})
    return section_cls(**{dotted.partition(".")[2]: getattr(args, dest) for dest, dotted in keys.items()
                          if dotted.partition(".")[0] == section})


def _choices(cls: type, dotted: str) -> tuple[Any, ...]:
    """The allowed values of a key, for a flag of a command that is not a mode (``demo``)."""
    section, _, key = dotted.partition(".")
    return next(i.choices or () for i in field_infos(cls, [section]) if i.key == key)


def _mode_parser(sub: Any, mode: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of a mode's command: --config, --log-json and a flag for every config key."""
    p: argparse.ArgumentParser = sub.add_parser(mode, **kwargs)
    p.add_argument("--config", help="TOML config file (SWARMTRAIN_<SECTION>__<KEY> environment variables "
                                    "override it, and flags override both; see docs/config.md)")
    p.add_argument("--log-json", action="store_true", help="machine-readable JSON log lines")
    add_config_flags(p, MODES[mode])
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmtrain", description="Train one PyTorch model across many unequal machines.")
    parser.add_argument("--version", action="version", version=f"swarmtrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    c = _mode_parser(sub, "coordinator", help="hold the master weights and serve workers")
    c.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint")
    c.add_argument("--port-file", help=argparse.SUPPRESS)
    c.add_argument("--summary-file", help="write the final status as JSON here on exit")
    c.add_argument("--status-file", help="keep the current status as JSON here (rewritten every second)")

    _mode_parser(sub, "worker", help="compute gradients for a coordinator")

    pe = _mode_parser(sub, "peer", help="train with no coordinator: peers find each other and average")
    pe.add_argument("--status-file", help="keep this peer's status as JSON here")

    d = sub.add_parser("demo", help="a small local cluster training a real model (digits)")
    d.add_argument("--workers", type=int, default=2)
    d.add_argument("--task", default="digits")
    d.add_argument("--steps", type=int, default=0, help="updates to run (default: the task's demo length)")
    d.add_argument("--compression", default="none", choices=_choices(CoordinatorConfig, "compression.type"))
    d.add_argument("--lr-schedule", default="cosine",
                   choices=_choices(CoordinatorConfig, "training.lr_schedule"),
                   help="the coordinator's learning rate over the run (default: warm-up over the first "
                   "5%%, then cosine to 0.1x by the last update)")
    d.add_argument("--log-level", default="warning", choices=_choices(CoordinatorConfig, "logging.level"))

    k = sub.add_parser("ctl", help="control a running coordinator")
    k.add_argument("action", choices=["status", "pause", "resume", "checkpoint", "shutdown"])
    k.add_argument("--host", default="127.0.0.1")
    k.add_argument("--port", type=int, default=7100)
    add_config_flags(k, PipelineConfig, sections=["security"])
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


def _pipeline_parsers(sub: Any) -> None:
    st = _mode_parser(
        sub, "stage", help="serve one stage of a pipeline (a range of the model's layers)",
        description="Serve layers of the model to `swarmtrain pipeline` and `swarmtrain generate` until "
                    "SIGINT/SIGTERM. Every stage computes its layer range from --stage/--stages alone, so "
                    "start every stage and replica with the same --task, --seed and model flags.")
    st.add_argument("--resume", action="store_true",
                    help="continue from the newest valid checkpoint in --checkpoint-dir (without it, a "
                         "directory that holds checkpoints is left alone)")

    _mode_parser(
        sub, "pipeline", help="train a model whose layers are served by `swarmtrain stage` processes",
        description="Drive micro-batches through the stages of --route (or, without it, those of --cluster "
                    "found on the LAN) and back, failing over between replicas of a stage. Give the same "
                    "--task and model flags as the stages.")

    ge = sub.add_parser("generate", help="generate text through the stages of a pipeline",
                        description="Continue --prompt byte by byte through the stages of --route "
                                    "and print it.")
    ge.add_argument("--log-json", action="store_true", help="machine-readable JSON log lines")
    add_config_flags(ge, PipelineConfig, sections=["model", "security", "logging", "pipeline"],
                     keys=[*_MODEL_KEYS, *_CLIENT_KEYS, "pipeline.route"],
                     required={"pipeline.route": _ROUTE_HELP})
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
    ss.add_argument("--log-json", action="store_true", help="machine-readable JSON log lines")
    add_config_flags(ss, PipelineConfig, sections=["security", "logging", "pipeline"],
                     keys=[*_CLIENT_KEYS, "pipeline.route", "pipeline.cluster", "pipeline.discover_timeout"])
    ss.add_argument("--json", action="store_true", help="print the raw statuses as JSON")


_ROUTE_HELP = ("the stage servers: HOST:PORT of each replica, ',' between replicas of one stage, "
               "';' between stages, e.g. \"10.0.0.2:7300;10.0.0.3:7300,10.0.0.4:7300;10.0.0.5:7300\"")

#: the keys of the pipeline commands that are not modes (`generate`, `status`)
_MODEL_KEYS = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig))
_CLIENT_KEYS = (*(f"security.{f.name}" for f in dataclasses.fields(ClientSecurityConfig)), "logging.level")


def _run_parsers(sub: Any) -> None:
    pt = sub.add_parser("plot", help="PNG charts (loss, held-out metrics, throughput, bytes) of a run log",
                        description="Read a JSONL run log (runs/<date-time>/coordinator.jsonl, peer-*.jsonl "
                                    "or pipeline.jsonl) and write one PNG per chart that has data.")
    pt.add_argument("run_log", metavar="RUN.jsonl", help="the run log")
    pt.add_argument("--out", help="directory for the PNGs (default: the run log's directory)")

    ex = sub.add_parser("export", help="write a checkpoint's model weights as one safetensors file",
                        description="Export the model of the newest valid checkpoint in CHECKPOINT_DIR "
                                    "(or of one ckpt-* directory) for loading into the plain PyTorch "
                                    "model with safetensors.torch.load_file. For a sharded cluster "
                                    "(--shard i/S), give every parameter server's checkpoint directory "
                                    "or exported model file, in any order: the slices are checked and "
                                    "put back together into one file of the whole model.")
    ex.add_argument("sources", nargs="+", metavar="CHECKPOINT_DIR",
                    help="the coordinator's --checkpoint-dir, one ckpt-* directory in it, or a "
                         "model file swarmtrain exported; one per parameter server of a sharded cluster")
    ex.add_argument("--out", default="model.safetensors", help="file to write (default model.safetensors)")


def cmd_plot(args: argparse.Namespace) -> int:
    from swarmtrain.app.plotting import plot_run_log

    for path in plot_run_log(args.run_log, args.out):
        print(path)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from swarmtrain.app.export import merge_exports

    path, slices = merge_exports(args.sources, args.out)
    if len(slices) == 1:
        print(f"wrote the model of {slices[0].source} (version {slices[0].version}) to {path}")
    else:
        versions = ", ".join(str(s.version) for s in slices)
        print(f"wrote the whole model of {len(slices)} parameter servers (versions {versions}) to {path}")
    return 0


def cmd_coordinator(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_coordinator
    from swarmtrain.config import load_coordinator_config

    cfg = load_coordinator_config(args.config, config_overrides(args))
    _setup_logging(cfg.logging.level, args.log_json)
    return run_coordinator(cfg, resume=args.resume, port_file=args.port_file,
                           summary_file=args.summary_file, status_file=args.status_file)


def cmd_worker(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_worker
    from swarmtrain.config import load_worker_config

    cfg = load_worker_config(args.config, config_overrides(args))
    _setup_logging(cfg.logging.level, args.log_json)
    return run_worker(cfg)


def cmd_peer(args: argparse.Namespace) -> int:
    from swarmtrain.app.session import run_peer
    from swarmtrain.config import load_peer_config

    cfg = load_peer_config(args.config, config_overrides(args))
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
                    compression=args.compression, lr_schedule=args.lr_schedule, log_level=args.log_level)


def _cli_security(args: argparse.Namespace) -> ClientSecurityConfig:
    """The [security] flags of a command that is not a mode (``ctl``, ``generate``, ``status``)."""
    section: ClientSecurityConfig = _flag_section(args, ClientSecurityConfig, "security")
    return section


def _cli_tls(args: argparse.Namespace) -> TLSConfig | None:
    return resolve_tls(_cli_security(args))


def _cli_secret(args: argparse.Namespace) -> bytes | None:
    """The secret of a command that takes only --secret-file (or SWARMTRAIN_SECRET)."""
    return resolve_secret(_cli_security(args))


def _pipeline_task(model: ModelConfig) -> Any:
    from swarmtrain.app.pipeline_session import load_pipeline_task

    return load_pipeline_task(model.task, **model.shape())


def cmd_stage(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import StageOptions, run_stage
    from swarmtrain.config import load_stage_config

    cfg = load_stage_config(args.config, config_overrides(args))
    _setup_logging(cfg.logging.level, args.log_json)
    opts = StageOptions(**section_values(cfg.stage), resume=args.resume)
    return run_stage(_pipeline_task(cfg.model), opts, secret=resolve_secret(cfg.security),
                     insecure=cfg.security.insecure, tls=resolve_tls(cfg.security), ops=cfg.ops)


def cmd_pipeline(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import PipelineOptions, run_pipeline
    from swarmtrain.config import load_pipeline_config

    cfg = load_pipeline_config(args.config, config_overrides(args))
    _setup_logging(cfg.logging.level, args.log_json)
    opts = PipelineOptions(**section_values(cfg.pipeline), run_log=cfg.logging.run_log)
    return run_pipeline(_pipeline_task(cfg.model), opts, secret=resolve_secret(cfg.security),
                        tls=resolve_tls(cfg.security))


def cmd_generate(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import run_generate
    from swarmtrain.roles.stage.route import parse_route

    _setup_logging(args.level, args.log_json)
    model: ModelConfig = _flag_section(args, ModelConfig, "model")
    return run_generate(_pipeline_task(model), parse_route(args.route), args.prompt, tokens=args.tokens,
                        temperature=args.temperature, seed=args.seed, secret=_cli_secret(args),
                        tls=_cli_tls(args), cache=args.cache)


def cmd_status(args: argparse.Namespace) -> int:
    from swarmtrain.app.pipeline_session import run_status
    from swarmtrain.roles.stage.route import parse_route

    _setup_logging(args.level, args.log_json)
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

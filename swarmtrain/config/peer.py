"""Peer mode's config: ``swarmtrain peer``."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmtrain.config.schema import _opt, _Section
from swarmtrain.config.sections import (
    DataConfig,
    HardwareConfig,
    LoggingConfig,
    LRScheduleConfig,
    OpsConfig,
    SecurityConfig,
    ServerLimitsConfig,
)

__all__ = ["PeerConfig", "PeerDataConfig", "PeerDiscoveryConfig", "PeerNetworkConfig", "PeerTrainingConfig"]


@dataclass(frozen=True)
class PeerNetworkConfig(ServerLimitsConfig):
    """[network] of a peer: where it listens, the time limits of each phase, and what its control
    server and its ring listener admit."""

    SECTION = "network"
    LESS_THAN = (("heartbeat_interval_sec", "heartbeat_timeout_sec"),)
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(7200, "control port (membership, status); 0 = any free port", ge=0, le=65535)
    ring_port: int = _opt(0, "port of the all-reduce ring listener (0 = any free port)", ge=0, le=65535)
    advertise_host: str = _opt("", 'address others reach this peer at ("" = found automatically)')
    heartbeat_interval_sec: float = _opt(0.5, "seconds between heartbeats to each member", gt=0.0)
    heartbeat_timeout_sec: float = _opt(5.0, "a member silent this long is dead", gt=0.0)
    propose_timeout_sec: float = _opt(3.0, "how long a proposer waits for each answer", gt=0.0)
    ring_timeout_sec: float = _opt(
        120.0, "longest wait for a ring neighbour's data (slow peers arrive late)", gt=0.0)
    reform_timeout_sec: float = _opt(60.0, "longest wait for a new epoch after a failure", gt=0.0)


@dataclass(frozen=True)
class PeerDiscoveryConfig(_Section):
    """[peer]: which run to join and how to find its other peers."""

    SECTION = "peer"
    run: str = _opt("default", "run name: only peers with the same name are joined")
    min_peers: int = _opt(1, "peers (including this one) to wait for before the first round", ge=1)
    discovery_timeout_sec: float = _opt(300.0, "longest wait for min_peers", gt=0.0)
    peers: str = _opt("", 'static list "host:port,host:port" for networks without multicast')
    quorum: str = _opt("majority", "majority: a peer cut off from most of its group pauses instead of "
                       "training a copy that diverges; none: every group trains, the larger "
                       "working group's state wins the merge", choices=("majority", "none"))
    probe_interval_sec: float = _opt(1.0, "how often a known peer outside the group is asked "
                                     "whether it is back (backing off to 4x while it is not)", gt=0.0)


@dataclass(frozen=True)
class PeerTrainingConfig(LRScheduleConfig):
    """[training] of a peer: per-step averaging or DiLoCo."""

    SECTION = "training"
    RUN_LENGTH = "max_rounds"
    task: str = _opt("textlm", "'digits', 'textlm' or 'package.module:factory'")
    mode: str = _opt("diloco", "'diloco' (H local steps, then average) or 'step' (every step)",
                     choices=("diloco", "step"))
    learning_rate: float = _opt(0.0, "inner AdamW learning rate (0 = the task's default)",
                                flag=("--lr", "--learning-rate"), ge=0.0)
    weight_decay: float = _opt(0.0, "inner AdamW weight decay", ge=0.0)
    batch_size: int = _opt(0, "samples per step (0 = from the hardware profile)", ge=0)
    inner_steps: int = _opt(50, "DiLoCo: inner steps per round (H)", ge=1)
    inner_seconds: float = _opt(
        0.0, "DiLoCo: if > 0, each round's inner loop runs this long instead of inner_steps", ge=0.0)
    outer_lr: float = _opt(0.7, "DiLoCo outer Nesterov learning rate", gt=0.0)
    outer_momentum: float = _opt(0.9, "DiLoCo outer Nesterov momentum", ge=0.0, lt=1.0)
    wire: str = _opt("fp32", "all-reduce wire format: peer mode's compression",
                     choices=("fp32", "fp16", "int8"))
    robust: str = _opt(
        "none", "how the members' contributions of a round are combined so that no single peer "
        "steers the model (docs/robustness.md): 'none' = weighted mean by all-reduce; 'clip', "
        "'trimmed_mean' or 'median' = every contribution is gathered (fp32, world_size x the "
        "all-reduce's bytes) and every member computes the same robust combination, one vote "
        "per member", choices=("none", "clip", "trimmed_mean", "median"))
    robust_trim: float = _opt(
        0.2, "with robust = 'trimmed_mean': fraction of the members cut at each end of every "
        "coordinate (at least one from 3 members on)", ge=0.0, lt=0.5)
    max_rounds: int = _opt(0, "stop after this many rounds (0 = run until stopped)", ge=0)
    eval_every: int = _opt(10, "rounds between held-out evaluations (by rank 0)", ge=1)
    speed: float = _opt(1.0, "fraction of full speed (throttle to rehearse a slow machine)",
                        gt=0.0, le=1.0)
    seed: int = _opt(0, "seed of the model initialisation (the same on every peer)", ge=0)
    device: str = _opt("auto", "where to compute: 'auto' (CUDA, else MPS, else CPU), 'cpu', "
                       "'cuda' or 'mps'", choices=("auto", "cpu", "cuda", "mps"))


@dataclass(frozen=True)
class PeerDataConfig(DataConfig):
    """[data] of a peer (every peer samples the whole data set, in its own order: no shards)."""



@dataclass(frozen=True)
class PeerConfig:
    """Everything ``swarmtrain peer`` is configured with."""

    network: PeerNetworkConfig = field(default_factory=PeerNetworkConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    peer: PeerDiscoveryConfig = field(default_factory=PeerDiscoveryConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    training: PeerTrainingConfig = field(default_factory=PeerTrainingConfig)
    data: PeerDataConfig = field(default_factory=PeerDataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)

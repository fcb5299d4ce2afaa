"""benchmarks/_util.py's TOML writer: the benchmarks write the config files of the processes they
start with it, so what it writes must be TOML that the config loader reads back as given."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from swarmtrain.config import load_coordinator_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _util import compression_toml, toml_section


def test_a_section_reads_back_with_strings_numbers_and_booleans_as_given() -> None:
    keys = {"type": "topk", "topk_ratio": 0.1, "warmup_steps": 30, "tiny": 1e-05, "flag": False}
    assert tomllib.loads(compression_toml(keys)) == {"compression": keys}
    assert tomllib.loads(toml_section("training", {"staleness_damping": True})) == {
        "training": {"staleness_damping": True}}


def test_the_coordinator_loads_what_a_benchmark_writes(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.toml"
    path.write_text(toml_section("training", {"aggregate_samples": 16, "staleness_damping": False,
                                              "max_staleness": 64})
                    + compression_toml({"type": "topk", "topk_ratio": 0.1, "downlink_bits": 2}))
    cfg = load_coordinator_config(path)
    assert (cfg.training.aggregate_samples, cfg.training.staleness_damping, cfg.training.max_staleness) == (
        16, False, 64)
    compression = cfg.compression
    assert (compression.type, compression.topk_ratio, compression.downlink_bits) == ("topk", 0.1, 2)

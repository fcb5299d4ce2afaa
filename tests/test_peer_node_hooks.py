"""`PeerTrainer`'s public hooks for the session that runs it (pure, no network): an event goes
to the trainer's events and to its run log; the status file is written whole, and writing it
without one is refused with a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarmtrain.errors import SwarmError
from swarmtrain.roles.peer.backend import PeerBackend
from swarmtrain.roles.peer.node import PeerTrainer

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def event(self, event: str, **data: Any) -> None:
        self.events.append((event, data))

    def metrics(self, *, force: bool = False, **data: Any) -> bool:
        return False


def test_record_event_reaches_the_events_and_the_run_log() -> None:
    log = Recorder()
    trainer = PeerTrainer(PeerBackend(), strategy=None, run_log=log)  # type: ignore[arg-type]
    trainer.record_event("started", run="r", peer="p")
    assert [(e["event"], e["run"], e["peer"]) for e in trainer.events] == [("started", "r", "p")]
    assert isinstance(trainer.events[0]["time"], float)
    assert log.events == [("started", {"run": "r", "peer": "p"})]


def test_write_status_writes_the_whole_status_and_needs_a_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = PeerTrainer(PeerBackend(), strategy=None)  # type: ignore[arg-type]
    with pytest.raises(SwarmError, match="needs a status_file"):
        trainer.write_status()
    monkeypatch.setattr(trainer, "status", lambda: {"round": 3, "loss": 1.5})
    trainer.status_file = str(tmp_path / "peer.json")
    trainer.write_status()
    assert json.loads((tmp_path / "peer.json").read_text()) == {"round": 3, "loss": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["peer.json"]  # nothing left aside

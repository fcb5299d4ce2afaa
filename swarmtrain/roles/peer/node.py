"""`PeerTrainer`: the round loop of peer mode (see :mod:`swarmtrain.roles.peer.training`) on top
of a :class:`~swarmtrain.roles.peer.backend.PeerBackend` — what `swarmtrain peer` runs."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from swarmtrain.core.events import RunRecorder
from swarmtrain.errors import SwarmError, SwarmTimeout
from swarmtrain.fsutil import write_atomic
from swarmtrain.roles.aggregation import ROBUST_MODES, MemberScores, capped_total, robust_combine
from swarmtrain.roles.peer.backend import NonFiniteResult, PeerBackend, load_state_bytes, state_bytes
from swarmtrain.roles.peer.ring import RingBroken
from swarmtrain.roles.peer.training import Contribution, Strategy

__all__ = ["PeerTrainer"]

log = logging.getLogger("swarmtrain.roles.peer")

Evaluate = Callable[[nn.Module], Mapping[str, float]]


@dataclass
class PeerTrainer:
    """Runs rounds until ``max_rounds`` (0 = until stopped).

    Args:
        backend: a started :class:`PeerBackend`.
        strategy: :class:`StepAveraging` or :class:`DiLoCo`.
        evaluate: held-out evaluation, run every ``eval_every`` rounds by rank 0.
        status_file: rewritten with this peer's status after every round.
        robust: ``none`` (the weighted mean, by all-reduce) or ``clip``, ``trimmed_mean``,
            ``median``: every member's contribution is gathered and combined with one vote
            each (:meth:`_gather_robust`, docs/robustness.md).
        robust_trim: the trimmed mean's fraction cut at each end.

    Attributes:
        nonfinite_local: rounds whose own contribution was NaN/Inf (sent as zero, weight 0).
        rounds_refused: rounds whose average was NaN/Inf and was not applied.
    """

    backend: PeerBackend
    strategy: Strategy
    max_rounds: int = 0
    evaluate: Evaluate | None = None
    eval_every: int = 10
    status_file: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    inner_steps: int = 0
    nonfinite_local: int = 0
    rounds_refused: int = 0
    run_log: RunRecorder | None = None
    robust: str = "none"
    robust_trim: float = 0.2
    #: gathered contributions dropped for holding NaN or Inf (robust modes), over all rounds
    nonfinite_dropped: int = 0
    #: robust modes: each member's agreement with the combinations, for the current epoch
    #: (every member starts it afresh at each epoch, so all of them decide alike)
    scores: MemberScores = field(default_factory=MemberScores)
    _scores_epoch: int = -1
    _stop: bool = False
    _round_weight: int = 0

    def stop(self) -> None:
        """End the run (from any thread, e.g. a signal handler): a collective in progress or
        a paused wait for the group ends at once."""
        self._stop = True
        self.backend.interrupt()

    def run(self) -> None:
        pending: Contribution | None = None
        resync = False
        broken = 0  # rings broken in a row: re-forming is paced so it never spins
        started = time.monotonic()
        while not self._stop and not (self.max_rounds and self.strategy.round >= self.max_rounds):
            if pending is None:
                self._propose()
                pending = self._screen(self.strategy.local_work())
            try:
                if self.backend.refresh() or resync:
                    pending = self._sync_state(pending)
                    resync = False
                mean = self._reduce(pending)
            except NonFiniteResult as exc:
                self.rounds_refused += 1
                log.warning("round %d (epoch %d): %s; not applied, the weights stay as they were",
                            self.strategy.round, self.backend.epoch, exc)
                self.record_event("round_refused", round=self.strategy.round, epoch=self.backend.epoch)
                self.strategy.skip_round()
                mean = None  # and its samples never reached the weights:
                pending = Contribution(pending.flat, 0.0, pending.round, 0, 0, pending.flags)
            except RingBroken as exc:
                # the epoch of the ring that broke: a newer view may already be installed (its
                # arrival is what closed our ring), and then there is nothing to agree
                epoch = exc.epoch if exc.epoch is not None else self.backend.epoch
                if self._stop:
                    break
                if self.backend.epoch > epoch:  # a new epoch (a join, a leave) closed it: routine
                    log.info("round %d: epoch %d gave way to epoch %d", self.strategy.round, epoch,
                             self.backend.epoch)
                elif self.backend.routine_close or self.backend.left_recently():
                    why = self.backend.routine_close or f"member {self.backend.left_recently()[:8]} left"
                    log.info("round %d: %s; re-forming epoch %d's group", self.strategy.round, why, epoch)
                else:
                    log.warning("round %d: ring of epoch %d broke (%s); re-forming", self.strategy.round,
                                epoch, exc)
                self.record_event("ring_broken", epoch=epoch, phase=exc.phase, round=self.strategy.round)
                resync = True
                broken += 1
                if broken > 1:
                    time.sleep(min(2.0, 0.05 * 2 ** broken))
                try:
                    self.backend.recover(epoch)
                except (RingBroken, SwarmTimeout) as again:  # churn while re-forming: go round again
                    log.warning("re-forming after epoch %d failed (%s); trying again", epoch, again)
                continue
            if mean is not None:
                self.strategy.apply_average(*mean)
                self.backend.work += self._round_weight  # the samples every member put in
            self.samples += pending.samples if pending.weight > 0 else 0
            self.inner_steps += pending.steps if pending.weight > 0 else 0
            pending, broken = None, 0
            self.backend.rounds = self.strategy.round
            self._after_round(started)
        if not self._stop and self.max_rounds and self.strategy.round >= self.max_rounds:
            self._finish_together()

    def _finish_together(self) -> None:
        """After the last round, wait until every member is done with it before leaving: a
        member that returned from the last all-reduce and closed its links at once could cut
        another member off its final chunk, and that member would then void the round that
        this one applied (the run would end with two different models). Best effort: a
        member that is gone or a broken ring ends it."""
        try:
            self.backend.barrier(retries=0)
        except (RingBroken, SwarmError) as exc:
            log.info("round %d: the others could not be waited for at the end (%s)", self.strategy.round, exc)

    def _propose(self) -> None:
        """As leader, take in joiners and drop leavers at this boundary. A proposal that fails
        (others kept winning, or the control thread was slow) costs nothing: the current
        epoch goes on and the next boundary tries again."""
        try:
            self.backend.propose_if_needed()
        except SwarmError as exc:
            if self.backend.view is None:
                raise
            log.info("round %d: no new epoch agreed at this boundary (%s); going on",
                     self.strategy.round, exc)

    def _sync_state(self, pending: Contribution) -> Contribution:
        """Load the donor's boundary state; keep our contribution only if it is for that round."""
        view = self.backend.view
        assert view is not None
        work = torch.tensor([self.backend.work], dtype=torch.int64)
        state = [work, *self.strategy.boundary_state()]
        flat = state_bytes(state)  # as bytes: every dtype arrives exactly
        digest = self.backend.broadcast_state(flat)  # and every member checks it holds the same
        load_state_bytes(flat, state)
        self.backend.work = int(work)
        self.strategy.after_state_load()
        self.record_event("epoch", epoch=view.epoch, members=len(view.members), round=self.strategy.round,
                          donor=view.donor, work=self.backend.work, digest=digest)
        log.info("epoch %d: %d member(s), state of round %d (%d samples of training) from %s, digest %s",
                 view.epoch, view.world_size, self.strategy.round, self.backend.work, view.donor[:8], digest)
        if pending.round != self.strategy.round:
            return self._nothing(pending, self.strategy.round)
        return pending

    def _nothing(self, work: Contribution, for_round: int) -> Contribution:
        """Zeros with weight zero in the shape of ``work``."""
        return Contribution(torch.zeros_like(work.flat), 0.0, for_round, 0, 0,
                            torch.zeros(self.strategy.flag_count))

    def _screen(self, work: Contribution) -> Contribution:
        """``work``, or zeros with weight zero if it holds NaN or Inf: sent, it would spoil the
        average of every member. The others' mean is then applied here too."""
        if math.isfinite(work.weight) and bool(torch.isfinite(work.flat).all()) and (
                work.flags is None or bool(torch.isfinite(work.flags).all())):
            return work
        self.nonfinite_local += 1
        log.warning("round %d: this peer's own contribution holds NaN or Inf (diverged, or bad "
                    "data?); contributing nothing this round", work.round)
        self.record_event("nonfinite_local", round=work.round)
        self.strategy.discard_local_work()
        return self._nothing(work, work.round)

    def _reduce(self, pending: Contribution) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weighted mean of everyone's contribution and of their flags (for each trained
        parameter and buffer, the share of the weight that computed it), or None if nobody
        contributed.

        Raises:
            NonFiniteResult: the reduced sum (one pass over it, before anything is applied)
                holds NaN or Inf; every member then holds the same bits and refuses alike.
        """
        if self.robust != "none":
            return self._gather_robust(pending)
        flags = pending.flags if pending.flags is not None else torch.ones(self.strategy.flag_count)
        # the flags next to the weight: values of the same size, also on a lossy wire
        w = pending.weight
        buf = torch.cat([pending.flat * w, flags * w, torch.tensor([w])])
        # no retry inside the backend: a new epoch must start with the state sync (run())
        work = self.backend.work  # counted here in samples, once the mean is applied (run())
        try:
            self.backend.all_reduce(buf, op="sum", retries=0, boundary=False, check_finite=True)
        finally:
            self.backend.work = work
        total = float(buf[-1])
        self._round_weight = max(0, round(total))
        if total <= 0:
            return None
        mean = buf[:-1].div_(total)
        n = pending.flat.numel()
        return mean[:n], mean[n:]

    def _gather_robust(self, pending: Contribution) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every member's contribution gathered to every member, combined with one vote each.

        The gather is the ring's all-reduce SUM (fp32 wire) of a ``world x row`` buffer in
        which each member fills only its own row: adding zeros is exact, so every member ends
        with every row bit for bit — world_size x the bytes of the plain all-reduce. A row is
        the contribution, its flags, 1 (a vote; 0 for a member with nothing this round) and
        its claimed weight. Rows holding NaN or Inf are dropped (identically everywhere), so
        one member cannot void rounds. The combination (:func:`robust_combine`) is
        deterministic, so every member applies the same bits; a parameter is stepped if any
        voting member computed it, with the combination over all voters.
        """
        if self.robust not in ROBUST_MODES[1:]:
            raise ValueError(f"robust must be one of {ROBUST_MODES}, got {self.robust!r}")
        flags = pending.flags if pending.flags is not None else torch.ones(self.strategy.flag_count)
        n, f = pending.flat.numel(), flags.numel()
        size, rank = self.backend.world_size, self.backend.rank
        rows = torch.zeros(size, n + f + 2)
        if pending.weight > 0:
            rows[rank, :n] = pending.flat
            rows[rank, n:n + f] = flags
            rows[rank, -2:] = torch.tensor([1.0, pending.weight])
        work = self.backend.work
        try:
            self.backend.all_reduce(rows.view(-1), op="sum", wire="fp32", retries=0, boundary=False)
        finally:
            self.backend.work = work
        finite = torch.isfinite(rows).all(dim=1)
        self.nonfinite_dropped += int((~finite & (rows[:, -2] != 0)).sum())
        voters = [i for i in range(size) if bool(finite[i]) and float(rows[i, -2]) > 0]
        if not voters:
            self._round_weight = 0
            return None
        if self._scores_epoch != self.backend.epoch:
            self.scores, self._scores_epoch = MemberScores(), self.backend.epoch
        view = self.backend.view
        members = [(view.members[i] if view is not None else str(i), {"flat": rows[i, :n]}) for i in voters]
        # the rows that vote (not the members left out): the combination, the samples and the
        # parameters stepped are theirs alone
        voting = [voters[j] for j in self.scores.voting([k for k, _ in members])]
        self._round_weight = capped_total([float(rows[i, -1]) for i in voting])
        combined = robust_combine([{"flat": rows[i, :n]} for i in voting], self.robust,
                                  trim=self.robust_trim)["flat"]
        left, back = self.scores.update(members)
        for peer in left:
            self.record_event("member_excluded", peer=peer, agreement=self.scores.mean(peer))
            self.backend.refusals.count("member_excluded")
            log.warning("peer %s is left out of the robust combination: its contributions pull against "
                        "the others' (mean cosine %.3f); check its data and code, or stop it if it is "
                        "not yours", str(peer)[:8], self.scores.mean(peer))
        for peer in back:
            self.record_event("member_readmitted", peer=peer)
        shares = (rows[voting, n:n + f].sum(dim=0) > 0).to(torch.float32)
        return combined, shares

    def record_event(self, kind: str, **data: Any) -> None:
        """Note that ``kind`` happened (with ``data``): in :attr:`events` (the status shows the
        last 50) and in the run log, if there is one."""
        self.events.append({"time": time.time(), "event": kind, **data})
        if self.run_log is not None:
            self.run_log.event(kind, **data)

    def _after_round(self, started: float) -> None:
        r = self.strategy.round
        view = self.backend.view
        evaluated = False
        if self.evaluate is not None and view is not None and self.backend.rank == 0 \
                and (r % self.eval_every == 0 or r == self.max_rounds):
            self.metrics = dict(self.evaluate(self.strategy.model))
            evaluated = True
            log.info("round %d (epoch %d, %d peers): %s", r, self.backend.epoch, self.backend.world_size,
                     ", ".join(f"{k} {v:.4f}" for k, v in self.metrics.items()))
        elif view is not None and (r % self.eval_every == 0 or r == self.max_rounds):
            # every rank reports progress; held-out metrics are computed once, by rank 0
            who = f"; held-out metrics come from rank 0 ({view.members[0][:8]})" if self.evaluate else ""
            log.info("round %d (epoch %d, %d peers, rank %d): train loss %.4f, %d samples%s", r,
                     self.backend.epoch, self.backend.world_size, self.backend.rank, self.strategy.last_loss,
                     self.samples, who)
        self.history.append({"time": time.time(), "elapsed": time.monotonic() - started, "round": r,
                             "epoch": self.backend.epoch, "world_size": self.backend.world_size,
                             "loss": self.strategy.last_loss, "bytes_sent": self.backend.bytes_sent,
                             "checksum": self.checksum(),  # equal on every member after round r
                             **({"metrics": dict(self.metrics)} if self.metrics else {})})
        if self.run_log is not None:
            elapsed = time.monotonic() - started
            self.run_log.metrics(
                force=evaluated, role="peer", round=r, epoch=self.backend.epoch,
                world_size=self.backend.world_size, loss=self.strategy.last_loss,
                learning_rate=self.strategy.learning_rate, samples=self.samples,
                samples_per_sec=self.samples / elapsed if elapsed > 0 else 0.0,
                bytes_sent=self.backend.bytes_sent, bytes_received=self.backend.bytes_received,
                **({"eval": dict(self.metrics)} if evaluated else {}))
        if self.status_file:
            self.write_status()

    def checksum(self) -> float:
        """A cheap fingerprint of the weights (equal on every member after each round)."""
        return float(sum(float(p.detach().double().sum()) for p in self.strategy.params))

    def status(self) -> dict[str, Any]:
        return {**self.backend.status(), "round": self.strategy.round, "samples": self.samples,
                "learning_rate": self.strategy.learning_rate, "inner_steps": self.inner_steps,
                "metrics": self.metrics,
                "nonfinite_local": self.nonfinite_local, "rounds_refused": self.rounds_refused,
                "robust": self.scores.summary() if self.robust != "none" else {},
                "loss": self.strategy.last_loss if math.isfinite(self.strategy.last_loss) else None,
                "checksum": self.checksum(), "events": self.events[-50:],
                "history": self.history[-2000:]}

    def write_status(self) -> None:
        """Rewrite :attr:`status_file` with :meth:`status` (whole: written aside, then renamed).

        Raises:
            SwarmError: no ``status_file`` is set.
        """
        if not self.status_file:
            raise SwarmError("write_status() needs a status_file: set PeerTrainer.status_file first")
        # as swarmtrain.app.lifecycle.write_status_file (roles do not import app): atomic,
        # not fsynced (rewritten every round; a lost one costs nothing)
        write_atomic(self.status_file, json.dumps(self.status(), default=str), fsync=False)


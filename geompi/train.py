"""``python -m geompi.train``: the command-line entry point, and ``train()`` for the Python API.

Run under MPI, e.g. ``mpirun -n 16 python -m geompi.train``. Rank 0 (the first worker of
datacenter 0) prints the topology, progress lines and the final test accuracy, and writes the
metrics file.
"""

from __future__ import annotations

from geompi.runtime import install_signal_handlers

if __name__ == "__main__":
    install_signal_handlers()  # before the slow imports: a stop signal at start-up is not fatal
    # Run as the module geompi.train, imported where a missing MPI library (the imports below
    # load it) is turned into one line saying what to install.
    from geompi.runtime import end_after, main_needing_mpi

    def _load_main():
        from geompi.train import main

        return main

    # without the interpreter's teardown (0.35 s of CPU per rank)
    end_after(lambda: main_needing_mpi(_load_main))

import copy
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence

import torch

from geompi import sync
from geompi.comm import faults
from geompi.comm.topology import Role
from geompi.comm.transport import LAN, worker_timeout
from geompi.config import MAX_STEPS, RunConfig, make_config
from geompi.errors import ConfigError, GeompiError
from geompi.logs import set_level
from geompi.metrics import Metrics
from geompi.runtime import (
    StopRequest,
    abort,
    agree_or_exit,
    exit_together,
    install_excepthook,
    install_signal_handlers,
    launcher_rank,
    restore_signal_handlers,
    say,
)


class Worker:
    """One training process: the loop over its data shard (geompi.data.WorkerData) with its
    model replica, synchronized by the public API's engine (geompi.engine.Synchronizer);
    checkpoints are geompi.checkpointing's, HFA's way back to a global sync is ``Rewind``."""

    def __init__(self, cfg: RunConfig, algo, session) -> None:
        from geompi.data import WorkerData
        from geompi.models import build_model

        self.session = session
        topo, comms = session.topo, session.comms
        self.cfg, self.algo, self.topo, self.comms = cfg, algo, topo, comms
        self.rank = session.rank
        self.master = self.rank == 0
        self.widx = topo.worker_index(self.rank)
        self.dc = topo.dc_of(self.rank)
        torch.manual_seed(cfg.seed)
        self.data = WorkerData(cfg, topo.num_workers, self.widx)
        self.ds, self.loader = self.data.ds, self.data.loader
        torch.manual_seed(cfg.seed)
        self.device = session.device
        self.model = build_model(cfg.model, self.ds.input_shape, self.ds.num_classes)
        self.model = self.model.to(self.device)
        self.total_steps = self._total_steps()
        self.step = 0
        self.samples = 0
        self.samples_of_lost = 0  # --on-failure continue: samples the lost workers trained
        self.failures_seen = 0  # of the engine's failures, those counted and logged
        self.last_batch = 0  # the samples of this worker's last step
        self._nan_at = _fault_nan_at(self.rank)
        self._kill_at = faults.fault_step("GEOMPI_FAULT_KILL_AT", self.rank)
        self._signal_at = _fault_signal_at(self.rank)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self._prepare_checkpoints()

    def start(self) -> None:
        """Collective over the workers, once the servers serve: the optimizer, made a
        DistributedOptimizer (its INIT round gives every worker the master's model)."""
        self.opt = self._make_optimizer()
        self.engine = self.opt._geompi  # the loop's own recovery and checkpoints use it
        self.stats = self.engine.stats  # this job's counters, the summary's
        self.buckets = self.engine.buckets
        self.client = self.engine.client  # this worker's link to its local server
        # the optimizer whose state is this worker's own (HFA's), for checkpoints and rewinds
        self.local_opt = self.opt if self.algo.optimizer_state_per_worker else None
        # Who agrees on stopping and checkpoints together: the workers that go through the
        # same rounds (every worker; MixedSync: each datacenter's, which move apart). The
        # master's group writes checkpoints.
        self.group = self.engine.peers()
        self.checkpoints = self.cfg.checkpoint_dir is not None and (
            self.group is self.comms.all_workers or self.dc == self.topo.dc_of(0)
        )

    def _prepare_checkpoints(self) -> None:
        """Check the checkpoint directory and read the checkpoint to resume, before training."""
        from geompi.checkpointing import Checkpointing, check_writable, checkpoint_bytes

        cfg = self.cfg
        self.ckpt = Checkpointing(self)
        self.resume_path = None
        if not self.master:
            return
        if cfg.checkpoint_dir:
            need = checkpoint_bytes(self.model, cfg, self.topo.num_workers, self.topo.num_dcs)
            check_writable(cfg.checkpoint_dir, need)
        self.resume_path = self.ckpt.load_resume(cfg.resume, cfg.checkpoint_dir)

    def _total_steps(self) -> int:
        cfg = self.cfg
        if cfg.steps is not None:
            steps = cfg.steps
        else:
            steps = max(1, math.ceil((cfg.epochs or 30) * self.loader.steps_per_epoch))
            if steps > MAX_STEPS:
                raise ConfigError(
                    f"--epochs {cfg.epochs:g} is {steps} steps of {self.loader.steps_per_epoch} "
                    f"per epoch: at most {MAX_STEPS:.0e}; pass fewer --epochs"
                )
        period = self.algo.period()  # whole global rounds: training ends on the global model
        return math.ceil(steps / period) * period

    def _make_optimizer(self):
        """The optimizer the flags name (``Algorithm.cli_optimizer``: a torch optimizer, or
        under FSA and MixedSync a stand-in for the one the global servers run), made a
        DistributedOptimizer as a user's script makes its own. The loop recovers from a lost
        rank itself (it agrees on the step and counts the lost workers' samples), so the
        engine's step() leaves that to it."""
        from geompi.optimizer import build

        opt = self.algo.cli_optimizer(self.cfg, self.model.parameters())
        # On --resume the INIT round waits for the checkpoint (_resume): one round, as a
        # fresh start's, rather than the fresh model's values and then the checkpoint's. A
        # lost rank is the loop's to survive (_survive).
        start = not self.cfg.resume
        return build(
            opt, self.model, self.algo, start=start, recovers=False, bucket_mb=self.cfg.bucket_mb
        )

    # ---- the loop -------------------------------------------------------------------------
    # What differs between algorithms (when the workers agree on a stop, which rounds are made
    # global for a checkpoint, going back to the last global round, when the final model
    # exists) the algorithm's worker side answers (geompi.sync.base.WorkerSide); the loop asks.
    def run(self, log: Metrics | None) -> dict:
        cfg = self.cfg
        self.data.check_same(self.comms.all_workers, self.master)
        self._resume()
        self.stats.reset_time()  # the time split covers the training loop (as wall_s does)
        self.stop = StopRequest(self.group, worker_timeout(cfg.comm_timeout))  # as the client's
        self.engine.rejoined = self._rejoined
        self.every = cfg.checkpoint_every if self.checkpoints else 0
        side = self.engine.side
        self.rewind = Rewind(self) if side.rewinds_to_global else None
        self.stopping = self.preempted = False
        self.saved_at = self.made_global_at = -1
        start_step = self.step
        t_start = time.perf_counter()
        self.progress = Progress(log, self, t_start)
        compute_s = 0.0
        while self.step < self.total_steps and not self.stopping:
            compute_s += self._train_step(log)
        train_s = time.perf_counter() - t_start  # before waiting for other datacenters
        out = self._finish(log, start_step)
        out.update(compute_s=compute_s, wall_s=time.perf_counter() - t_start, train_s=train_s)
        if self.master:
            from geompi.data import evaluate

            acc, tl = evaluate(self.model, self.ds.x_test, self.ds.y_test)
            out.update(test_acc=acc, test_loss=tl)
        return out

    def _rejoined(self, loss) -> None:
        """After a recovery, wherever it met the loss: the rebuilt topology and groups."""
        self.topo = loss.topo
        self.group = self.engine.peers()
        self.stop.rejoin(self.group)
        self.client = self.engine.client
        self.ckpt.rejoin(loss)  # MixedSync: the lost workers leave the checkpoints' cut

    def _train_step(self, log: Metrics | None) -> float:
        """One step: forward, backward (FSA, MixedSync: the round completes as it ends), the
        optimizer's step, then its record, checkpoints and the stop agreement. Returns the
        compute seconds (forward and backward, less the wait for the round in backward)."""
        side, stop = self.engine.side, self.stop
        t0 = time.perf_counter()
        if self.step + 1 == self._kill_at:  # test hook: this worker is lost now
            faults.kill_self(self.rank)
        self.client.step = self.step + 1
        x, y = self.loader.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        n = len(y)
        self.model.zero_grad(set_to_none=True)
        self.opt.set_batch_size(n)
        waited = self.stats.wait_s[LAN]
        loss = self.loss_fn(self.model(x), y)
        if self.step + 1 == self._nan_at:  # fault injection for tests (GEOMPI_FAULT_NAN_AT)
            loss = loss * float("nan")
        loss.backward()
        dt = time.perf_counter() - t0 - (self.stats.wait_s[LAN] - waited)
        in_round = side.stop_in_round()  # None: agreed after the step, below
        agreeing = bool(in_round) and self.step + 1 < self.total_steps
        if agreeing:
            stop.begin()
        last = self.step + 1 == self.total_steps
        if (last or self.every and (self.step + 1) % self.every == 0) and side.make_global_next():
            self.made_global_at = self.step + 1
        syncs = self.opt.global_syncs
        try:
            self.opt.step()
            if agreeing:
                self.stopping = stop.end()
        except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
            self._survive(e, log)
        self.step += 1
        self.samples += n
        self.last_batch = n
        self._note_failures(log)  # FSA: survived inside backward
        if self.step == self._signal_at:  # fault injection for tests (GEOMPI_FAULT_SIGNAL_AT)
            os.kill(os.getpid(), signal.SIGTERM)
        self.progress.step(loss)
        # the last checkpoint of a final model made at close() is written after it
        at_close = side.final_model_at_close and self.step == self.total_steps
        if self.every and self.step % self.every == 0 and not at_close:
            self._save_surviving(log)
            self.saved_at = self.step
        if self.rewind and self.opt.global_syncs != syncs:  # a global average, this step
            self.rewind.record()
        if in_round is None and not self.stopping and self.step < self.total_steps:
            try:
                self.stopping = stop.poll(self.step)
            except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
                self._survive(e, log, redo=False)
        self.preempted = self.stopping and self.step < self.total_steps
        return dt

    def _finish(self, log: Metrics | None, start_step: int) -> dict:
        """After the last step (or a stop): back to the last global round where the workers
        are between two, the last checkpoint, every worker on the global model, close()."""
        cfg, side, stop = self.cfg, self.engine.side, self.stop
        stop.close()
        stopped_at = self.step
        if self.rewind and side.steps_at_global != side.steps:
            self.rewind.restore()
        if self.preempted:
            side.stopped_early(self.made_global_at == self.step)
        at_close = side.final_model_at_close
        nothing_new = self.preempted and self.step == start_step and stopped_at != self.step
        if self.checkpoints and self.saved_at != self.step and not at_close and not nothing_new:
            self._save_surviving(log)
        self.engine.end_on_global()  # HFA: every worker on the global servers' model
        if not at_close and cfg.wan_settings().compression != "none":
            self.ckpt.global_model()  # the model returned is the global one, not a replica
        while True:
            try:
                self.engine.close(report=False)  # MixedSync: every worker gets the final model
                break
            except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
                self._survive(e, log)
        if self.checkpoints and at_close:
            self._save(log, final=True)
        out = {
            "steps": self.step,
            "preempted": self.preempted,
            "stopped_at": stopped_at,  # HFA: "steps" is the last global sync, if earlier
            "checkpointed": self.checkpoints and not nothing_new,
            "global_syncs": self.opt.global_syncs,
            "signal": stop.signal_name,
        }
        if self.opt.failures:
            out["failures"] = self.opt.failures
        if side.cadence is not None:  # --adaptive-sync: the K2 it ended with
            out.update(k2=side.cadence.k2, k2_changes=len(side.cadence.changes))
        return out

    def _survive(self, err: BaseException, log: Metrics | None, redo: bool = True) -> None:
        """``--on-failure continue``: a rank was lost during this step's round (or, without
        ``redo``, its checkpoint); see Synchronizer.survive. Re-raises ``err`` where it is not
        a lost rank."""
        self.step = self.engine.survive(err, self.step, redo)
        self._note_failures(log)

    def _note_failures(self, log: Metrics | None) -> None:
        """Each loss the engine survived since the last call: a metrics event, and the samples
        the lost workers trained before it, which the summary counts (as the worker side
        counts them). Where the workers agree on a stop after every step, they next agree
        after the first step trained without the lost ranks."""
        side = self.engine.side
        for failure in self.opt.failures[self.failures_seen :]:
            at = failure["step"]
            done = side.trained_by_lost(self.samples, self.step, at, self.last_batch)
            self.samples_of_lost += failure["lost_workers"] * done
            if side.stop_in_round() is None:
                self.stop.resume_at = at
            if log is not None:
                log.record("failure", event="failure", **failure)
        self.failures_seen = len(self.opt.failures)

    def _resume(self) -> None:
        """Restore the checkpoint (if any) everywhere: the master's model, each worker's data
        position, RNG and own state, then the INIT round (which DistributedOptimizer left to
        this) hands every worker the master's model and the servers their state. Where the
        datacenters train apart, each keeps its own progress: the checkpoints' cut records
        where each starts."""
        info = self.ckpt.distribute() if self.cfg.resume else None
        if self.master:
            if info is not None:
                from geompi.checkpointing import say_resumed

                say_resumed(self.resume_path, info["step"], self.ckpt.restore_note)
            elif self.cfg.resume:
                say(f"geompi: no checkpoint in {self.cfg.checkpoint_dir} yet; starting fresh")
        if self.cfg.resume:  # on every worker alike: the INIT round _make_optimizer left
            send = None
            if info is not None and self.master and self.ckpt.server_states() is not None:
                send = self.ckpt.send_server_states
            self.engine.start({"restore": True} if send else None, send_restore=send)
        if self.cfg.checkpoint_dir and self.group is not self.comms.all_workers:
            self.ckpt.record_starts()

    def _save_surviving(self, log: Metrics | None) -> None:
        """``_save``; where a rank is lost during it (``--on-failure continue``), the survivors
        recover and write it again, in the surviving topology. The round it cut off changed
        no model (a SAVE round), so nothing is redone."""
        while True:
            try:
                self._save(log)
                return
            except Exception as e:  # noqa: BLE001 - a lost rank, under --on-failure continue
                self._survive(e, log, redo=False)

    def _save(self, log: Metrics | None, final: bool = False) -> None:
        from geompi.data import evaluate

        metrics = {}
        if self.master:
            acc, loss = evaluate(self.model, self.ds.x_test, self.ds.y_test)
            metrics = {"test_acc": acc, "test_loss": loss}
        path = self.ckpt.save(self.step, metrics, final=final)
        if log is not None and path is not None:
            log.record("checkpoint", step=self.step, checkpoint=str(path), **metrics)


class Rewind:
    """HFA's way back to the last global sync. A stop between global syncs puts every worker
    back there (the global servers still hold that global model) with its own data position,
    RNG, local optimizer state and counters, so the checkpoint it writes resumes exactly."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.record()

    def record(self) -> None:
        """Remember this worker as it is now, at a global sync."""
        w = self.w
        self.saved = {
            "step": w.step,
            "samples": w.samples,
            "loader": dict(w.loader.state_dict()),
            "rng": torch.get_rng_state(),
            "strategy": w.engine.state(),
            "params": [b.params.detach().clone() for b in w.buckets],
            "optimizer": copy.deepcopy(w.local_opt.state_dict()),
        }

    def restore(self) -> None:
        """Back to what :meth:`record` saw last."""
        w, st = self.w, self.saved
        w.step, w.samples = st["step"], st["samples"]
        w.loader.load_state_dict(st["loader"])
        torch.set_rng_state(st["rng"])
        w.engine.load_state(st["strategy"])
        with torch.no_grad():
            for b, p in zip(w.buckets, st["params"]):
                b.params.copy_(p)
        w.local_opt.load_state_dict(st["optimizer"])


class Progress:
    """The loop's account, through geompi.metrics.Metrics (the API's one path): on every
    worker a step record (the loss averaged over the workers) and progress lines every
    ``--progress-every`` seconds; on rank 0 a record per change of K2 and the test accuracy
    every ``--eval-every`` steps."""

    def __init__(self, log: Metrics | None, worker: Worker, t_start: float) -> None:
        self.log, self.w, self.t_start = log, worker, t_start
        self.cadence = worker.engine.side.cadence  # --adaptive-sync: a line per change of K2
        self.k2_written = 0

    def step(self, loss: torch.Tensor) -> None:
        if self.log is None:
            return
        from geompi.data import evaluate

        w, cfg, cadence = self.w, self.w.cfg, self.cadence
        k2 = f" K2 {cadence.k2}" if cadence is not None else ""
        note = f"epoch {w.loader.epoch}{k2}"
        lr = w.opt.param_groups[0].get("lr", cfg.effective_lr)  # the servers' own, if they step
        self.log.step(w.step, loss.item(), lr=lr, samples=w.last_batch, note=note)
        if not w.master:
            return
        wall = time.perf_counter() - self.t_start
        if cadence is not None:
            for change in cadence.changes[self.k2_written :]:  # "step" is the change's own
                self.log.record("k2", event="k2", **change, wall_s=wall)
            self.k2_written = len(cadence.changes)
        if cfg.eval_every and w.step % cfg.eval_every == 0:
            acc, tl = evaluate(w.model, w.ds.x_test, w.ds.y_test)
            self.log.record("eval", step=w.step, test_acc=acc, test_loss=tl, wall_s=wall)


def _fault_signal_at(rank: int) -> int:
    """``GEOMPI_FAULT_SIGNAL_AT=STEP:RANK``: a test hook that makes that rank send itself
    SIGTERM once STEP is done, as a scheduler's pre-emption would."""
    return faults.fault_step("GEOMPI_FAULT_SIGNAL_AT", rank)


def _fault_nan_at(rank: int) -> int:
    """``GEOMPI_FAULT_NAN_AT=STEP:RANK``: a test hook that makes that rank's loss NaN once."""
    return faults.fault_step("GEOMPI_FAULT_NAN_AT", rank)


def train(cfg: RunConfig, comm=None) -> dict | None:
    """Run one job on ``comm`` (default MPI.COMM_WORLD). Collective: every rank must call it.

    Returns the summary on rank 0, with the trained ``model`` state dict, and None elsewhere.
    User errors are reported as one line and end the process (exit status 2 at start-up; an
    abort of every rank during training).
    """
    previous = install_signal_handlers()
    try:
        return _train(cfg, comm)
    finally:
        restore_signal_handlers(previous)


def _train(cfg: RunConfig, comm) -> dict | None:
    from geompi import session

    again = None
    if cfg.on_failure == "continue" and cfg.checkpoint_dir:
        again = f"{faults.RUN_AGAIN} with --resume latest (from {cfg.checkpoint_dir})"
    # The one start-up and serve path of the CLI, geompi.init() and the KVStore: server ranks
    # serve the job the master worker announces (the algorithm's job(), sent by the engine
    # before its INIT round), as they serve a DistributedOptimizer's.
    s = session.start(cfg.validate, comm, again=again)
    try:
        session._session = s  # the API's, as geompi.init() makes it; DistributedOptimizer's
        return _run(cfg, s)
    finally:
        session._session = None


def _run(cfg: RunConfig, s) -> dict | None:
    from geompi import session

    comm, topo, comms = s.comms.world, s.topo, s.comms
    if cfg.log_level:
        set_level(cfg.log_level)
    rank = s.rank
    node = log = err = None
    try:
        algo = sync.from_config(cfg)
        if s.is_worker:
            node = Worker(cfg, algo, s)
            log = Metrics(
                cfg.metrics,
                tensorboard=cfg.tensorboard,
                total_steps=node.total_steps,
                progress_s=cfg.progress_every,
                start={"config": json.loads(cfg.to_json())},
                _agree=False,  # a bad --metrics is agreed on with the servers, below
                # no file, no TensorBoard: the records feed progress lines (the loss) alone,
                # and the rounds need not bring the local servers' WAN counters
                _wan_stats=bool(cfg.metrics or cfg.tensorboard),
            )
    except Exception as e:  # noqa: BLE001 - reported collectively below
        err = e
    agree_or_exit(comm, err)
    if not s.is_worker:
        session.serve_until_finished(s)
        faults.unwatch()
        return None
    node.start()
    log.attach(node.opt)
    try:
        result = node.run(log)
        log.flush()  # every worker: the last step records
    except Exception as e:  # noqa: BLE001
        abort(e)
    # After a recovery (--on-failure continue) the job goes on in the rebuilt communicators
    s.topo, s.rank = node.topo, comms.world.Get_rank()
    topo, rank = s.topo, s.rank
    stats = node.stats
    mine = {"role": Role.WORKER.name, **stats.as_dict()}
    mine.update(compute_s=result["compute_s"], wall_s=result["wall_s"])
    # Every rank is here (the servers at the end of their job), so that a lost one is caught
    # by the watchdog (a fast MixedSync datacenter may rightly wait long for the others).
    report = session.gather_report(s, mine)
    summary = None
    if rank == 0:
        per_rank = report["per_rank"]
        servers = [r for r in per_rank if r["role"] != Role.WORKER.name]
        totals = {k: sum(r[k] for r in per_rank) for k in stats.as_dict() if k.endswith("_bytes")}
        totals.pop("wan_received_bytes")
        totals.pop("lan_received_bytes")
        # what reached the global servers: headers, trailers, pushes and MixedSync deposits
        totals["global_in_bytes"] = report["global_in_bytes"]
        served = _server_summary(servers)
        summary = {
            "summary": True,
            **result,
            **totals,
            **served,
            "time_split": time_split(per_rank),
            "samples": _samples(node, topo, result, served),
            "sync": cfg.sync,
            "topology": topo.describe(),
        }
        log.close(**summary)
        figures = (
            f"test_acc={result['test_acc']:.4f} steps={result['steps']} "
            f"wall_s={result['wall_s']:.1f} lan_bytes={totals['lan_bytes']} "
            f"wan_bytes={totals['wan_bytes']} "
            + (f"k2={result['k2']} " if "k2" in result else "")
            + "time: "
            + " ".join(
                f"{k[:-2]}={v:.1f}s" for k, v in summary["time_split"].items() if "held" not in k
            )
        )
        if result["preempted"]:
            where = f" to {cfg.checkpoint_dir}" if cfg.checkpoint_dir else " (no --checkpoint-dir)"
            wrote = f"checkpoint written{where}"
            if node.ckpt.failed_step == result["steps"]:
                wrote = f"its checkpoint could NOT be written{where} (see the warning above)"
            elif cfg.checkpoint_dir and not result["checkpointed"]:
                wrote = "no checkpoint written: no global sync since this run started"
            at = f"at step {result['steps']}"
            if result["stopped_at"] != result["steps"]:
                at += (
                    f" (stopped at step {result['stopped_at']}, between global syncs: back to "
                    "the last one)"
                )
            by = result["signal"] or "a stop signal to another rank"
            say(f"geompi: preempted by {by} {at}; {wrote}; {figures}")
        else:
            say(f"geompi: done: {figures}")
        if cfg.checkpoint_dir and node.ckpt.failed_step == result["steps"]:
            # the batch system must not record a success whose last state is lost
            summary["checkpoint_failed"] = True
            last = node.ckpt.written[0].name if node.ckpt.written else "none from this run"
            say(
                f"geompi: error: the checkpoint of the last step ({result['steps']}) could not "
                f"be written to {cfg.checkpoint_dir} (see the warning above); the last good one "
                f"is {last}; exit status 1"
            )
    # Release the servers; beat until every rank is here (one that is done, a fast MixedSync
    # datacenter, must not look lost to one still training), then free the communicators.
    log.close()  # the other workers (rank 0's is closed with its summary)
    s.send_job({"sync": None}, None)
    session.end(s)
    faults.unwatch()
    if summary is not None:
        summary["model"] = {k: v.detach().cpu().clone() for k, v in node.model.state_dict().items()}
    return summary


def _server_summary(reports: list[dict]) -> dict:
    """Fold the servers' reports into the summary: skips, per-DC updates, staleness."""
    out = {"skipped_nonfinite": sum(r.get("skipped_nonfinite", 0) for r in reports)}
    gs0 = next((r for r in reports if r.get("global_server") == 0), {})
    out["global_updates"] = gs0.get("updates", 0)
    if "dc_updates" in gs0:  # MixedSync
        out["dc_updates"] = gs0["dc_updates"]
        out["samples_applied"] = gs0["samples_applied"]
        out.update({k: v for k, v in gs0.items() if "staleness" in k or k.startswith("updates_at")})
    return out


def _samples(node, topo, result: dict, served: dict) -> int:
    """The samples the final model has seen: every worker's; after a loss, plus those the
    lost workers trained before it, or under MixedSync (whose datacenters are each at their own
    step) the weights of every deposit the global servers applied (``served``: the servers'
    part of the summary)."""
    if result.get("failures") and "samples_applied" in served:
        return served["samples_applied"]
    return node.samples * topo.num_workers + node.samples_of_lost


def time_split(per_rank: list[dict]) -> dict[str, float]:
    """Where a worker's time went, averaged over workers: compute (forward and backward),
    WAN wait (what its local server waited on the global tier, emulated holds included),
    LAN wait (the rest of its wait on the local server) and other (optimizer steps, data,
    evaluation). The ``*_held_s`` figures are the emulated links' share of the waits."""

    def mean(role: str, key: str) -> float:
        vals = [r[key] for r in per_rank if r["role"] == role]
        return sum(vals) / len(vals) if vals else 0.0

    compute, wall = mean("WORKER", "compute_s"), mean("WORKER", "wall_s")
    wan = mean("LOCAL_SERVER", "wan_wait_s")
    lan = max(0.0, mean("WORKER", "lan_wait_s") - wan)
    return {
        "compute_s": compute,
        "lan_wait_s": lan,
        "wan_wait_s": wan,
        "wan_held_s": mean("LOCAL_SERVER", "wan_held_s"),
        "lan_held_s": mean("LOCAL_SERVER", "lan_held_s"),
        "other_s": max(0.0, wall - compute - lan - wan),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. ``--help`` works without mpirun; everything else runs under it. Without an
    MPI library this module cannot be imported: :func:`geompi.runtime.main_needing_mpi`
    answers then."""
    install_excepthook()
    try:
        cfg = make_config(sys.argv[1:] if argv is None else argv)
    except GeompiError as e:  # identical on every rank, and before MPI starts
        exit_together(e, launcher_rank())
    summary = train(cfg)
    return 1 if summary is not None and summary.get("checkpoint_failed") else 0

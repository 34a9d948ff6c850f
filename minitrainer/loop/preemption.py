"""Stop signals: in the loop, SIGTERM, SIGUSR1 (SLURM's warning before a kill), SIGINT (Ctrl-C) and the loss of
the launcher ask for a full state after the step, then a stop (``PreemptionFlag``); before it, where there is
nothing to save, the same signals stop start-up at once, saying where (``StopBeforeTraining``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from minitrainer.common.exits import EXIT_FAILED, exit_process, stopped_line
from minitrainer.common.log import logger


class PreemptionFlag:
    """SIGTERM/SIGUSR1 (SLURM's warning before a kill) and SIGINT (Ctrl-C) ask for a checkpoint at the end
    of the step; so does the launcher's death.

    * Ctrl-C reaches torchrun, which passes SIGINT to every rank; a second Ctrl-C makes torchrun send
      SIGTERM. So after a SIGINT either signal kills this rank at once, unsaved (torchrun's report then
      names the signal). After SIGTERM or SIGUSR1 a repeat is the same request delivered twice (SLURM
      signals torchrun and the ranks, and torchrun forwards): the save goes on.
    * Under torchrun, a rank whose launcher is gone (killed with SIGKILL: it could pass on no signal) is
      an orphan that would train on, holding the output folder's lock and the devices. A thread notices
      within ``poll_s`` seconds that the parent changed and asks for the same save-and-stop; a rank that
      has not stopped ``orphan_grace_s`` later (a step and a full-state save take less) exits unsaved.
    * Unless a peer rank is already dead: then no checkpoint can be written (it is a collective), and
      the signal is torchrun ending the job after that rank died. This rank then exits at once,
      naming the lost rank, rather than waiting in a collective until torchrun kills it 30 s later
      (with NCCL, a collective whose peer died waits for the collective timeout; with gloo, so does one
      whose peer's connection a forked child of that peer still holds). A thread receives the signal
      too, as the main thread runs no handler while it waits there.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, lost_ranks: Callable[[], list[str]] = list, *, poll_s: float = 1.0,
                 orphan_grace_s: float = 300.0) -> None:
        self.requested = False
        self._signalled = False
        self._lost_ranks = lost_ranks
        self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        self._exiting = threading.Lock()
        # The handler runs on the main thread, between two Python instructions: not while it waits in a
        # collective (native code) for a peer that is gone, which lasts until torchrun's SIGKILL 30 s later,
        # or the collective timeout. The signal's number reaches this pipe at once, wherever the main thread is.
        self._signals_in, self._signals_out = os.pipe()
        os.set_blocking(self._signals_out, False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._signals_out, warn_on_full_buffer=False)
        threading.Thread(target=self._watch_signals, daemon=True, name="signal-watch").start()
        self._stop_watching = threading.Event()
        if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun: our parent is the launcher
            parent = os.getppid()
            threading.Thread(target=self._watch_launcher, args=(parent, poll_s, orphan_grace_s), daemon=True,
                             name="launcher-watch").start()

    def __enter__(self) -> PreemptionFlag:
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self._exit_if_a_peer_is_gone(name)
        if signum == signal.SIGINT and not self._signalled:
            # A second Ctrl-C (torchrun passes it on as SIGTERM) must stop at once, even inside a collective
            # waiting for a peer, where no Python handler runs: the signals' default action does that.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
        if not self._signalled:
            self._signalled = True
            logger.warning("received %s: will checkpoint and exit after this step%s", name,
                           " (Ctrl-C again to stop at once, unsaved)" if signum == signal.SIGINT else "")
        self.requested = True

    def _exit_if_a_peer_is_gone(self, signal_name: str) -> None:
        lost = self._lost_ranks()
        # One of the two threads that saw the signal says it; the other goes on until the process ends.
        if lost and self._exiting.acquire(blocking=False):
            logger.error("received %s after %s is gone (it stopped on its own error, or was killed, e.g. by the "
                         "out-of-memory killer): exiting; rerun the same command to resume from the newest full "
                         "state", signal_name, ", ".join(lost))
            exit_process(EXIT_FAILED)

    def _watch_signals(self) -> None:
        with open(self._signals_in, "rb", buffering=0) as signals:
            while received := signals.read(64):  # b"" once restore() has closed the other end
                for signum in received:
                    if signum in self.SIGNALS:
                        self._exit_if_a_peer_is_gone(signal.Signals(signum).name)

    def _watch_launcher(self, parent: int, poll_s: float, orphan_grace_s: float) -> None:
        while not self._stop_watching.wait(poll_s):
            if os.getppid() != parent:
                logger.warning("the launcher (torchrun, pid %d) is gone: will checkpoint and exit after this step",
                               parent)
                self.requested = True
                # Still here after the grace: the main thread waits in a collective for a peer that is gone
                # too (no Python runs there, and gloo may wait for the whole collective timeout).
                if not self._stop_watching.wait(orphan_grace_s):
                    logger.error("the launcher (torchrun, pid %d) is gone and this rank did not stop within %.0f s "
                                 "(waiting for a peer that is gone): exiting unsaved; rerun the same command to "
                                 "resume from the newest full state", parent, orphan_grace_s)
                    exit_process(EXIT_FAILED)
                return

    def restore(self) -> None:
        self._stop_watching.set()
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        os.close(self._signals_out)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Stopped(BaseException):
    """A stop signal before the first step (``StopBeforeTraining``). A ``BaseException``, as KeyboardInterrupt is:
    the ``except Exception`` of start-up code that reports or retries must not hold it."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class StopBeforeTraining:
    """SIGTERM, SIGUSR1 and SIGINT while the run sets up (loading, tokenizing, the reference pass): ``Stopped``,
    whose line says in which phase (``exits.stopping_phase``) and that the same command starts again.

    * A repeated SIGTERM or SIGUSR1 is the same request delivered twice (SLURM signals torchrun and the ranks, and
      torchrun forwards): the stop goes on. After SIGINT, a second Ctrl-C (torchrun sends it on as SIGTERM)
      ends the rank at once, as it does in the loop.
    * A child forked meanwhile (a tokenizing worker, a loader worker before it ignores the signals) inherits the
      handler: there it does what the signal does without us, so ``Pool.terminate`` still ends its workers.
    * An exception raised after a signal arrived (a peer that stopped first broke a collective) is that stop.
    * On the way out, SIGTERM and SIGUSR1 are ignored: the request delivered again must not end the rank before
      it has recorded how it stopped (torchrun's SIGKILL still ends one that hangs).
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self._line: str | None = None
        self._pid = os.getpid()
        self._previous = {}

    def __enter__(self) -> StopBeforeTraining:
        self._previous = {sig: signal.signal(sig, self._handle) for sig in PreemptionFlag.SIGNALS}
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self._line is None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1) if self.received != "SIGINT" else (signal.SIGUSR1,):
            signal.signal(sig, signal.SIG_IGN)
        if not isinstance(error, Stopped):  # something held it (or failed after it): the stop stands
            raise Stopped(self._line) from error

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is not None:
            return
        self.received = signal.Signals(signum).name
        self._line = stopped_line(self.received)
        if signum == signal.SIGINT:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
        raise Stopped(self._line)

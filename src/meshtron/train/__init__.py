"""Training: the loop (trainer.py) and the services it runs (optimizer: AdamW in optim.py, Muon with its
owners' exchange in muon.py and muon_exchange.py; checkpoints, metrics, records, evaluation, faults). The errors a run reports to its user are defined here, free of torch, so that the
command line can name them without importing the training code; and Ctrl-C's handler, whose state
the loop asks when a step fails."""

import signal

from meshtron.utils.words import plural


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the message says which steps and what was non-finite."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended training after `completed` steps."""

    def __init__(self, completed: int):
        super().__init__(f"interrupted after {plural(completed, 'complete step')}")
        self.completed = completed


_sigints: list[int] = []  # the SIGINTs this process took since catch_sigint (at most one raises)


def catch_sigint() -> None:
    """From now on the first SIGINT raises KeyboardInterrupt, as Python's own handler does, and later ones
    are ignored: torch's launcher forwards the terminal's Ctrl-C to the ranks again, and a second one in
    the middle of the first's clean-up would end it with a traceback. A process started with SIGINT
    ignored (a script's background job) keeps ignoring it, as Python itself does."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return

    def first_only(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _sigints.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, first_only)


def sigint_received() -> bool:
    """Whether this process took a SIGINT: whatever ends a step after it is the interrupt's doing (a
    checkpoint save wraps the KeyboardInterrupt in its own exception; a peer gone from a collective
    raises in the others)."""
    return bool(_sigints)

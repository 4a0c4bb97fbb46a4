"""Training: the loop (trainer.py) and the services it runs (optimizer, checkpoints, metrics, records,
evaluation, faults). The errors a run reports to its user are defined here, free of torch, so that the
command line can name them without importing the training code."""

from meshtron.words import plural


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit this model; the message says what to do."""


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row; the message says which steps and what was non-finite."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) ended training after `completed` steps."""

    def __init__(self, completed: int):
        super().__init__(f"interrupted after {plural(completed, 'complete step')}")
        self.completed = completed

"""Asynchronous checkpoints (`checkpoint.async = true`): training goes on while the files are written.

A save, on every rank:

  1  wait     for the previous save to be published (at most one in flight)
  2  check    the state for inf/NaN (collective on the job, as a synchronous save does)
  3  stage    copy exactly the values this rank saves into host memory (`_stage`): the only part
              that stalls training, one copy of the rank's share of the model and optimizer state
  4  write    DCP writes the staged copy in a background thread, its collectives on a gloo group of its
              own (comm/mesh.py `checkpoint_group`): the training step's groups are never shared by two
              threads, and NCCL jobs get the CPU group DCP needs
  5  publish  in a second background thread, once the write has finished: the manifest, the rename
              from `step-N.tmp` to `step-N`, the oldest checkpoints pruned (save_load.py `publish`,
              the synchronous save's own steps, on the same gloo group)

A crash or kill during 4 or 5 leaves `step-N.tmp`, which resuming ignores: the previous checkpoint stays
the newest complete one, as with a synchronous save. The run waits for the last save before it ends
(`wait`). Host memory: one staged copy of the rank's state while a save is in flight.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from meshtron.checkpoint.blocks import BlockSavePlanner
from meshtron.checkpoint.save_load import SaveRequest, prepare_save, publish
from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup


class AsyncCheckpointer:
    """This rank's asynchronous saves; `group` spans every rank on a gloo process group of its own."""

    def __init__(self, group: CommGroup, timeout_s: float):
        self.group = group
        self.comm = Comm(timeout_s)
        self.comm.timed = False  # its waits are not the training step's (comm/timing.py)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, request: SaveRequest) -> float:
        """Collective: stage this rank's state and start writing it; returns the seconds training
        stalled (waiting for the previous save included)."""
        start = time.perf_counter()
        self.wait()
        tmp, state, blocks = prepare_save(request)
        planner, pg = BlockSavePlanner(blocks), self.group.process_group
        staged = _stage(state)
        written = dcp.async_save(
            staged, checkpoint_id=str(tmp), planner=planner, process_group=pg, async_stager=_Staged()
        )

        def finish() -> None:
            try:
                _result(written)
                publish(tmp, request, self.comm, self.group)
            except BaseException as err:  # noqa: BLE001 - raised in the training thread by `wait`
                self._error = err

        self._thread = threading.Thread(target=finish, name="meshtron-checkpoint", daemon=True)
        self._thread.start()
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise what went wrong in it."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _stage(state: Any) -> Any:
    """A host copy of exactly the state's values: DCP's default stager copies each tensor's whole
    storage (all of a flat buffer for one parameter's rows) and cannot copy a DTensor over views of
    one; a DTensor is staged as a copy of its local block, placed as before."""
    if isinstance(state, dict):
        return {k: _stage(v) for k, v in state.items()}
    if isinstance(state, DTensor):
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local,
            state.device_mesh,
            state.placements,
            run_check=False,
            shape=state.shape,
            stride=state.stride(),
        )
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state


class _Staged:
    """DCP's AsyncStager for a state staged already (`_stage`): hands it on as it is."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _result(written: Any) -> None:
    """Wait for DCP's write (a Future, or an AsyncSaveResponse holding one in newer torch)."""
    future = written if isinstance(written, Future) else written.upload_completion
    future.result()

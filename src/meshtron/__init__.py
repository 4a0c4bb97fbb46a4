"""meshtron: Llama-family training with every parallelism composed on one device mesh.

The packages are the layers, lowest first (tests/test_architecture.py states them, README draws them).

Process-wide state. Everything a run works with is passed explicitly (the config, the mesh and its
groups, the communication layer, the engine), except what this table lists, each with the reason it
cannot be an argument. tests/test_architecture.py fails on a module-level mutable object not listed.

  state (module)                     holds                                 why it is process-wide
  TIMES (comm/timing.py)             compute seconds per phase and waits   read inside collectives and autograd
                                     per group, since the last read        functions that torch calls, which
                                                                           have no handle on the step; one
                                                                           training step runs at a time
  _RECORDER (comm/record.py)         the last collectives of this rank     one per process: a daemon thread
                                                                           publishes it to the job's store for
                                                                           every rank's hang message
  SAVED_GATHERS (comm/saved_gathers) gathered tensors backward regathers   torch's saved-tensor hooks are
                                                                           process-wide
  LANE, IN_PLACE (comm/),            per-thread flags: the pipeline pair   torch calls these from autograd
  _LOAD_COUNTING (models/moe.py),    lane; in-place reduction; whether a   (forward, backward, recompute) in
  _RERUN (models/rerun.py),          forward counts expert loads; inside   the thread that runs it; per thread
  _REGION (parallel/recompute.py),   a recompute; inside the attention     as torch's own grad mode is, since a
  _ACTIVE (pipeline/zero_bubble.py), core; deferred weight gradients; the  DualPipeV pair runs two threads
  SavedGathers.depth,                hooks entered; the collective outputs
  _STATE (comm/kept_outputs.py)      a recompute keeps
  _SIDE_STREAMS (pipeline/pairs.py)  one CUDA side stream per device       streams are per device, not per run
  _MEMO, _MEASURED_AGAIN             the MFU reference measured in this    a test process builds hundreds of
  (probe/peak.py)                    process                               trainers; measuring is seconds each
  _sigints (train/__init__.py)       the SIGINTs this process took         a signal handler has no arguments
  _WORKER_TOKENIZER (data/encode.py) the tokenizer of a pool worker        set once per worker process
  Memo objects (plan/)               the planner's per-stage sums          pure functions of their keys: a
                                                                           cache, never a result's input
  _MESHES, _SINGLE_DEVICE,           meshes, single-device references and  the test workers live across tests;
  _TRAINERS (testing/parity.py)      each mesh's last trainer, kept alive  a trainer's in-flight collectives
                                     in a worker                           are waited before its mesh is reused
"""

__version__ = "0.1.0"

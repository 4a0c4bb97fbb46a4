"""Communication: the only package that calls torch.distributed collectives.

collectives.py  `Comm`: every collective, counted (bytes, calls per group and step) and waited on with
                a deadline; the traced gather torch.compile buckets
autograd.py     the collectives' autograd rules (all_gather <-> reduce_scatter, Megatron's f and g)
pending.py      handles of asynchronous collectives, waited on later
pairwise.py     gloo's all-gathers and all-to-alls as batches of point-to-point messages
record.py       the flight recorder (the last collectives of each rank) and CommStats
saved_gathers.py  gathered tensors that backward gathers again instead of keeping
mesh.py         ParallelMesh: a layout's DeviceMeshes and process groups
timing.py       the phase clock: compute time per phase and waits per group
workers.py      a pool of long-lived gloo worker processes (tests, the probe, `meshtron verify`)
"""

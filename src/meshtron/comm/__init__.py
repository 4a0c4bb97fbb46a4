"""Communication: the only package that calls torch.distributed collectives.

group.py          CommGroup (a named process group) and the timeout a collective raises
counted.py        the collectives themselves, counted (bytes and calls per group and step) and waited
                  on with a deadline, in the main or the pair lane
collectives.py    `Comm`: the counted collectives plus the differentiable ones (the table of rules),
                  and the traced gather torch.compile buckets
autograd.py       the differentiable collectives' autograd rules (all_gather <-> reduce_scatter, f and g)
pending.py        handles of asynchronous collectives, waited on later
pairwise.py       gloo's all-gathers and all-to-alls as batches of point-to-point messages
record.py         the flight recorder (the last collectives of each rank) and CommStats
saved_gathers.py  gathered tensors that backward gathers again instead of keeping
mesh.py           ParallelMesh: a layout's DeviceMeshes and process groups
timing.py         the phase clock: compute time per phase and waits per group
workers.py        a pool of long-lived gloo worker processes (tests, the probe, `meshtron verify`)
"""

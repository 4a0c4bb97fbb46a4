"""Pipeline schedules as data, torch-free: which rank runs which action on which micro-batch, in what
order, and how the layers split into stages. The runtime that executes them is pipeline/.

actions.py  chunks on ranks, and the actions (F, B, W, send, recv) a schedule is made of
build.py    GPipe, 1F1B, interleaved 1F1B, zero-bubble; the sends and receives; the simulator
v_shape.py  the V schedules: ZB-V and DualPipeV
split.py    layers into stages (even, or by cost with balance.py's measured costs)
balance.py  per-layer cost for `parallel.pp_balance = "cost"`
"""

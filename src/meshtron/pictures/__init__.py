"""Every picture meshtron draws; the only package that imports matplotlib (when a picture is drawn).

figures.py    headless pyplot and saving a figure
mesh.py       the device mesh (`meshtron mesh`)
pipeline.py   a schedule's timeline (`meshtron schedule`, the run's pipeline.png)
context.py    the zigzag split and ring steps (`meshtron context`)
documents.py  the ring steps documents let context parallel skip (`meshtron context --documents`)
loss.py       a run's loss curve (loss.png)
experts.py    tokens per expert over a run (expert_load.png)
"""

"""The pipeline runtime: a schedule's actions (schedules/) executed on this rank's model chunks.

runtime.py      PipelineRuntime: a step's actions, sends and receives posted ahead, evaluation's forwards
chunk.py        a rank's model chunks: which modules each holds, a chunk's forward
zero_bubble.py  the split backward: input gradients now, weight gradients deferred
pairs.py        DualPipeV's F&B pairs: one micro-batch's forward beside another's backward
"""

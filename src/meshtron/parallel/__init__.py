"""parallelize: the parallelisms applied to a model, one visible step each (parallelize.py).

parallelize.py    the steps in order, and the ParallelModel record they return
tensor.py         tensor and sequence parallel: the declarative plan of how each module is cut
context.py        context parallel: ring, all-gather, all-to-all (Ulysses) and hybrid exchanges
context_latent.py ...of multi-head latent attention's latents instead of its keys and values
expert.py         expert parallel: experts spread over ep ranks, tokens dispatched to them
data_parallel.py  which data-parallel engine (engines/) a layout gets
float8.py         float8 projections, their amax reductions over tensor parallel
recompute.py      activation recompute: full, selective, per operation
compile.py        torch.compile of each block
regions.py        where each rank's tensors sit in the logical ones (initialisation, loading)
"""

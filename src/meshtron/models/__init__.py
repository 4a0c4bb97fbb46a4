"""The model: ordinary single-device modules that the parallelisms cut and wrap (never the other way).

llama.py               the decoder: blocks, embedding, head, the decoding cache, build on the meta device
attention.py           grouped-query attention and the causal attention every attention calls
latent_attention.py    multi-head latent attention (DeepSeek-V2/V3) and its latent decoding cache
rope.py                rotary embedding: llama3 and YaRN scaling, halves and interleaved pairs
moe.py                 mixture of experts: routers (DeepSeek-V3's too), grouped experts, balancing losses
mtp.py                 multi-token prediction (DeepSeek-V3): depth modules and their shifted inputs
layers.py              RMSNorm, SwiGLU, dtypes
blockwise_attention.py attention block by block with its log-sum-exp (context parallel, document masks)
block_positions.py     a block's positions as runs, known on the host
documents.py           packed windows as documents; what a micro-batch carries besides its tokens
loss.py                the loss of a micro-batch in a step, as every layout forms it
float8.py              float8 linear layers (scales, casts, the emulated matmul)
init.py                layout-independent initial values, region by region
generate.py            decoding with a cache
"""

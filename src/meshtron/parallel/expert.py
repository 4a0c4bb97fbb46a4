"""Expert parallel: the experts of every MoE layer spread over the ep ranks, tokens sent to them.

The ep ranks are borrowed from dp_shard x cp (comm/mesh.py re-reads that block as [edp, ep]): each rank of an
ep group holds E/ep consecutive experts and its own tokens. A forward of an MoE layer (models/moe.py
routes and keeps; this module moves the tokens):

  alltoall   (`parallel.ep_dispatch`, the default)
    1  sort this rank's kept assignments by expert (stable): the rows for each ep rank are contiguous
    2  all-gather the per-expert counts [ep, E]: every rank learns what it sends and receives
    3  all-to-all the token rows and their gate values (uneven splits), regroup what arrived by local
       expert
    4  local experts as one grouped matmul, each row's gate folded into its SwiGLU (models/moe.py)
    5  the reverse all-to-all of the weighted outputs, summed per token in fp32
    with a capacity C per expert (`slots`): every expert gets C rows from each rank, the kept
    assignments in slots found on the device and zeros in the rest, so both all-to-alls are even and
    nothing is read on the host (no counts, no sort by size): GShard's dispatch, at the cost of the
    empty slots' bytes and FLOPs
  dedup      (each token once per rank, as DeepEP's dispatch)
    1  which ranks hold one or more of each token's kept experts, and its gate for each of their experts
    2  all-gather the per-rank row counts [ep, ep]
    3  all-to-all each (token, rank) row once, with its gates and which experts it chose (uneven)
    4  local experts as one grouped matmul, each assignment's gate folded into its SwiGLU; each row's
       outputs summed on the expert's rank
    5  the reverse all-to-all (one row per token and rank), summed per token in fp32
    the dispatch's rows per token are the distinct ranks of its experts, at most top_k and, under
    group-limited routing whose groups are ranks (n_expert_groups = ep), at most topk_expert_groups;
    the combine's row is a partial sum in the tokens' dtype (bf16 under autocast, as DeepEP's). A
    capacity drops the same assignments (decided before the exchange); the exchange stays uneven
  hierarchical  (DeepEP's two hops, for an ep group spanning nodes of `run.gpus_per_node` ranks)
    1  dedup over the nodes: each token once to every node holding one or more of its experts, to the
       rank at this rank's index there (`ep_inter`: the network), with its gates for all that node's experts
    2  dedup inside the node (`ep_intra`: NVLink): each arrived row once to each rank holding its experts
    3  the partial sums back inside the node, then one row per token and node over the network
    a token crosses the network at most once per node, and under group-limited routing whose groups are
    the nodes, to at most topk_expert_groups nodes
  allgather
    1  all-gather every rank's tokens, gate values, expert ids and keep mask over ep
    2  each rank runs its experts on the assignments routed to them (gates folded in) and sums them per
       token (fp32)
    3  reduce-scatter: each rank gets back its own tokens' sums
       (moves ep times the tokens but never waits on counts; better when top_k is large against ep)

Both are exact: the same assignments reach the same experts as on one device. Backward runs the
exchanges in reverse (comm/autograd.py's rules), so an expert's gradient sums the contributions of the
tokens every ep rank sent it. Capacity is decided before the exchange, on each rank's own micro-batch.

With tensor parallel, `parallel.etp` says how experts meet tp (the experts' grid, config/layout.py):
etp = tp (default) splits every expert's FFN over tp as the dense FFN, and the ep groups (one per tp
rank) exchange among ranks with the same tp coordinate. etp = 1 keeps experts whole and lets ep take tp
ranks too, as Megatron-Core's MoE parallel folding does (tp 2 x dp 16 for attention, ep 32 for the
experts): the tp ranks hold the same gathered tokens, so each sends its own 1/tp of them (`TokenShare`)
to its ep group, and tensor parallel's exit sums the shares with the shared experts' partial output.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.comm.collectives import Comm
from meshtron.comm.group import CommGroup
from meshtron.comm.kept_outputs import reusable
from meshtron.config.schema import EpDispatch
from meshtron.models.llama import Transformer
from meshtron.models.moe import (
    GroupedExperts,
    MoE,
    Routing,
    compute_dtype,
    counts_of,
    local_dispatch,
    put_rows,
    sort_by_expert,
    sum_rows,
    take_rows,
)


def expert_parameter_names(model: nn.Module) -> frozenset[str]:
    """The stacked expert weights: placed by expert parallel, reduced over expert-data-parallel."""
    return frozenset(
        f"{module_name}.{name}"
        for module_name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for name, _ in module.named_parameters()
    )


class ExpertDispatch:
    """What `MoE.dispatch` is called with: (moe, x [T,D], its Routing) -> this rank's tokens' combined
    expert outputs [T,D] in fp32, over the ep group."""

    def __init__(self, comm: Comm, ep: CommGroup):
        self.comm, self.ep = comm, ep


class AllToAllDispatch(ExpertDispatch):
    """Tokens to the ep ranks holding their experts and back, with uneven all-to-alls."""

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        weights_Tk, experts_Tk, keep_Tk, capacity = routing
        n, me, local = self.ep.size, self.ep.rank, moe.local_experts
        if capacity is not None:
            return self.slots(moe, x_TD, weights_Tk, experts_Tk, keep_Tk, capacity)
        order, counts_G = sort_by_expert(experts_Tk, keep_Tk, moe.first_expert - me * local, n * local)
        token_N = order // moe.top_k
        with reusable("dispatch"):  # a per-op recompute's rerun takes what arrived here from its store
            table = self.comm.all_gather_tensor(counts_G, self.ep).view(n, n, local)  # [source, dest, expert]
            received_SE = table[:, me]
            # The uneven all-to-all takes its split sizes on the host: the layer's one read of the device.
            sent, received = torch.stack([table[me].sum(-1), received_SE.sum(-1)]).tolist()
            x_MD = self.comm.all_to_all_v(compute_dtype(x_TD)[token_N], self.ep, received, sent)
            gates_M1 = self.comm.all_to_all_v(weights_Tk.flatten()[order, None], self.ep, received, sent)
        experts_M = torch.arange(local, device=x_MD.device).repeat(n)  # rows by (source, local expert)
        expert_M = experts_M.repeat_interleave(received_SE.flatten(), output_size=x_MD.shape[0])
        by_expert = torch.argsort(expert_M, stable=True)
        y_MD = moe.experts(x_MD[by_expert], received_SE.sum(0), gates_M1[by_expert, 0])
        y_ND = self.comm.all_to_all_v(put_rows(y_MD, by_expert), self.ep, sent, received)
        return sum_rows(y_ND, token_N, x_TD.shape[0])

    def slots(
        self,
        moe: MoE,
        x_TD: torch.Tensor,
        weights_Tk: torch.Tensor,
        experts_Tk: torch.Tensor,
        keep_Tk: torch.Tensor,
        capacity: int,
    ) -> torch.Tensor:
        """With a capacity C, every expert of the ep group gets C rows from each rank, the kept assignments
        in them and zeros in the rest: one even all-to-all each way, nothing read on the host."""
        n, me, local = self.ep.size, self.ep.rank, moe.local_experts
        slot_A = capacity_slots(experts_Tk, keep_Tk, moe.first_expert - me * local, n * local, capacity)
        rows = n * local * capacity  # slot `rows` takes every assignment not sent here, then is dropped
        tokens, top_k = x_TD.shape[0], moe.top_k
        # Each slot's token (the zero row `tokens` for an empty one): a gather, which saves only its ids.
        token_R = torch.full((rows + 1,), tokens, device=x_TD.device)
        token_R[slot_A] = torch.arange(tokens * top_k, device=x_TD.device) // top_k
        x_TD = compute_dtype(x_TD)
        x_RD = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])[token_R[:rows]]
        # Each slot's gate value (0 in an empty one; the dropped slot `rows` takes the rest).
        gates_R = weights_Tk.new_zeros(rows + 1).index_put((slot_A,), weights_Tk.flatten())[:rows]
        # [dest rank, local expert, slot] -> [source rank, local expert, slot] -> [local expert, rows]
        with reusable("dispatch"):
            x_SLCD = self.comm.all_to_all(x_RD, self.ep, 0, 0).view(n, local, capacity, -1)
            gates_SLC = self.comm.all_to_all(gates_R[:, None], self.ep, 0, 0).view(n, local, capacity)
        gates_LM = gates_SLC.transpose(0, 1).reshape(local, n * capacity)
        y_LMD = moe.experts(x_SLCD.transpose(0, 1).reshape(local, n * capacity, -1), None, gates_LM)
        y_SLCD = y_LMD.view(local, n, capacity, -1).transpose(0, 1).reshape(rows, -1)
        y_RD = self.comm.all_to_all(y_SLCD, self.ep, 0, 0)
        y_AD = take_rows(torch.cat([y_RD, y_RD.new_zeros(1, y_RD.shape[1])]), slot_A)
        return y_AD.to(torch.promote_types(y_AD.dtype, torch.float32)).view(*weights_Tk.shape, -1).sum(1)


class PerRankDispatch(ExpertDispatch):
    """Each token sent once to every ep rank that holds one or more of its experts (DeepEP's dispatch),
    with its gate value for each of that rank's experts; the rank sums its experts' weighted outputs and
    sends one row back per token. Under group-limited routing whose groups are the ep ranks (or sets of
    them), a token reaches at most `topk_expert_groups` groups."""

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        n, local = self.ep.size, moe.local_experts
        gates_TnL, chosen_TnL = rank_gates(routing, moe.first_expert - self.ep.rank * local, n, local)
        return send_once_per_rank(self.comm, self.ep, x_TD, gates_TnL, chosen_TnL, weighted_experts(moe))


class NodeDispatch(ExpertDispatch):
    """DeepEP's two hops, for an ep group spanning nodes: each token crosses the network once to every
    node holding one or more of its experts (to the rank at this rank's index there, `ep_inter`, with its
    gates for all of that node's experts), which sends it once to each rank of its node holding some of
    them (`ep_intra`, the dedup dispatch inside the node); the partial sums come back the same way, one
    row per token and rank inside the node, then one per token and node over the network."""

    def __init__(self, comm: Comm, ep: CommGroup, intra: CommGroup, inter: CommGroup):
        super().__init__(comm, ep)
        self.intra, self.inter = intra, inter

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        per_node, local = self.intra.size, moe.local_experts
        first = moe.first_expert - self.ep.rank * local  # ep ranks are node-major: index node·per_node + i
        gates_TNX, chosen_TNX = rank_gates(routing, first, self.inter.size, per_node * local)
        leaf = weighted_experts(moe)

        def on_node(x_MD: torch.Tensor, gates_MX: torch.Tensor, chosen_MX: torch.Tensor) -> torch.Tensor:
            gates_MiL, chosen_MiL = (t.view(-1, per_node, local) for t in (gates_MX, chosen_MX))
            return send_once_per_rank(self.comm, self.intra, x_MD, gates_MiL, chosen_MiL, leaf)

        return send_once_per_rank(self.comm, self.inter, compute_dtype(x_TD), gates_TNX, chosen_TNX, on_node)


Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def send_once_per_rank(
    comm: Comm,
    group: CommGroup,
    x_TD: torch.Tensor,
    gates_TnL: torch.Tensor,
    chosen_TnL: torch.Tensor,
    there_sum: Rows,
) -> torch.Tensor:
    """Each token to every rank of `group` where `chosen_TnL` marks one of its L experts, with its gates for
    them; `there_sum(rows [M,D], gates [M,L], chosen [M,L])` makes each received row's weighted sum there;
    one row back per token and rank, summed per token in fp32 -> [T, D]."""
    n = group.size
    to_rank_Tn = chosen_TnL.any(-1)
    dest_P, token_P = to_rank_Tn.t().nonzero(as_tuple=True)  # by destination rank, then token
    with reusable("dispatch"):
        table = comm.all_gather_tensor(to_rank_Tn.sum(0), group).view(n, n)  # [source, dest]
        sent, received = torch.stack([table[group.rank], table[:, group.rank]]).tolist()

        def there(rows: torch.Tensor) -> torch.Tensor:
            return comm.all_to_all_v(rows, group, received, sent)

        x_MD = there(compute_dtype(x_TD)[token_P])
        gates_ML = there(gates_TnL[token_P, dest_P])
        chosen_ML = there(chosen_TnL[token_P, dest_P].to(torch.uint8)).bool()
    # One row back per token: its weighted sum over the rank's experts, in the tokens' dtype.
    y_MD = there_sum(x_MD, gates_ML, chosen_ML).to(x_MD.dtype)
    return sum_rows(comm.all_to_all_v(y_MD, group, sent, received), token_P, x_TD.shape[0])


def weighted_experts(moe: MoE) -> Rows:
    """The rank's own experts on the rows sent to it, each row's outputs weighted by its gates and summed."""

    def run(x_MD: torch.Tensor, gates_ML: torch.Tensor, chosen_ML: torch.Tensor) -> torch.Tensor:
        expert_A, row_A = chosen_ML.t().nonzero(as_tuple=True)  # assignments by local expert, then row
        y_AD = moe.experts(x_MD[row_A], chosen_ML.sum(0), gates_ML[row_A, expert_A])
        return sum_rows(y_AD, row_A, x_MD.shape[0])

    return run


def rank_gates(routing: Routing, first: int, n: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate values [T, n, L] of each token for each of the n ranks' L experts, 0 where not chosen;
    which are chosen [T, n, L]) over the experts [first, first + n·L), the kept assignments only."""
    weights_Tk, experts_Tk, keep_Tk, _ = routing
    slot_Tk = experts_Tk - first
    mine_Tk = keep_Tk & (slot_Tk >= 0) & (slot_Tk < n * local)
    slot_Tk = torch.where(mine_Tk, slot_Tk, 0)
    T = weights_Tk.shape[0]
    gates = weights_Tk.new_zeros(T, n * local).scatter_add(1, slot_Tk, weights_Tk * mine_Tk)
    chosen = torch.zeros(T, n * local, dtype=torch.int32, device=slot_Tk.device)
    chosen = chosen.scatter_add(1, slot_Tk, mine_Tk.to(torch.int32)) > 0
    return gates.view(T, n, local), chosen.view(T, n, local)


def capacity_slots(
    experts_Tk: torch.Tensor, keep_Tk: torch.Tensor, first: int, n_experts: int, capacity: int
) -> torch.Tensor:
    """[T*k]: each assignment's row in a [n_experts * capacity] buffer (expert-major, kept assignments of
    one expert in token order), or n_experts * capacity for the ones not kept or not among experts
    [first, first + n_experts). On the device throughout: a stable sort, counts, a scatter."""
    local = experts_Tk.flatten() - first
    mine = keep_Tk.flatten() & (local >= 0) & (local < n_experts)
    key = torch.where(mine, local, n_experts)
    order = torch.argsort(key, stable=True)
    counts = counts_of(key, n_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.empty_like(order).scatter_(
        0, order, torch.arange(key.numel(), device=key.device) - starts[key[order]]
    )
    return torch.where(mine, key * capacity + place, n_experts * capacity)


class AllGatherDispatch(ExpertDispatch):
    """Every rank's tokens gathered over ep; each rank's experts' weighted outputs reduce-scattered back."""

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        weights_Tk, experts_Tk, keep_Tk, _ = routing
        with reusable("dispatch"):
            x_all = self.comm.all_gather(compute_dtype(x_TD), self.ep)
            weights_all = self.comm.all_gather(weights_Tk, self.ep)
            experts_all = self.comm.all_gather_tensor(experts_Tk, self.ep)
            keep_all = self.comm.all_gather_tensor(keep_Tk.to(torch.uint8), self.ep).bool()
        order, counts_E = sort_by_expert(experts_all, keep_all, moe.first_expert, moe.local_experts)
        token_N = order // moe.top_k
        y_ND = moe.experts(x_all[token_N], counts_E, weights_all.flatten()[order])
        return self.comm.reduce_scatter(sum_rows(y_ND, token_N, x_all.shape[0]), self.ep)


DISPATCHES: dict[str, type[ExpertDispatch]] = {
    "alltoall": AllToAllDispatch,
    "dedup": PerRankDispatch,
    "allgather": AllGatherDispatch,
}  # and "hierarchical": NodeDispatch, which takes the ep group's node split too


class TokenShare:
    """Under etp = 1 the tp ranks hold the same (gathered) tokens and whole experts: each sends its own
    1/tp of the rows through `inner` (to experts anywhere in its ep group, tp ranks included) and leaves
    zeros in the other rows, which tensor parallel's exit fills by summing the shares."""

    def __init__(self, inner: Callable[..., torch.Tensor], share: int, shares: int):
        self.inner, self.share, self.shares = inner, share, shares

    def __call__(self, moe: MoE, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        n_tokens = x_TD.shape[0]
        start, stop = n_tokens * self.share // self.shares, n_tokens * (self.share + 1) // self.shares
        y_SD = self.inner(moe, x_TD[start:stop], routing.rows(start, stop))
        return F.pad(y_SD, (0, 0, start, n_tokens - stop))


def apply_expert_parallel(
    model: Transformer,
    comm: Comm,
    ep: CommGroup,
    dispatch_by: EpDispatch,
    tp_shares: CommGroup | None = None,
    nodes: tuple[CommGroup, CommGroup] | None = None,
) -> None:
    """The expert-parallel step of `parallelize`: keep this rank's E/ep experts of every MoE layer and
    route tokens to the others by `dispatch_by`. `tp_shares`: under etp = 1, the tp group whose ranks
    each send their own share of the tokens (the ep group may include them). `nodes`: the ep group cut
    by node (intra, inter), for the hierarchical dispatch."""
    shares = tp_shares.size if tp_shares is not None else 1
    if ep.size == 1 and shares == 1:
        return
    if ep.size == 1:
        dispatch: Callable[..., torch.Tensor] = local_dispatch
    elif dispatch_by == "hierarchical":
        if nodes is None:
            raise ValueError(
                "the hierarchical dispatch needs the ep group's node split (ParallelMesh.ep_node_groups)"
            )
        dispatch = NodeDispatch(comm, ep, *nodes)
    else:
        dispatch = DISPATCHES[dispatch_by](comm, ep)
    if shares > 1:
        dispatch = TokenShare(dispatch, tp_shares.rank, shares)
    for _, block in model.blocks():
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        moe.dispatch = dispatch
        if ep.size == 1:
            continue
        experts = moe.experts
        per_rank = moe.local_experts // ep.size
        keep = slice(ep.rank * per_rank, (ep.rank + 1) * per_rank)
        for name, weight in list(experts.named_parameters()):
            setattr(experts, name, nn.Parameter(weight.detach()[keep].clone()))
        moe.first_expert += ep.rank * per_rank
        moe.local_experts = per_rank

"""Gathered tensors that backward gathers again instead of keeping.

An all-gathered tensor that an operator saves for backward costs the whole tensor per micro-batch in
flight, though this rank holds only its shard. Two places gather something an operator then saves:

  gathered                  by                          kept instead          gathered again
  a parameter's rows        SimpleFSDP                   the row block (held   in the backward of each
                            (engines/simple_fsdp.py)     anyway)               operator that saved it
  a norm's output, its      tensor + sequence parallel   the sequence shard    once per tensor-parallel
  sequence shards           (parallel/tensor.py)                               region, shared by the
                                                                               projections that saved it

The second is Megatron's sequence parallel (Korthikanti et al. 2022, section 4.2.2): the column-parallel
projections keep the 1/t sequence shard of their input and all-gather it again in backward, so a
layer's activations are all sequence-sharded, at the cost of one more all-gather per region.

How: while a hooked module runs forward, saved-tensor hooks look up every tensor an operator saves by
its storage; one that lives in a tracked gathered tensor (the tensor itself or a view: a matmul saves
its input reshaped) is stored as a handle with the view's geometry. The first unpack in backward runs
the gather again and the later unpacks of the same tensor share that result; it is dropped when the
last one has been unpacked.

Saved-tensor hooks do not nest (only the innermost pair packs), so the process has one set of hooks
(`SAVED_GATHERS`) that every user tracks into. An activation checkpoint inside a hooked module packs
what it covers with its own hooks, which is what full recompute needs: it keeps nothing of the block.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from meshtron.comm.counted import eager


class _Regather:
    """One tracked gathered tensor's way back: its gather run again at the first unpack, shared by the
    saved views of it until the last of them has been unpacked."""

    def __init__(self, kept: torch.Tensor, gather: Callable[[torch.Tensor], torch.Tensor]):
        self.kept, self.gather = kept, gather
        self.waiting = 0  # packed views not yet unpacked
        self.full: torch.Tensor | None = None

    def view(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        if self.full is None:
            self.full = self.gather(self.kept)
        out = self.full.as_strided(size, stride, offset)  # offsets count from the storage's start
        self.waiting -= 1
        if self.waiting <= 0:
            self.full = None
        return out


class _Depth(threading.local):
    """Per thread, as torch's saved-tensor hooks are (DualPipeV runs a forward in a second thread)."""

    def __init__(self) -> None:
        self.entered: list[Any] = []


class SavedGathers:
    """The saved-tensor hooks that store a tracked gathered tensor's saved views as handles."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[weakref.ref, _Regather]] = {}  # storage pointer -> gathered tensor
        self.depth = _Depth()

    @eager  # host-side bookkeeping: one graph break (comm/counted.py), not one per line
    def track(
        self, gathered: torch.Tensor, kept: torch.Tensor, gather_again: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """From now on while `gathered` lives, a saved view of it is kept as a handle holding `kept` (what
        it was gathered from); `gather_again(kept)` returns a tensor of the same layout (no autograd)."""
        ptr = gathered.untyped_storage().data_ptr()
        regather = _Regather(kept.detach(), gather_again)
        self.live[ptr] = (weakref.ref(gathered, lambda _r, p=ptr: self.live.pop(p, None)), regather)

    @eager  # host-side bookkeeping: one graph break (comm/counted.py), not one per line
    def pack(self, t: torch.Tensor) -> Any:
        found = self.live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if found is None or found[0]() is None:
            return t, t._version  # autograd skips its in-place check under Python hooks: unpack does it
        found[1].waiting += 1
        return (found[1], t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def held(packed: Any) -> torch.Tensor:
        """What a packed value keeps alive: the saved tensor itself, or a handle's shard."""
        return packed[0] if isinstance(packed[0], torch.Tensor) else packed[0].kept

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed[0], torch.Tensor):
            t, version = packed
            if t._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: a {tuple(t.shape)} tensor saved at version {version} is at {t._version}"
                )
            return t
        regather, size, stride, offset = packed
        return regather.view(size, stride, offset)

    def enter(self) -> None:
        """Hooks on (counted: hooked modules nest, as a block inside a hooked model)."""
        if not self.depth.entered:
            hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
            hooks.__enter__()
            self.depth.entered.append(hooks)
        else:
            self.depth.entered.append(None)

    def exit(self) -> None:
        hooks = self.depth.entered.pop()
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def hook(self, module: torch.nn.Module) -> None:
        """The hooks on while `module` runs forward (and off again if it raises)."""
        module.register_forward_pre_hook(lambda _m, _a: self.enter())
        module.register_forward_hook(lambda _m, _a, _o: self.exit(), always_call=True)


SAVED_GATHERS = SavedGathers()


@contextlib.contextmanager
def recording_saves(record: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Saved-tensor hooks that call `record` with what each save keeps alive, for measuring: the saved
    tensor, or for a tracked gathered tensor the shard its handle keeps. They stand in for
    SAVED_GATHERS's own while on, so that saves inside hooked modules are recorded too."""

    def pack(t: torch.Tensor) -> Any:
        packed = SavedGathers.pack(SAVED_GATHERS, t)
        record(SavedGathers.held(packed))
        return packed

    SAVED_GATHERS.pack = pack  # type: ignore[method-assign]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, SavedGathers.unpack):
            yield
    finally:
        del SAVED_GATHERS.pack

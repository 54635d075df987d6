"""Weights on 2 MB pages (Linux transparent huge pages) on a CPU device.

A decode step streams every weight matrix; on 4 KB pages that is a TLB entry every 4 KB, and the page
walks show at memory bandwidth. The KV cache stays on 4 KB pages: it is touched for the first time
as requests fill it, inside steps, and on these virtual machines a 2 MB page met for the first time
can take milliseconds (1 GiB of them touched in a fresh process: 7.2 s, the same again after freeing
it: 0.1-0.2 s); on 2 MB pages SmolLM2's prompt steps stalled up to 2.2 s (10x their price) as they
wrote new KV blocks, while the weights are touched once, at load. Linux backs anonymous memory
with 2 MB pages where asked when its transparent huge pages are in `madvise` mode (the default of many
distributions, and of these machines; `always` needs no asking, `never` gives none). `huge_zeros` maps
anonymous memory, asks for huge pages (madvise MADV_HUGEPAGE) before anything touches it, and hands
it to torch 2 MB-aligned (`torch.frombuffer`: the tensor keeps the mapping alive). `move_to_huge_pages`
re-homes a model's large parameters and buffers there (a copy each), and the tensors its modules keep
outside them (`HoldsTensors`: quantized layers' weights and GGUF blocks, which a decode step streams
as it streams dense weights); `place_on_huge_pages` gives a model's not yet loaded parameters their
huge pages before the load fills them (no copy: the dense weights of a float checkpoint, loaded as
they are). Where the kernel or Python's mmap cannot, nothing changes.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import torch
from torch import nn

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise, never), None where it has none."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether asking for huge pages can get them here."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on memory asked to be backed by 2 MB pages, starting on a 2 MB boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux only)
    try:
        if advice is not None:
            region.madvise(advice)  # before the first touch: the faults then take 2 MB pages
    except OSError:  # (a kernel without transparent huge pages: 4 KB pages, aligned all the same)
        pass
    raw = torch.frombuffer(region, dtype=torch.uint8)  # [nbytes + HUGE_PAGE], untouched, zero when read
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def place_on_huge_pages(model: nn.Module) -> int:
    """Give each parameter and buffer of `model` of a huge page or more that owns its storage fresh
    (zeroed) memory on huge pages, nothing copied: for a model whose tensors are allocated but not
    yet filled, so the load writes each weight once, straight into its final pages, instead of into
    4 KB pages that `move_to_huge_pages` then copies. Returns the bytes placed."""
    total = 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
                    continue
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes < HUGE_PAGE or not owns_storage(tensor) or on_huge_page_boundary(tensor):
                    continue
                fresh = huge_zeros(tensor.shape, tensor.dtype)
                if isinstance(tensor, nn.Parameter):
                    tensor.data = fresh
                else:
                    table[name] = fresh
                total += nbytes
    return total


def on_huge_page_boundary(tensor: torch.Tensor) -> bool:
    """Whether `tensor` starts on a 2 MB boundary: `huge_zeros`' tensors do (torch's allocator's large
    blocks start 64 bytes into their mapping, so others almost never), and are left where they are."""
    return tensor.data_ptr() % HUGE_PAGE == 0


class HoldsTensors(Protocol):
    """A module that keeps tensors outside its parameters and buffers (a quantized layer's weights, a
    table kept in GGUF blocks): it replaces each by fn(tensor) when asked."""

    def map_held_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy each contiguous CPU parameter, buffer and held tensor (`HoldsTensors`) of `model` of a huge
    page or more onto huge pages (a tensor shared by several modules once: they keep sharing it).
    Returns the bytes moved."""
    moved: dict[int, torch.Tensor] = {}  # data_ptr of the old storage -> its copy
    total = 0

    def rehome(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = tensor.data_ptr()
        hit = moved.get(key)
        if hit is not None and hit.shape == tensor.shape and hit.dtype == tensor.dtype:
            return hit  # (the same tensor met again; a view starting where it does is not it)
        nbytes = tensor.numel() * tensor.element_size()
        if (
            tensor.device.type != "cpu"
            or not tensor.is_contiguous()
            or nbytes < HUGE_PAGE
            or not owns_storage(tensor)
            or on_huge_page_boundary(tensor)
        ):
            return tensor  # (small, a view sharing its storage with others, or placed already: left as it is)
        copy = huge_zeros(tensor.shape, tensor.dtype)
        copy.copy_(tensor.detach())
        moved[key] = moved[copy.data_ptr()] = copy  # (a second visit finds the copy)
        total += nbytes
        return copy

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                new = rehome(tensor)
                if new is tensor:
                    continue
                if isinstance(tensor, nn.Parameter):
                    tensor.data = new
                else:
                    table[name] = new
        if callable(getattr(module, "map_held_tensors", None)):
            cast(HoldsTensors, module).map_held_tensors(rehome)
    return total


def owns_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is its whole storage (not a view into a larger one that something else may read)."""
    storage = tensor.untyped_storage()
    return tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()

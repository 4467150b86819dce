"""LoRA adapters on a decoder's projections: a rank's shard of each adapter, and a step's
delta y += s (x A^T) B^T for the tokens of each adapter in it.

Sharding follows the projection the adapter targets (each layer's `lora_shard`, layers.py): a
column-parallel projection keeps A whole and B's rows of this rank; a row-parallel one keeps
A's columns of this rank and B whole, and its partial delta joins the layer's partial sums
before their all-reduce. The parts of a fused projection (q, k, v; gate, up) run as one
product: their A's stacked, their B's on a block diagonal. The scaling s is folded into B.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierserve.workers.backends.base import lora_mask
from tierserve.workers.model.lora_files import AdapterLayout, adapter_weights_file

__all__ = ["LoRAModule", "LoRAAdapter", "LoRAStep", "load_adapter"]


@dataclass(slots=True)
class LoRAModule:
    """One projection's adapter on this rank, transposed (contiguous, as the products read
    them): a_t [in, parts * r] and b_t [parts * r, out], so the output gains (x a_t) b_t."""

    a_t: torch.Tensor
    b_t: torch.Tensor


@dataclass(slots=True)
class LoRAAdapter:
    digest: int
    modules: dict[int, LoRAModule]  # by id() of the projection module
    stack: list | None = None  # its tensors as the layer stack takes them (LoRAStep.stack)


def load_adapter(model, path: str, digest: int, layout: AdapterLayout) -> LoRAAdapter:
    """This rank's shard of the adapter in folder `path` (checked into `layout` by
    lora_files.read_adapter), in the model's dtype and device."""
    from safetensors import safe_open

    parts: dict[int, tuple[object, list]] = {}
    with safe_open(adapter_weights_file(path), framework="pt") as f:
        for (layer, proj), (a_name, b_name) in sorted(layout.modules.items()):
            module, shard = model.lora_target(layer, proj)
            a, b, offset = module.lora_shard(f.get_tensor(a_name).float(),
                                             f.get_tensor(b_name).float() * layout.scaling,
                                             shard)
            parts.setdefault(id(module), (module, []))[1].append((a, b, offset))
    dtype, device = model.dtype, next(model.parameters()).device
    modules = {}
    for key, (module, pieces) in parts.items():
        rank = pieces[0][0].shape[0]
        a = torch.cat([p[0] for p in pieces])
        b = torch.zeros(module.lora_out_features, rank * len(pieces))
        for j, (_, piece, offset) in enumerate(pieces):
            b[offset:offset + piece.shape[0], j * rank:(j + 1) * rank] = piece
        modules[key] = LoRAModule(a.t().to(device, dtype).contiguous(),
                                  b.t().to(device, dtype).contiguous())
    return LoRAAdapter(digest, modules)


class LoRAStep:
    """A step's adapters, for the step's tokens and for the rows a last layer keeps. The
    projections call add(); rows of x are the step's tokens, or the kept rows where x has
    fewer (LlamaModel's last layer).

    One adapter on every row: y += (x A^T) B^T. Several (or some rows on the base model): the
    step's adapters stacked along r, A' and B', each row taking its own adapter's columns
    (Backend.lora_add with offsets and rows): one op a projection however many adapters run.
    The layer stack runs the same op (stack())."""

    _MAX_STACKS = 4  # stacked weights kept for this many recent sets of adapters

    def __init__(self, backend) -> None:
        self.backend = backend  # its lora_add runs the deltas, as the layer stack does
        self.active = False
        self._one: LoRAAdapter | None = None
        self._rows_full: torch.Tensor | None = None  # [T] int64: each token's adapter, -1 none
        self._rows_kept: torch.Tensor | None = None
        self._num_tokens = 0
        # (digests of a set of adapters) -> {id(module): (A', B', offsets, layout) or None,
        # layout: its offsets tensor}
        self._stacks: dict[tuple[int, ...], dict] = {}
        self._stack: dict = {}
        self._adapters: list[LoRAAdapter] = []
        # This step's column masks of each layout of offsets (full rows, kept rows).
        self._masks: dict = {}
        self._dtype = torch.float32

    def begin(self, token_digests: np.ndarray, keep: np.ndarray | None,
              adapters: dict[int, LoRAAdapter], device: torch.device,
              dtype: torch.dtype) -> None:
        """token_digests [T]: each token's adapter digest (0: the base model)."""
        self._num_tokens = len(token_digests)
        self._dtype = dtype
        self._masks = {}
        found, index = np.unique(token_digests, return_inverse=True)
        base = found[0] == 0
        used = found[1:] if base else found
        self.active = len(used) > 0
        if not base and len(found) == 1:
            self._one = adapters[int(found[0])]
            return
        self._one = None
        self._adapters = [adapters[int(d)] for d in used]
        rows = torch.from_numpy((index - 1 if base else index).astype(np.int64)).to(device)
        self._rows_full = rows
        self._rows_kept = rows if keep is None else rows[torch.from_numpy(keep).to(device)]
        key = tuple(int(d) for d in used)
        if key not in self._stacks and len(self._stacks) >= self._MAX_STACKS:
            self._stacks.pop(next(iter(self._stacks)))
        self._stack = self._stacks.setdefault(key, {})

    def stack(self, projections: list) -> tuple[list, torch.Tensor | None,
                                                 torch.Tensor | None]:
        """The step's adapters as the layer stack takes them (backends/stack.py): (a_t, b_t,
        offsets, mask of the step's tokens, mask of the kept rows) on each of `projections`
        (its linears, in its order), flat, and each row's adapter, of the step's tokens and of
        the kept rows (None with one adapter on every row)."""
        one = self._one
        if one is not None:
            if one.stack is None:
                one.stack = [t for p in projections for t in (
                    (one.modules[id(p)].a_t, one.modules[id(p)].b_t, None, None, None)
                    if id(p) in one.modules else (None,) * 5)]
            return one.stack, None, None
        flat = []
        for p in projections:
            stacked = self._stacked(p)
            flat += (None,) * 5 if stacked is None else (*stacked[:3], *self._mask(stacked))
        return flat, self._rows_full, self._rows_kept

    def forget(self, digest: int) -> None:
        """An adapter the rank dropped: its stacked copies go too."""
        for key in [k for k in self._stacks if digest in k]:
            del self._stacks[key]

    def end(self) -> None:
        self.active = False
        self._one, self._adapters, self._rows_full, self._rows_kept = None, [], None, None

    def add(self, module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the projection of x, or this rank's partial sum of it) plus each adapter's
        delta on its rows, in place."""
        if self._one is not None:
            m = self._one.modules.get(id(module))
            return y if m is None else self.backend.lora_add(x, m.a_t, m.b_t, None, None, None,
                                                             y)
        stacked = self._stacked(module)
        if stacked is None:
            return y
        full = x.shape[0] == self._num_tokens
        mask = self._mask(stacked)[0 if full else 1]
        return self.backend.lora_add(x, *stacked[:3], self._rows_full if full
                                     else self._rows_kept, mask, y)

    def _mask(self, stacked) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's column masks (full rows, kept rows) of a layout of offsets, made once a
        step for all the projections that share it."""
        layout = stacked[3]
        masks = self._masks.get(layout)
        if masks is None:
            offsets = stacked[2]
            full = lora_mask(offsets, self._rows_full, self._dtype)
            kept = full if self._rows_kept is self._rows_full else \
                lora_mask(offsets, self._rows_kept, self._dtype)
            masks = self._masks[layout] = (full, kept)
        return masks

    def _stacked(self, module):
        """(A', B', offsets, layout) of the step's adapters on `module`: adapter j's columns
        are offsets[j] .. offsets[j + 1] (none where it has no pair there), layout those
        widths; None where none has a pair there."""
        key = id(module)
        if key not in self._stack:
            pairs = [ad.modules.get(key) for ad in self._adapters]
            layout = tuple(0 if m is None else m.b_t.shape[0] for m in pairs)
            present = [m for m in pairs if m is not None]
            offsets = self._stack.get(layout)  # one tensor per layout: masks are per layout
            if present and offsets is None:
                offsets = self._stack[layout] = torch.tensor(
                    np.concatenate(([0], np.cumsum(layout))), dtype=torch.long,
                    device=present[0].a_t.device)
            self._stack[key] = None if not present else (
                torch.cat([m.a_t for m in present], dim=1).contiguous(),
                torch.cat([m.b_t for m in present]).contiguous(), offsets, layout)
        return self._stack[key]

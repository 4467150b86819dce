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
    stack: list | None = None  # its tensors as the layer stack takes them (stack_tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.modules.values()
                   for t in (m.a_t, m.b_t))


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

    One adapter on every row: y += (x A^T) B^T. Several (or some rows on the base model): one
    product over all of them, y += ((x A'^T) * M) B'^T, A' and B' the step's adapters stacked
    along r and M each row's one-hot adapter spread over its adapter's columns: three ops a
    projection however many adapters run, r times the adapters wide."""

    _MAX_STACKS = 4  # stacked weights kept for this many recent sets of adapters

    def __init__(self, backend) -> None:
        self.backend = backend  # its lora_add runs a lone adapter's delta, as the stack does
        self.active = False
        self._one: LoRAAdapter | None = None
        self._adapters: list[LoRAAdapter] = []
        self._rows_full: torch.Tensor | None = None  # [T, adapters] one-hot
        self._rows_kept: torch.Tensor | None = None
        self._num_tokens = 0
        # (digests of a set of adapters) -> id(module) -> (A', B', column owners) or None
        self._stacks: dict[tuple[int, ...], dict] = {}
        self._stack: dict = {}

    def begin(self, token_digests: np.ndarray, keep: np.ndarray | None,
              adapters: dict[int, LoRAAdapter], device: torch.device, dtype: torch.dtype) -> None:
        """token_digests [T]: each token's adapter digest (0: the base model)."""
        self._num_tokens = len(token_digests)
        found, index = np.unique(token_digests, return_inverse=True)
        base = found[0] == 0
        used = found[1:] if base else found
        self.active = len(used) > 0
        if not base and len(found) == 1:
            self._one = adapters[int(found[0])]
            return
        self._one = None
        self._adapters = [adapters[int(d)] for d in used]
        rows = np.zeros((len(token_digests), len(used)), dtype=np.float32)
        hit = index - base if base else index
        mine = np.flatnonzero(hit >= 0)
        rows[mine, hit[mine]] = 1.0
        full = torch.from_numpy(rows).to(device, dtype)
        self._rows_full = full
        self._rows_kept = full if keep is None else full[torch.from_numpy(keep).to(device)]
        key = tuple(int(d) for d in used)
        if key not in self._stacks and len(self._stacks) >= self._MAX_STACKS:
            self._stacks.pop(next(iter(self._stacks)))
        self._stack = self._stacks.setdefault(key, {})

    @property
    def single(self) -> LoRAAdapter | None:
        """The adapter of every row, where the step has one adapter and no base rows."""
        return self._one

    def stack_tensors(self, projections: list) -> list[torch.Tensor | None]:
        """The lone adapter's (a_t, b_t) on each of `projections` (the layer stack's linears,
        in its order), flat, (None, None) where it has none."""
        one = self._one
        if one.stack is None:
            one.stack = [t for p in projections for t in (
                (one.modules[id(p)].a_t, one.modules[id(p)].b_t) if id(p) in one.modules
                else (None, None))]
        return one.stack

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
            return y if m is None else self.backend.lora_add(x, m.a_t, m.b_t, y)
        stacked = self._stacked(module)
        if stacked is None:
            return y
        a_t, b_t, owners = stacked
        rows = self._rows_full if x.shape[0] == self._num_tokens else self._rows_kept
        xa = x @ a_t
        xa.mul_(rows.index_select(1, owners))
        return y.addmm_(xa, b_t)

    def _stacked(self, module):
        key = id(module)
        if key not in self._stack:
            parts = [(j, ad.modules[key]) for j, ad in enumerate(self._adapters)
                     if key in ad.modules]
            self._stack[key] = None if not parts else (
                torch.cat([m.a_t for _, m in parts], dim=1),
                torch.cat([m.b_t for _, m in parts]),
                torch.cat([torch.full((m.b_t.shape[0],), j, dtype=torch.long)
                           for j, m in parts]).to(parts[0][1].a_t.device))
        return self._stack[key]

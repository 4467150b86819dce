"""The LoRA adapters a rank holds, by digest (LoRARef): an adapter is loaded the step a request
of it first arrives (NewRequestData, the one message that names its folder), and kept while
requests run with it; past `capacity` loaded adapters, the least recently used one that no live
request runs with goes. The engine checked the folder at its door (lora_files.read_adapter), so
a load here meets a good one."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from tierserve.scheduler.messages import NewRequestData
from tierserve.workers.model.lora import LoRAAdapter, load_adapter
from tierserve.workers.model.lora_files import projection_shapes, read_adapter

__all__ = ["LoRAAdapters"]


class LoRAAdapters:
    def __init__(self, model, capacity: int, max_rank: int, device: torch.device) -> None:
        self.model = model
        self.step = model.enable_lora()
        self.capacity = capacity
        self.max_rank = max_rank
        self.device = device
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        c = model.config
        self._shapes = projection_shapes(c.hidden_size, c.num_attention_heads,
                                         c.num_key_value_heads, c.head_dim, c.intermediate_size)

    def admit(self, new_reqs: list[NewRequestData], live: np.ndarray) -> None:
        """Loads the adapters of a step's new requests that this rank lacks; live: the
        digests the batch's requests run with."""
        for new in new_reqs:
            ref = new.lora
            if ref is None:
                continue
            if ref.digest in self.loaded:
                self.loaded.move_to_end(ref.digest)
                continue
            layout = read_adapter(ref.path, num_layers=self.model.config.num_hidden_layers,
                                  shapes=self._shapes, max_rank=self.max_rank)
            self.loaded[ref.digest] = load_adapter(self.model, ref.path, ref.digest, layout)
            self._evict(set(live.tolist()) | {ref.digest})

    def _evict(self, in_use: set[int]) -> None:
        for digest in list(self.loaded):
            if len(self.loaded) <= self.capacity:
                return
            if digest not in in_use:
                del self.loaded[digest]
                self.step.forget(digest)

    def begin(self, token_digests: np.ndarray, keep: torch.Tensor | None) -> bool:
        """Sets the step's adapters per token (and per row of keep, the rows a last layer
        keeps); whether any token runs one."""
        if not token_digests.any():
            return False
        self.step.begin(token_digests, None if keep is None else keep.cpu().numpy(),
                        self.loaded, self.device, self.model.dtype)
        return True

    def end(self) -> None:
        self.step.end()

"""The latent cache of multi-head latent attention (models/deepseek/mla.py): per layer and position only the
normalised kv latent c_kv (kv_lora_rank numbers) and the rotated shared key k_pe (qk_rope_head_dim numbers), not
every head's keys and values. The attention absorbs the key/value up-projection at decode time (MLA._absorbed).

The same interface as kv_cache.py's KVCache to GPT.forward (layer, check_room, advance, length, reset), so
`decode` takes either. Under tensor parallelism every rank holds the whole latent (it is replicated: the heads'
split starts after it). Storage: (b, L, r) and (b, L, rope) per layer, allocated on the first append.
"""

from __future__ import annotations

import torch


class LatentLayerCache:
    """One layer's view of a LatentCache."""

    def __init__(self, cache: LatentCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def append(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.append(self.layer, c_kv, k_pe)

    def mask(self, s: int, total: int, like: torch.Tensor) -> torch.Tensor:
        """(s, total) additive causal mask: new query i (position past + i) sees keys 0 .. past + i."""
        past = self.cache.length
        distance = torch.arange(past, past + s, device=like.device)[:, None] - torch.arange(total, device=like.device)
        return torch.where(distance >= 0, 0.0, float("-inf")).to(like.dtype)


class LatentCache:
    """c_kv and k_pe of every layer for `length` positions; `capacity` bounds the positions it can hold."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"latent cache capacity {capacity} must be positive")
        self.capacity = capacity
        self.length = 0
        self._c: dict[int, torch.Tensor] = {}
        self._k: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> LatentLayerCache:
        return LatentLayerCache(self, index)

    def reset(self) -> None:
        self.length = 0

    def check_room(self, new: int) -> None:
        if self.length + new > self.capacity:
            raise ValueError(f"latent cache holds {self.length} positions; {new} more exceed its capacity "
                             f"{self.capacity} (the model's context)")

    def append(self, layer: int, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv (b, s, r), k_pe (b, s, rope) of positions length .. length + s - 1 -> all of them so far."""
        b, s = c_kv.shape[:2]
        store = self._c.get(layer)
        if store is None or store.shape[0] != b or store.dtype != c_kv.dtype or store.device != c_kv.device:
            store = self._c[layer] = c_kv.new_empty(b, self.capacity, c_kv.shape[-1])
            self._k[layer] = k_pe.new_empty(b, self.capacity, k_pe.shape[-1])
        end = self.length + s
        store[:, self.length:end] = c_kv
        self._k[layer][:, self.length:end] = k_pe
        return store[:, :end], self._k[layer][:, :end]

    def advance(self, new: int) -> None:
        self.length += new

    def bytes_per_token(self) -> int:
        """Bytes one position takes in one sequence's cache, over every layer: (r + rope) x layers x dtype bytes."""
        return sum(c.shape[-1] * c.element_size() + self._k[i].shape[-1] * self._k[i].element_size()
                   for i, c in self._c.items())

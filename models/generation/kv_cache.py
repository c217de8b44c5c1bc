"""A key/value cache for incremental decoding: each layer's keys and values of the positions seen so far.

`GPT.forward(ids, cache=cache)` feeds only the new positions: their queries attend to every cached key plus
their own (causally), and their keys and values are appended. Under tensor parallelism each rank holds the
keys and values of its own n_head / tp heads (what its share of c_attn computes), so the cache needs no
communication: the forward's row-parallel all-reduces are unchanged. Shapes: b batch, h local heads, hd head
dim, L capacity (at most the model's n_positions), s the new positions of one call.

Storage is allocated on the first append of a layer, (b, h, L, hd) in the activations' dtype and device, and
filled in place, so a decoding step copies s positions, not the whole history.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerCache:
    """One layer's view of a KVCache: `append` stores new keys/values and returns all of them so far."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.append(self.layer, k, v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> torch.Tensor:
        """Causal attention of the s new queries (positions past .. past + s - 1) over all past + s keys; with a
        sliding `window`, query position p sees keys p - window + 1 .. p only."""
        past = self.cache.length
        s, total = q.shape[2], k.shape[2]
        if past == 0 and (not window or s <= window):  # the prompt: the ordinary causal mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # query i (absolute position past + i) sees keys 0 .. past + i
        distance = torch.arange(past, past + s, device=q.device)[:, None] - torch.arange(total, device=q.device)
        mask = (distance >= 0) & (distance < window) if window else distance >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class KVCache:
    """Keys and values of every layer for `length` positions; `capacity` bounds the positions it can hold."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"KV cache capacity {capacity} must be positive")
        self.capacity = capacity
        self.length = 0  # positions cached (the same for every layer between forwards)
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self, index)

    def reset(self) -> None:
        """Forget every position (storage is kept for reuse)."""
        self.length = 0

    def check_room(self, new: int) -> None:
        if self.length + new > self.capacity:
            raise ValueError(f"KV cache holds {self.length} positions; {new} more exceed its capacity "
                             f"{self.capacity} (the model's context)")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (b, h, s, hd) of positions length .. length + s - 1 -> all keys/values (b, h, length + s, hd)."""
        b, h, s, hd = k.shape
        store_k = self._k.get(layer)
        if store_k is None or store_k.shape[0] != b or store_k.dtype != k.dtype or store_k.device != k.device:
            store_k = self._k[layer] = k.new_empty(b, h, self.capacity, hd)
            self._v[layer] = v.new_empty(b, h, self.capacity, hd)
        end = self.length + s
        store_k[:, :, self.length:end] = k
        self._v[layer][:, :, self.length:end] = v
        return store_k[:, :, :end], self._v[layer][:, :, :end]

    def bytes_per_token(self) -> int:
        """Bytes one position takes in one sequence's cache on this rank, over every layer: 2 x local heads x
        head dim x layers x dtype bytes."""
        return sum(k.shape[1] * k.shape[3] * k.element_size() * 2 for k in self._k.values())

    def advance(self, new: int) -> None:
        """Called by GPT.forward once every layer has appended `new` positions."""
        self.length += new

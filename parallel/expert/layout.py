"""Which expert-parallel layouts can run: the checks the resolver makes before any process starts.

ep is carved out of dp x cp (Topology: the ep group is ep consecutive grad ranks, the expert-data-parallel group
the (dp x cp) / ep ranks holding the same experts), so it must divide dp x cp, and it splits the routed experts
in contiguous blocks, so it must divide them. Each message names the field, its value and what is valid.
"""

from __future__ import annotations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_expert_parallel(ep: int, dp: int, cp: int, n_experts: int, top_k: int, *, model: str = "the model",
                          shard_group: str = "dp", hpz: bool = False, quantized_gradients: str = "none",
                          optimizer: str = "adamw", lora: bool = False, zero_stage: int = 0) -> None:
    """A ValueError naming the field when parallel.ep (with this model and ZeRO choice) cannot run."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"parallel.ep = {ep!r} is invalid: it must be a positive integer")
    if n_experts and top_k > n_experts:
        raise ValueError(f"model.moe_top_k = {top_k} is larger than model.n_experts = {n_experts}; "
                         f"valid: 1..{n_experts}")
    if ep == 1:
        return
    if not n_experts:
        raise ValueError(f"parallel.ep = {ep} needs a mixture-of-experts model, but {model} is dense "
                         "(model.n_experts = 0); valid: parallel.ep = 1, or an MoE model")
    if n_experts % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide the {n_experts} routed experts of {model} "
                         f"(model.n_experts); valid: {[d for d in _divisors(n_experts) if (dp * cp) % d == 0]}")
    if (dp * cp) % ep:
        raise ValueError(f"parallel.ep = {ep} does not divide parallel.dp x parallel.cp = {dp} x {cp} = {dp * cp} "
                         f"(expert parallelism is carved out of them); valid: "
                         f"{[d for d in _divisors(dp * cp) if n_experts % d == 0]}")
    if shard_group != "dp" or hpz or quantized_gradients != "none":
        field = ("zero.shard_group" if shard_group != "dp" else "zero.hpz" if hpz else "zero.quantized_gradients")
        value = shard_group if shard_group != "dp" else True if hpz else quantized_gradients
        raise ValueError(f"{field} = {value!r} with parallel.ep = {ep} is not supported (the expert weights' "
                         "partition is the expert-data-parallel group); valid: flat ZeRO (zero.shard_group = 'dp', "
                         "no hpZ / qgZ) or parallel.ep = 1")
    if lora and zero_stage == 3:
        raise ValueError(f"lora (frozen experts) with parallel.ep = {ep} and zero.stage = 3 is not supported: stage 3 "
                         "would partition the frozen experts over ranks that hold different ones; valid: zero.stage "
                         "0, 1 or 2, or parallel.ep = 1")
    if optimizer != "adamw":
        raise ValueError(f"optimizer.name = {optimizer!r} with parallel.ep = {ep} is not supported; valid: "
                         "optimizer.name = 'adamw' or parallel.ep = 1")

"""The checks of the DeepSeek-V3 fields of ModelConfig (models/config.py calls them from __post_init__; they read
the config's fields and import nothing of it). Messages name the field, the value and what is valid."""

from __future__ import annotations


def check_mtp(cfg) -> None:
    """The multi-token prediction fields (see ModelConfig)."""
    if not isinstance(cfg.mtp_depth, int) or isinstance(cfg.mtp_depth, bool) or cfg.mtp_depth < 0:
        raise ValueError(f"model.mtp_depth = {cfg.mtp_depth!r} is invalid: it must be an integer >= 0 (0: no "
                         "multi-token prediction)")
    w = cfg.mtp_loss_weight
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w < float("inf"):
        raise ValueError(f"model.mtp_loss_weight = {w!r} is invalid: it must be a finite number >= 0")
    if cfg.mtp_depth >= cfg.n_positions:
        raise ValueError(f"model.mtp_depth = {cfg.mtp_depth} must be smaller than model.n_positions = "
                         f"{cfg.n_positions} (depth k predicts k + 1 tokens ahead)")


def check_node_limit(cfg) -> None:
    """DeepSeek-V3's node limit (moe_nodes, moe_max_nodes; models/config.py), for a sigmoid_bias router."""
    nodes, m, e = cfg.moe_nodes, cfg.moe_max_nodes, cfg.n_experts
    for field, value, low in (("moe_nodes", nodes, 1), ("moe_max_nodes", m, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"model.{field} = {value!r} is invalid: it must be an integer >= {low}")
    if nodes > 1 and not m:
        raise ValueError(f"model.moe_nodes = {nodes} without model.moe_max_nodes: the nodes only matter to the node "
                         "limit; valid: moe_max_nodes in 1..moe_nodes, or moe_nodes = 1")
    if not m:
        return
    if e % nodes:
        raise ValueError(f"model.moe_nodes = {nodes} does not divide model.n_experts = {e}; valid: "
                         f"{[d for d in range(1, e + 1) if e % d == 0]}")
    if m > nodes:
        raise ValueError(f"model.moe_max_nodes = {m} is larger than model.moe_nodes = {nodes}; valid: 1..{nodes}")
    if cfg.moe_n_group > 1:
        raise ValueError(f"model.moe_max_nodes = {m} with model.moe_n_group = {cfg.moe_n_group}: one limit at a time "
                         "(DeepSeek-V3's groups are its nodes); valid: moe_n_group = 1, or moe_max_nodes = 0")
    if cfg.moe_top_k > m * (e // nodes):
        raise ValueError(f"model.moe_top_k = {cfg.moe_top_k} is more than the {m * (e // nodes)} experts on "
                         f"model.moe_max_nodes = {m} nodes of {e // nodes}; valid: 1..{m * (e // nodes)}")

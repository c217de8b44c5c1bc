"""Self-speculative greedy decoding with the multi-token prediction module (DeepSeek-V3's section 5.4.3 use).

Each step runs the main model once over [last confirmed token, draft]: its prediction after the last token is
the next token whatever the draft; when it equals the draft, its prediction after the draft is a second token
(the bonus). So a step yields 1 token (draft rejected; its cache position is dropped) or 2 (accepted), and the
output equals plain greedy decoding token for token: the draft only decides how many tokens a forward yields.

The draft comes from MTP depth 1: at position j it reads the main model's last-block output h_j and the
embedding of the confirmed token t_{j+1} and predicts t_{j+2}. Its block has a KV cache of its own, fed each
confirmed position once, in order (never rolled back). Collective under tp: every rank runs the same loop
(logits all-gathered, argmax on identical values). Greedy only; the context must hold prompt + new tokens + 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megazoo.models.generation.kv_cache import KVCache
from megazoo.parallel.tensor import gather_from_tp_region


@dataclass
class SpeculativeResult:
    ids: list[int]  # prompt + new tokens
    accepted: list[int] = field(default_factory=list)  # per main forward after the prompt's: 1 draft accepted, else 0

    @property
    def tokens_per_forward(self) -> float:
        new = len(self.accepted) + sum(self.accepted)
        return new / max(len(self.accepted), 1)


def check_speculative(model, prompt_len: int, max_new_tokens: int, temperature: float) -> None:
    """Refuse what self-speculative decoding does not do, naming the value and what is valid."""
    if getattr(model, "mtp", None) is None:
        raise ValueError(f"speculative decoding drafts with the multi-token prediction module: model "
                         f"{model.cfg.name} has model.mtp_depth = {model.cfg.mtp_depth}; valid: a model trained "
                         "with mtp_depth >= 1")
    if temperature != 0:
        raise ValueError(f"speculative decoding is greedy: temperature {temperature} is invalid; valid: 0")
    if prompt_len + max_new_tokens + 1 > model.cfg.n_positions:
        raise ValueError(f"speculative decoding keeps the whole sequence in its caches: prompt ({prompt_len}) + "
                         f"--max-new-tokens ({max_new_tokens}) + 1 exceeds model.n_positions = "
                         f"{model.cfg.n_positions}; valid: --max-new-tokens <= "
                         f"{max(model.cfg.n_positions - prompt_len - 1, 0)}")


def _full(model, local: torch.Tensor) -> torch.Tensor:
    return gather_from_tp_region(local, model.topo.tp_group)[..., : model.cfg.vocab_size]


@torch.no_grad()
def speculative_decode(model, prompt: Sequence[int], max_new_tokens: int,
                       stop: Callable[[list[int]], bool] | None = None) -> SpeculativeResult:
    """prompt + up to max_new_tokens greedy tokens, `stop(new_ids)` asked after each (the module docstring)."""
    check_speculative(model, len(prompt), max_new_tokens, 0.0)
    if not prompt:
        raise ValueError("the prompt encodes to no tokens: give at least one token of text")
    was_training = model.training
    model.eval()
    device, context = model.topo.device, model.cfg.n_positions
    layer = next(iter(model.mtp.layers.values()))
    index = model.cfg.n_layer  # depth 1's block is layer n_layer
    main, draft_cache = KVCache(context), KVCache(context)
    result = SpeculativeResult(list(prompt))
    ids, draft, hidden = result.ids, None, []  # hidden: main outputs of positions draft_cache has not consumed

    def done() -> bool:
        new = ids[len(prompt):]
        return len(new) >= max_new_tokens or (stop is not None and bool(new) and stop(new))

    try:
        while not done():
            fresh = ids[main.length:] + ([] if draft is None else [draft])
            local = model(torch.tensor([fresh], device=device), cache=main)
            preds = _full(model, local)[0].argmax(-1).tolist()
            h = model._mtp_hidden
            if draft is None:
                new, kept = [preds[-1]], len(fresh)
            elif preds[-2] == draft:  # accepted: the draft and the bonus
                new, kept = [draft, preds[-1]], len(fresh)
                result.accepted.append(1)
            else:  # rejected: the main model's own token; the draft's cache position dropped
                new, kept = [preds[-2]], len(fresh) - 1
                main.length -= 1
                result.accepted.append(0)
            hidden.append(h[:, :kept])
            for token in new:
                ids.append(token)
                if done():
                    break
            if done():
                break
            # depth 1 over the positions whose next token is confirmed: h_j with t_{j+1}; the last predicts t_{j+2}
            h = torch.cat(hidden, dim=1)
            hidden = []
            start = draft_cache.length
            nxt = torch.tensor([ids[start + 1: start + 1 + h.shape[1]]], device=device)
            out = layer(h, model.wte(nxt), draft_cache.layer(index))
            draft_cache.advance(h.shape[1])
            draft = int(_full(model, model.logits(layer.norm(out[:, -1:])))[0, -1].argmax())
    finally:
        model.train(was_training)
    return result

"""A megazoo GPT as an lm-eval model (`lm_eval.api.model.TemplateLM`), registered as "megazoo".

    import megazoo.eval.harness_model  # registers the class with lm-eval
    lm_eval.simple_evaluate(model="megazoo", model_args="checkpoint=runs/demo/checkpoints", tasks=["lambada_openai"])

`loglikelihood` (lm-eval's own tokenisation of a request, TemplateLM._encode_pair) and `loglikelihood_rolling`
(lm-eval's disjoint windows with an EOS prefix) are scored by eval/lm_eval_protocol.py, the code behind
`megazoo eval ... --protocol lm-eval`; `generate_until` decodes with the KV cache of `megazoo generate`
(models/generation/generate.py). Needs lm-eval (`pip install 'megazoo[eval]'`).

Tensor parallelism (`megazoo eval harness --tp N`, eval/harness.py): every rank loads only its shards and runs
every forward; rank 0 drives lm-eval and, before each forward, broadcasts it to the other ranks
(`TPForward`), which wait in `serve` until rank 0 says stop. Collectives: one broadcast of a 4-int header and
one of the ids per forward (rank 0 -> all), then the model's own (all-reduces in the blocks, all-gather of the
logits' vocabulary shards).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from megazoo.eval.lm_eval_protocol import rolling_windows, score_pairs
from megazoo.models.generation.generate import decode, full_logits, new_cache
from megazoo.models.generation.kv_cache import KVCache

LOG = logging.getLogger(__name__)

STOP, PLAIN, CACHED = 0, 1, 2  # header ops: end serving; a forward without / with the KV cache


class TPForward:
    """Rank 0's forward under tp: tell the other ranks (header [op, b, s, reset cache], then the ids), then run
    the same forward here. `close()` releases them from `serve`."""

    def __init__(self, model) -> None:
        self.model, self.device = model, model.topo.device

    def _announce(self, op: int, ids: torch.Tensor | None = None, reset: bool = False) -> None:
        shape = (0, 0) if ids is None else tuple(ids.shape)
        dist.broadcast(torch.tensor([op, *shape, int(reset)], dtype=torch.long, device=self.device), src=0)
        if ids is not None:
            dist.broadcast(ids.to(self.device), src=0)

    def __call__(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        self._announce(PLAIN if cache is None else CACHED, ids, reset=cache is not None and cache.length == 0)
        return full_logits(self.model, ids, cache)

    def close(self) -> None:
        self._announce(STOP)


@torch.no_grad()
def serve(model) -> None:
    """Ranks > 0: run the forwards rank 0 announces, with a cache of their own heads, until STOP. The cache is
    the kind rank 0's decoding fills (new_cache: latent attention's latent cache), so every rank computes alike."""
    device, cache = model.topo.device, new_cache(model.cfg)
    while True:
        header = torch.empty(4, dtype=torch.long, device=device)
        dist.broadcast(header, src=0)
        op, b, s, reset = header.tolist()
        if op == STOP:
            return
        ids = torch.empty(b, s, dtype=torch.long, device=device)
        dist.broadcast(ids, src=0)
        if op == CACHED and reset:
            cache.reset()
        full_logits(model, ids, cache if op == CACHED else None)


@register_model("megazoo")
class MegazooLM(TemplateLM):
    """lm-eval's view of a megazoo GPT. model_args: checkpoint (a checkpoints/ folder or step_N; a LoRA run's
    too), tokenizer (optional: the one the checkpoint records), batch_size, max_gen_toks, device, lora_base
    (optional: a LoRA run's base, else the one it recorded)."""

    def __init__(self, checkpoint: str | None = None, tokenizer: str | None = None, batch_size: int | str = 8,
                 max_gen_toks: int = 256, device: str | None = None, *, parts: tuple | None = None,
                 **unused) -> None:
        super().__init__()
        if parts is None:
            from megazoo.models.loading import load_gpt, open_checkpoint
            from megazoo.parallel.topology import Topology, local_device

            if checkpoint is None:
                raise ValueError("model_args needs checkpoint=PATH (a checkpoints/ folder or one step_N directory)")
            opened = open_checkpoint(checkpoint, tokenizer, report=lambda message: None, need_base=True,
                                     lora_base=unused.pop("lora_base", None))  # a LoRA run's: on its base
            from megazoo.parallel import accelerator

            target = torch.device(device) if device else local_device(0)
            if target.type == "cuda" and not accelerator.cuda_available():
                # lm-eval's command line sends device="cuda" unless told otherwise; without CUDA, run here
                LOG.warning(f"device {device!r} asked for, but CUDA is not available: running on the CPU")
                target = local_device(0)
            model = load_gpt(opened, Topology.solo(target))
            parts = (model, opened.tokenizer, None)
        self.model, self.tokenizer, forward = parts
        self._forward = forward or (lambda ids, cache=None: full_logits(self.model, ids, cache))
        self._batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": a fixed 8
        self._max_gen_toks = int(max_gen_toks)

    @classmethod
    def from_parts(cls, model, tokenizer, forward=None, batch_size: int = 8, max_gen_toks: int = 256) -> MegazooLM:
        """An adapter over a loaded model (eval/harness.py); `forward`: TPForward under tp."""
        return cls(batch_size=batch_size, max_gen_toks=max_gen_toks, parts=(model, tokenizer, forward))

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.eod_id  # the exported model's bos (= eos), what lm-eval's hf model prefixes

    @property
    def max_length(self) -> int:
        return self.model.cfg.n_positions

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def _logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, cont) for _, context, cont in requests]
        scored = score_pairs(self._logits, pairs, max_length=self.max_length, pad_id=self.eot_token_id,
                             batch_size=self._batch_size, progress=not disable_tqdm)
        return [(ll, greedy) for ll, greedy, _ in scored]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in rolling_windows(self.tok_encode(string), self.prefix_token_id, self.max_length):
                windows.append(window)
                owner.append(index)
        scored = score_pairs(self._logits, windows, max_length=self.max_length, pad_id=self.eot_token_id,
                             batch_size=self._batch_size, progress=not disable_tqdm, desc="loglikelihood_rolling")
        totals = [0.0] * len(requests)
        for index, (ll, _, _) in zip(owner, scored):
            totals[index] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tokenizer.decode([self.eot_token_id])
        outputs = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            until.append(eos_text)
            max_new = int(kwargs.pop("max_gen_toks", self._max_gen_toks))
            sample = kwargs.pop("do_sample", False) and kwargs.get("temperature", 1.0) > 0
            temperature = float(kwargs.pop("temperature", 1.0)) if sample else 0.0
            if max_new >= self.max_length:  # lm-eval's own hf model refuses this too (an assertion there)
                raise ValueError(f"max_gen_toks = {max_new} leaves no room for the prompt in the model's "
                                 f"{self.max_length}-token context; give max_gen_toks < {self.max_length} "
                                 "(--gen-kwargs max_gen_toks=N, or the task's generation_kwargs)")
            encoded, room = self.tok_encode(context), self.max_length - max_new
            if len(encoded) > room:  # lm-eval's left truncation, said as lm-eval says it
                LOG.warning(f"Left truncation applied. Original sequence length was {len(encoded)}, truncating to "
                            f"last {room} tokens. Some content will be lost.")
            prompt = encoded[-room:]
            eos = self.eot_token_id

            def stop(new: list[int]) -> bool:
                return new[-1] == eos or any(term in self.tokenizer.decode(new) for term in until)

            ids = decode(self.model, prompt, max_new, temperature=temperature, seed=1234, stop=stop,
                         forward=self._forward)
            new = ids[len(prompt):]
            text = self.tokenizer.decode(new[:-1] if new and new[-1] == eos else new)
            for term in until:
                text = text.split(term)[0]
            outputs.append(text)
        return outputs

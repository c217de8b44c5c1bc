"""The GPT's parameters, described once, and the (tp, pp) layouts a config admits.

`parameter_layout` lists every parameter models/transformer.py allocates: its global name, its global shape and
how tensor parallelism splits it. Everything else that needs the model's shapes derives them from here:
`ModelConfig.num_parameters`, the Hugging Face GPT-2 import/export check (models/gpt2/hf.py), the ZeRO planner's
per-device counts (recipes/planner/shards.py) and the "parameters" pipeline balancing (recipes/resolve.py).
tests/test_layout.py holds it equal to what a meta-device model really allocates, at tp = 1 and tp = 2.

`check_parallel_compat` is the one check of a (tp, pp) layout against a config: the model's constructor, the
recipe resolver and the planner all call it, so a bad layout reads the same wherever it is caught.

Pure arithmetic on the config's fields (no torch), so a 1T-parameter preset is described in microseconds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from megazoo.models.config import ModelConfig


class ParamSpec(NamedTuple):
    """One parameter of the full model."""

    name: str  # global name, as models/transformer.py registers it: "wte.weight", "h.3.attn.c_attn.weight"
    shape: tuple[int, ...]  # global (unsharded) shape
    tp_dim: int | None  # the dim split over the tp ranks; None: replicated on every tp rank
    sections: int = 1  # tp_dim is this many equal blocks, each split over tp (3: fused [Q; K; V], whole heads)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape one tp rank holds (parallel/tensor's ShardSpec.local_shape)."""
        if self.tp_dim is None:
            return self.shape
        return tuple(n // tp if dim == self.tp_dim else n for dim, n in enumerate(self.shape))

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp))


def block_parameters(cfg: ModelConfig, index: int) -> list[ParamSpec]:
    """Block `index`: LayerNorms and row-parallel biases replicated; column-parallel weights and biases split on
    dim 0 (QKV in 3 head-aligned sections); row-parallel weights split on dim 1 (their input)."""
    d, f, h = cfg.d_model, cfg.d_ff, f"h.{index}."
    return [ParamSpec(h + "ln_1.weight", (d,), None), ParamSpec(h + "ln_1.bias", (d,), None),
            ParamSpec(h + "attn.c_attn.weight", (3 * d, d), 0, 3), ParamSpec(h + "attn.c_attn.bias", (3 * d,), 0, 3),
            ParamSpec(h + "attn.c_proj.weight", (d, d), 1), ParamSpec(h + "attn.c_proj.bias", (d,), None),
            ParamSpec(h + "ln_2.weight", (d,), None), ParamSpec(h + "ln_2.bias", (d,), None),
            ParamSpec(h + "mlp.c_fc.weight", (f, d), 0), ParamSpec(h + "mlp.c_fc.bias", (f,), 0),
            ParamSpec(h + "mlp.c_proj.weight", (d, f), 1), ParamSpec(h + "mlp.c_proj.bias", (d,), None)]


def parameter_layout(cfg: ModelConfig, tp: int = 1, *, vocab: int | None = None, layers: range | None = None,
                     embedding: bool = True, head: bool = True) -> list[ParamSpec]:
    """Every parameter of one (pipeline stage of a) GPT, in the model's registration order.

    `vocab`: rows of the word embedding; default the padded vocabulary at `tp` (what the model allocates), give
    cfg.vocab_size for the true one (checkpoints, counts). `layers`, `embedding`, `head`: the blocks and ends a
    pipeline stage holds (GPT's `layers`, `with_embedding`, `with_head`). The tied head owns its own reference to
    the word embedding, so a last stage without the embedding still lists wte.weight.
    """
    d = cfg.d_model
    vocab = cfg.padded_vocab(tp) if vocab is None else vocab
    params = []
    if embedding or head:
        params.append(ParamSpec("wte.weight", (vocab, d), 0))
    if embedding:
        params.append(ParamSpec("wpe.weight", (cfg.n_positions, d), None))
    for i in range(cfg.n_layer) if layers is None else layers:
        params += block_parameters(cfg, i)
    if head:
        params += [ParamSpec("ln_f.weight", (d,), None), ParamSpec("ln_f.bias", (d,), None)]
    return params


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_parallel_compat(cfg: ModelConfig, tp: int, pp: int = 1) -> None:
    """Raise ValueError unless `cfg` can be split over `tp` tensor-parallel ranks and `pp` pipeline stages.

    tp must divide the attention heads (a rank holds whole heads) and the MLP width; pp must not exceed the
    blocks. The message names the field, the value and what would be valid.
    """
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} = {value!r} is invalid: it must be an integer >= 1")
    valid_tp = ", ".join(str(k) for k in divisors(cfg.n_head) if cfg.d_ff % k == 0)
    if cfg.n_head % tp:
        raise ValueError(f"parallel.tp = {tp} does not divide the {cfg.n_head} attention heads of {cfg.name} "
                         f"(model.n_head = {cfg.n_head}, divisors {divisors(cfg.n_head)}); valid tp: {valid_tp}")
    if cfg.d_ff % tp:
        raise ValueError(f"parallel.tp = {tp} does not divide the MLP width of {cfg.name} "
                         f"(model.d_ff = {cfg.d_ff}); valid tp: {valid_tp}")
    if pp > cfg.n_layer:
        raise ValueError(f"parallel.pp = {pp} is larger than the number of blocks of {cfg.name} "
                         f"(model.n_layer = {cfg.n_layer} blocks); valid pp: 1..{cfg.n_layer}")

"""Hugging Face GPT-2 checkpoints <-> megazoo GPT weights.

Our parameter names are HF GPT-2's without the `transformer.` prefix, so conversion is one rule: HF's `Conv1D`
layers (`c_attn`, `c_proj`, `c_fc`) store weights as (in, out) and ours as torch.nn.Linear's (out, in), so those
four weights are transposed. HF's fused `c_attn` output is already [Q; K; V] (each d_model wide, heads in
order), exactly our full layout, which `shard_of` then cuts by whole heads per rank (ShardSpec sections=3).
HF's `attn.bias` / `attn.masked_bias` causal-mask buffers (older checkpoints) and the tied `lm_head.weight` are
dropped.

"Full state" below means {our name: full, unsharded tensor} with the embedding at the true vocabulary size, the
format of `models.weights.full_state_dict`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megazoo.models.config import ModelConfig
from megazoo.models.hf.family import Entry, Family
from megazoo.models.layout import VOCAB_PARAMETERS, parameter_layout
from megazoo.models.transformer import GPT
from megazoo.models.weights import named_shards
from megazoo.parallel.tensor import shard_of
from megazoo.parallel.topology import Topology

# Layers stored by HF as transformers.pytorch_utils.Conv1D, whose weight is (in, out).
CONV1D_LAYERS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# HF activations equal to ours (GELU with the tanh approximation).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
HF_PREFIX = "transformer."
DROPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _is_conv1d_weight(name: str) -> bool:
    return name.endswith(".weight") and any(f".{layer}." in f".{name}" for layer in CONV1D_LAYERS)


def hf_to_megazoo_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full megazoo state from an HF GPT2LMHeadModel / GPT2Model state dict (prefix `transformer.` optional)."""
    full: dict[str, torch.Tensor] = {}
    for hf_name, tensor in hf_state.items():
        if hf_name == "lm_head.weight" or hf_name.endswith(DROPPED_SUFFIXES):
            continue  # tied to wte / causal-mask buffers we do not need
        name = hf_name.removeprefix(HF_PREFIX)
        full[name] = tensor.t().contiguous() if _is_conv1d_weight(name) else tensor
    if "lm_head.weight" in hf_state and "wte.weight" in full:
        if not torch.equal(hf_state["lm_head.weight"], full["wte.weight"]):
            raise ValueError("lm_head.weight differs from transformer.wte.weight: megazoo GPTs tie the output "
                             "head to the input embedding and cannot hold an untied checkpoint")
    _check_names_and_shapes(full, cfg)
    return full


def megazoo_to_hf_state(full_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel state (without the tied `lm_head.weight`) from a full megazoo state."""
    _check_names_and_shapes(full_state, cfg)
    return {HF_PREFIX + name: (tensor.t() if _is_conv1d_weight(name) else tensor).contiguous()
            for name, tensor in full_state.items()}


def entries(cfg: ModelConfig) -> list[Entry]:
    """GPT-2's key map (models/hf/families.py): `transformer.` + our name, the four Conv1D weights transposed."""
    out = []
    for p in parameter_layout(cfg, vocab=cfg.vocab_size):
        transpose = _is_conv1d_weight(p.name)
        out.append(Entry(p.name, (HF_PREFIX + p.name,), (tuple(reversed(p.shape)) if transpose else p.shape,),
                         transpose=transpose))
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model with its full shape (embedding at the true vocabulary size), from
    models/layout.py."""
    return {p.name: p.shape for p in parameter_layout(cfg, vocab=cfg.vocab_size)}


def _check_names_and_shapes(full: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = expected_shapes(cfg)
    missing, unexpected = sorted(set(expected) - set(full)), sorted(set(full) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state does not match model {cfg.name} ({cfg.n_layer} layers): missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    wrong = [f"{n}: {tuple(full[n].shape)} != {s}" for n, s in expected.items() if tuple(full[n].shape) != s]
    if wrong:
        raise ValueError(f"state does not match model {cfg.name}: wrong shapes {wrong[:8]}")


def config_from_hf(hf_config, name: str | None = None) -> ModelConfig:
    """ModelConfig of an HF `GPT2Config`; refuses the variants our decoder does not compute."""
    unsupported = []
    if hf_config.activation_function not in TANH_GELUS:
        unsupported.append(f"activation_function={hf_config.activation_function!r} (ours is tanh-GELU)")
    if not getattr(hf_config, "scale_attn_weights", True) or getattr(hf_config, "scale_attn_by_inverse_layer_idx",
                                                                      False):
        unsupported.append("attention scaling other than 1/sqrt(head_dim)")
    if not getattr(hf_config, "tie_word_embeddings", True):
        unsupported.append("untied output head (tie_word_embeddings=False)")
    if getattr(hf_config, "add_cross_attention", False):
        unsupported.append("cross-attention")
    if unsupported:
        raise ValueError(f"unsupported GPT-2 variant: {'; '.join(unsupported)}")
    return ModelConfig(
        name=name or Path(getattr(hf_config, "name_or_path", "") or "hf-gpt2").name or "hf-gpt2",
        n_layer=hf_config.n_layer, n_head=hf_config.n_head, d_model=hf_config.n_embd,
        n_positions=hf_config.n_positions, vocab_size=hf_config.vocab_size,
        d_ff=hf_config.n_inner or 4 * hf_config.n_embd,
        # Dropout rates are kept for fine-tuning; evaluation runs in eval() mode, where they are inactive.
        dropout=hf_config.resid_pdrop, attn_dropout=hf_config.attn_pdrop,
        layer_norm_eps=hf_config.layer_norm_epsilon, init_std=hf_config.initializer_range,
    )


def config_to_hf(cfg: ModelConfig, special: dict[str, int | None] | None = None):
    """The HF `GPT2Config` computing the same function as `cfg`. `special`: bos / eos / pad ids of the model's
    tokenizer (models/hf/tokenizer_export.py: special_ids); without them GPT-2's end-of-text id 50256 is kept when
    the vocabulary holds it, and no id is written otherwise (never one outside the vocabulary)."""
    from transformers import GPT2Config

    if special is None:
        eod = 50256 if cfg.vocab_size > 50256 else None
        special = {"bos_token_id": eod, "eos_token_id": eod, "pad_token_id": None}
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.d_model, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_inner=cfg.d_ff, activation_function="gelu_new", resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout, attn_pdrop=cfg.attn_dropout, layer_norm_epsilon=cfg.layer_norm_eps,
        initializer_range=cfg.init_std, architectures=["GPT2LMHeadModel"], tie_word_embeddings=True, **special,
    )


@torch.no_grad()
def load_full_state_into(model: GPT, full_state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every parameter of `model` (any tp, any pipeline stage) from a full state.

    The embedding (and an untied head) is padded with zero rows from the true to the model's padded vocabulary (as init_weights
    does: padding ids are never inputs and their logits are masked). Names of other stages are ignored.
    """
    missing = [name for name, _, _ in named_shards(model) if name not in full_state]
    if missing:
        raise ValueError(f"full state lacks {len(missing)} parameter(s) of the model, e.g. {missing[:8]}")
    for name, param, spec in named_shards(model):
        full = full_state[name]
        if name in VOCAB_PARAMETERS and full.shape[0] < spec.global_shape[0]:
            full = torch.cat([full, full.new_zeros(spec.global_shape[0] - full.shape[0], full.shape[1])])
        param.copy_(shard_of(full.to(param.dtype), spec))
    for name, buffer in model.named_buffers():  # DeepSeek-V3's routing bias, where the full state carries it
        if name.endswith("router.expert_bias") and name in full_state:
            buffer.copy_(full_state[name])


def gpt_from_full_state(cfg: ModelConfig, full_state: dict[str, torch.Tensor], topology: Topology,
                        dtype: torch.dtype = torch.float32) -> GPT:
    """A whole (pp = 1) GPT for this rank of `topology`, holding its shards of `full_state`, in eval mode."""
    model = GPT(cfg, topology, device=topology.device, dtype=dtype)
    load_full_state_into(model, full_state)
    return model.eval()


def read_hf_state_dict(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of an HF checkpoint directory: model.safetensors, its sharded index, or pytorch_model.bin (the whole
    state: models/hf/converter.py streams instead)."""
    from megazoo.models.hf.safetensors_files import HFWeights

    weights = HFWeights(hf_dir)
    return {name: weights.read(name) for name in weights.names()}


def read_hf_config(hf_dir: str | Path) -> ModelConfig:
    """The ModelConfig of an HF GPT-2 directory's config.json, named after the directory (weights not read)."""
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    config = hf_dir / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"HF checkpoint directory {hf_dir} has no config.json")
    try:
        hf_config = AutoConfig.from_pretrained(str(hf_dir))
    except Exception as error:  # transformers raises OSError / ValueError / JSON errors for bad configs
        raise ValueError(f"cannot read HF config {config}: {error}") from error
    if hf_config.model_type != "gpt2":
        raise ValueError(f"{config} describes a {hf_config.model_type!r} model, not gpt2")
    return config_from_hf(hf_config, name=hf_dir.resolve().name)


def read_hf_dir(hf_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, full megazoo state) of an HF GPT-2 checkpoint directory (config.json + weights)."""
    cfg = read_hf_config(hf_dir)
    return cfg, hf_to_megazoo_state(read_hf_state_dict(hf_dir), cfg)


def import_hf_dir(hf_dir: str | Path, topology: Topology, dtype: torch.dtype = torch.float32) -> GPT:
    """Our GPT, sharded over `topology`'s tp group, from an HF GPT-2 checkpoint directory."""
    cfg, full_state = read_hf_dir(hf_dir)
    return gpt_from_full_state(cfg, full_state, topology, dtype)


def export_hf_dir(full_state: dict[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                  tokenizer_dir: str | Path | None = None, tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write an HF GPT-2 checkpoint (config.json, generation_config.json, safetensors) that GPT2LMHeadModel loads,
    in `dtype` (default: the state's own), through the one converter (models/hf/converter.py: write_hf_folder).

    With `tokenizer` (a megazoo Tokenizer) or `tokenizer_dir` (a GPT-2 BPE directory), it is written as a Hugging
    Face tokenizer, so the directory is also a complete tokenizer for AutoTokenizer, and its end-of-text id is
    the model's bos / eos / pad id (config.json and generation_config.json: generate() stops there).
    """
    from megazoo.models.hf.converter import write_hf_folder

    if tokenizer is None and tokenizer_dir is not None:
        from megazoo.data.tokenizers.gpt2_bpe import GPT2BPETokenizer

        tokenizer = GPT2BPETokenizer.from_dir(tokenizer_dir)
    _check_names_and_shapes(full_state, cfg)
    out_dir = Path(out_dir)
    write_hf_folder(out_dir, FAMILY, cfg, full_state.__getitem__, dtype or next(iter(full_state.values())).dtype,
                    tokenizer=tokenizer)
    if tokenizer_dir is not None:  # GPT-2's own files too, for tools that read vocab.json + merges.txt
        from megazoo.data.fileio import atomic_write_bytes
        from megazoo.data.tokenizers.gpt2_bpe import find_bpe_files

        vocab, merges = find_bpe_files(tokenizer_dir)
        atomic_write_bytes(out_dir / "vocab.json", vocab.read_bytes())
        atomic_write_bytes(out_dir / "merges.txt", merges.read_bytes())
    return out_dir


FAMILY = Family(
    name="GPT-2", model_types=("gpt2",), config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    exports=lambda cfg: "gpt2" if cfg.positions == "learned" else None, entries=entries,
    tied_head=lambda cfg: ("lm_head.weight", HF_PREFIX + "wte.weight"), ignored=DROPPED_SUFFIXES,
    fp32_in_hf=False)  # GPT2LMHeadModel computes in the model's dtype throughout (LayerNorm, GELU, attention)

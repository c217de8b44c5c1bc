"""Recipes: TOML files -> frozen dataclasses that reject unknown keys at every level.

`load_recipe(path, overrides)` parses the file with stdlib tomllib, applies `--set section.key=value` overrides to the
raw table (an unknown key is rejected like a typo in the file), and builds a `Recipe`. Derived values (global
batch, padded vocabulary, the model config after overrides) are computed once, by `resolve()`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from megazoo.data.published.catalog import CATALOG, find_item
from megazoo.models.config import ModelConfig
from megazoo.models.lora.config import LoRAConfig  # `[lora]`: rank, alpha, dropout, targets (models/lora/adapters.py)
from megazoo.parallel.pipeline.schedules import CHUNKS
from megazoo.parallel.fault_tolerance.config import DiLoCoConfig, FaultToleranceConfig  # torchft groups; DiLoCo
from megazoo.recipes.sft_section import SFTSection


class RecipeError(ValueError):
    """A recipe that cannot run: the message names the field, the value and what would be valid."""


def _overrides_of(config: type, *, skip: tuple[str, ...] = ("name",)):
    """Class decorator (apply below @dataclass): one optional override field, default None, per field of the
    dataclass `config` (except `skip`), typed like it. So a section can never fall behind the config it sets."""
    def add(cls: type) -> type:
        hints = typing.get_type_hints(config)
        annotations = cls.__dict__.get("__annotations__", {})
        for f in dataclasses.fields(config):
            if f.name not in skip:
                annotations[f.name] = hints[f.name] | None
                setattr(cls, f.name, None)
        cls.__annotations__ = annotations
        return cls
    return add


@dataclass(frozen=True)
@_overrides_of(ModelConfig)
class ModelSection:
    """`[model]`: a preset, plus optional overrides of every ModelConfig field but its name (None: the preset's)."""

    preset: str = "gpt2-tiny"
    from_checkpoint: bool = False  # true: the architecture from checkpoint.load (overrides: dropout, init only)
    from_hf: str = ""  # an HF folder: its architecture, and its weights at step 0 read per rank (models/hf/)


@dataclass(frozen=True)
class ParallelSection:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"  # pipeline schedule: "gpipe" | "1f1b" | "interleaved" | "zb_h1" | "zbv" | "dualpipev"
    virtual_stages: int | None = None  # chunks per rank; unset: the schedule's (zbv/dualpipev 2, interleaved >= 2)
    partition: str = "uniform"  # blocks per stage: "uniform" (by count) | "parameters" (balanced)
    layers: tuple[tuple[int, ...], ...] = ()  # explicit blocks of each (virtual) stage; overrides partition
    timeout_s: float = 600.0  # every collective; a dead or diverged rank ends the job instead of hanging it
    # Each collective first compares its fingerprint (op, seq, shapes, dtypes) across ranks (TORCH_DISTRIBUTED_DEBUG=
    # DETAIL): a mismatch ends the job at once, naming both ranks and calls. Costs +50% CPU per tp=2 step here.
    check_collectives: bool = False
    # Entries of torch's per-rank ring of recent collectives (0: off; no measurable cost: benchmarks/hang_keys.py).
    # A timeout or SIGUSR1 writes each ring to run.dir/.progress/ and names each rank's last collective.
    flight_recorder: int = 2000
    cp: int = 1  # context parallelism: sequences split over cp ranks (load-balanced causal chunks, parallel/context)
    cp_attention: str = "all_to_all"  # "all_to_all" (Ulysses: local heads divisible by cp) | "ring" (any heads)
    # Megatron's sequence parallelism (tp >= 2): norm, dropout and residual hold seq_len / (cp x tp) positions.
    sequence_parallel: bool = False
    node_size: int = 0  # processes per node for HSDP / hpZ; 0: the launcher's LOCAL_WORLD_SIZE (one node alone)
    ep: int = 1  # expert parallelism: an MoE model's routed experts split over ep ranks of dp x cp (parallel/expert)
    fb_overlap: bool = False  # dualpipev + ep: one micro-batch's all-to-alls under another's compute (fb_overlap.py)

    def __post_init__(self):  # an unset virtual_stages is the schedule's own number (interleaved's: set it)
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", CHUNKS.get(self.schedule) or 1)

@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    micro_batch: int = 8
    grad_accum: int = 1
    global_batch: int | None = None  # optional cross-check: must equal micro_batch x grad_accum x dp
    seq_len: int = 128
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 10
    lr_decay_steps: int | None = None  # cosine decay ends here (default: steps)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables clipping
    seed: int = 1234
    # "auto" (bf16 on CUDA, fp32 on CPU) | "fp32" | "bf16" | "fp16" (dynamic loss scaling) | "fp64" (parity tests).
    # bf16/fp16 under autocast; with ZeRO >= 1 parameters and gradients in 2 bytes, fp32 masters in the optimizer.
    precision: str = "auto"
    activation_checkpointing: bool = False
    compile: str = "none"  # "none" | "blocks": each block through torch.compile (inductor) | "blocks:aot_eager"
    tf32: bool = True  # on GPU, fp32 matmuls and convolutions use TF32 tensor cores (false: full fp32)
    fused_loss: str = "auto"  # "auto" | "on" | "off": head + loss chunked, logits never whole (Resolved.fused_loss)
    fp8: str = "none"  # "none" | "tensorwise" | "rowwise": the blocks' linears in FP8 (parallel/tensor/fp8.py)
    eval_every: int = 0  # validation loss every N steps (0: only at the end)
    eval_batches: int = 8  # global batches of validation samples in one validation pass


@dataclass(frozen=True)
class ZeroSection:
    stage: int = 0  # 0: plain data parallelism; 1: optimizer states partitioned; 2: + gradients; 3: + parameters
    reduce_bucket_size: int = 1 << 24  # elements per gradient bucket (one reduce-scatter each)
    offload: str = "none"  # "none" | "cpu" (ZeRO-Offload: fp32 masters + Adam moments in CPU memory, update on CPU)
    shard_group: str = "dp"  # "dp": partition over all dp ranks | "node": HSDP, inside a node, replicated across
    hpz: bool = False  # stage 3: ZeRO++ hpZ, backward all-gathers from a secondary shard inside the node
    quantized_weights: bool = False  # stage 3: ZeRO++ qwZ, parameter gathers in int8 blocks of 256 (masters exact)
    quantized_gradients: str = "none"  # stages 1-3: ZeRO++ qgZ "int8" | "int4" hierarchical reduce (zero/qgz.py)
    fp8_all_gather: bool = False  # stage 3 + train.fp8 "tensorwise": FP8 linears' weights gathered as float8


@dataclass(frozen=True)
class OptimizerSection:
    """`[optimizer]`: AdamW, or a communication-compressed Adam for slow networks (parallel/compressed/, ZeRO stage
    0 or 1). AdamW's lr, betas, eps and weight_decay stay in [train]; the compressed variants use them too."""

    name: str = "adamw"  # "adamw" | "onebit_adam" | "zero_one_adam"
    freeze_step: int = 100  # compressed: AdamW steps (full-precision all-reduce) before compression starts
    var_freeze_step: int = 1000  # zero_one_adam: variance frozen and local steps from this step on
    var_update_scaler: int = 16  # zero_one_adam: variance updates before their interval doubles (kappa)
    local_step_scaler: int = 1000  # zero_one_adam: steps before the local-step interval doubles
    local_step_clipper: int = 16  # zero_one_adam: the largest local-step interval (H)


@dataclass(frozen=True)
class LossScaleSection:
    """Dynamic loss scaling, used when train.precision = "fp16" (parallel/zero/loss_scaler.py)."""

    initial_scale: float = 65536.0
    growth_interval: int = 1000  # good steps before the scale doubles
    hysteresis: int = 2  # overflowing steps before the scale halves
    min_scale: float = 1.0
    max_consecutive_skips: int = 20  # abort the run after this many overflowing steps in a row


@dataclass(frozen=True)
class KernelsSection:
    """Which implementation runs each fused op (kernels/dispatch.py); "" follows `prefer`."""

    prefer: str = "auto"  # "auto" | "apex" | "triton" | "torch" | "reference"
    layer_norm: str = ""
    bias_gelu: str = ""
    attention: str = ""
    cross_entropy: str = ""
    adamw: str = ""  # also "foreach"

    def choice(self):
        from megazoo.kernels import OPS, KernelChoice
        return KernelChoice(self.prefer, {op: value for op in OPS if (value := getattr(self, op))})


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 0  # also save every N steps under run.dir/checkpoints; 0: only at the end (at_end)
    at_end: bool = True  # save when training ends, so every finished run leaves something to evaluate or resume
    keep: int = 2  # newest checkpoints kept
    load: str = ""  # start from this checkpoint (a step_N directory or a checkpoints folder), any layout
    load_optimizer: bool = True  # false: weights only, from step 0 (fine-tuning)
    resume: bool = False  # continue from the latest good checkpoint in run.dir (megazoo train --resume)
    allow_batch_change: bool = False  # resume even if train.micro_batch / seq_len / the global batch changed
    # Every rank re-reads what it wrote against the sha256 it meant to write, before the oldest checkpoint rotates away;
    # a mismatch keeps the older ones, sets the new one aside as bad-step_N, stops the run. false: skip it (cost below)
    verify_on_save: bool = True  # damage is otherwise found at load; cost: benchmarks/checkpoint_verify.py
    # true: the save returns once the state is in host memory; a thread writes, verifies and publishes it
    async_save: bool = False  # (parallel/checkpoint/async_save.py); the next save, the end or a stop waits for it
    format: str = "megazoo"  # "megazoo" (rank files + manifest) or "dcp" (torch.distributed.checkpoint: dcp_views.py)
    export_hf: str = ""  # a new folder: the last checkpoint written there as an HF model (streamed, sharded, verified)


@dataclass(frozen=True)
class DataSection:
    # "stdlib": the Python standard library's own source, BPE trained on it (the embedded demo corpus); "indexed":
    # datasets written by `megazoo preprocess` (paths = their prefixes, blended by weights); "synthetic": a Markov chain
    source: str = "stdlib"
    vocab_size: int = 4096  # stdlib: BPE vocabulary trained on the corpus
    max_bytes: int = 4_000_000  # stdlib: corpus size
    val_fraction: float = 0.05  # stdlib: share of files held out for validation
    synthetic_tokens: int = 200_000
    paths: tuple[str, ...] = ()  # indexed: training dataset prefixes (P for P.bin + P.idx)
    weights: tuple[float, ...] = ()  # indexed: blending weights, one per path (default: equal)
    valid_paths: tuple[str, ...] = ()  # indexed: validation dataset prefixes (none: no validation)
    tokenizer: str = ""  # indexed: GPT-2 BPE directory or tokenizer.json, for the closing sample


@dataclass(frozen=True)
class RunSection:
    dir: str = "runs/default"
    # A fresh `megazoo train` into a run.dir that holds a run: "refuse" (exit 2: --resume or --overwrite) or
    # "start_over" (its files move to RUN_DIR.old-<time>/ beside it, as --overwrite does: nothing is lost).
    existing: str = "refuse"


@dataclass(frozen=True)
class LoggingSection:
    wandb: str = "off"  # "off" | "offline" | "online"
    wandb_project: str = "megazoo"
    progress: bool = True


@dataclass(frozen=True)
class SampleSection:
    # The closing sample's prompt. "" (default): start after an end-of-document token, as every training document
    # does: an unconditional sample in the corpus's own style; the demo recipes (Python source) set "def ".
    prompt: str = ""
    tokens: int = 48  # 0 disables the closing sample
    temperature: float = 0.8
    top_k: int = 40
    # true: also sample before the first step (fresh start): a fine-tune prints the base model's answer, then its own
    before: bool = False


@dataclass(frozen=True)
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    loss_scale: LossScaleSection = field(default_factory=LossScaleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    kernels: KernelsSection = field(default_factory=KernelsSection)
    data: DataSection = field(default_factory=DataSection)
    run: RunSection = field(default_factory=RunSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    sample: SampleSection = field(default_factory=SampleSection)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank 0: off (full fine-tuning)
    sft: SFTSection = field(default_factory=SFTSection)  # recipes/sft_section.py: fine-tuning on chat data
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)  # off: every step averages gradients over dp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_type(value, annotation, where: str):
    """Return value converted to the annotated type, or raise a RecipeError naming the key."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if typing.get_origin(options[0]) is tuple and value is not None:  # tuple[X, ...] (| None): a TOML array of X
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"recipe key {where} = {value!r} has the wrong type: expected an array")
        inner = typing.get_args(options[0])[0]
        return tuple(_check_type(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if value is None and type(None) in options:
        return None
    for kind in options:
        if kind is bool and isinstance(value, bool):
            return value
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is str and isinstance(value, str):
            return value
    names = " or ".join("none" if k is type(None) else k.__name__ for k in options)
    raise RecipeError(f"recipe key {where} = {value!r} has the wrong type: expected {names}")


def from_dict(cls, table: dict, where: str = ""):
    """Build dataclass `cls` from a TOML table, rejecting unknown keys and wrongly typed values."""
    if not isinstance(table, dict):
        raise RecipeError(f"recipe entry {where or '<top>'} must be a table, got {table!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        scope = f"[{where}]" if where else "the top level (sections)"
        raise RecipeError(f"unknown recipe key(s) {', '.join((where + '.' if where else '') + k for k in unknown)}; "
                          f"valid keys in {scope}: {', '.join(fields)}")
    values = {}
    for name, value in table.items():
        key = f"{where}.{name}" if where else name
        hint = hints[name]
        values[name] = (from_dict(hint, value, key) if dataclasses.is_dataclass(hint)
                        else _check_type(value, hint, key))
    return cls(**values)


def parse_override(text: str) -> tuple[list[str], object]:
    """'train.lr=3e-4' -> (['train', 'lr'], 3e-4). Values are TOML literals; a bare word is a string."""
    if "=" not in text:
        raise RecipeError(f"--set {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2 or not all(path):
        raise RecipeError(f"--set {text!r}: the key must be section.key (e.g. train.lr), got {key!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # an unquoted string such as runs/demo
    return path, value


# Paths in a recipe *file* that name the user's data (DATA_PATH_KEYS). A relative one is looked up in
# `--data-dir` when given; otherwise in the recipe file's folder, then in the current directory (the first
# place where it exists wins; found nowhere, it stays as written and the resolver reports it missing). So a
# recipe beside its data works from any directory, and a shipped recipe takes its data from `--data-dir`.
# `--set` values are used as typed (relative to the current directory, as the shell sees them); run.dir and
# checkpoint.load name runs and stay relative to the current directory, where `megazoo train` writes runs.
#
# A tokenizer that names an item of the data catalog (data/published/catalog.py, e.g. "gpt2-bpe") is looked up in
# `--data-dir`, then in `catalog_dirs` (the command line passes $MEGAZOO_DATA_DIR and the user cache folder), in a
# recipe file and in `--set` alike; found nowhere, the name stays and the resolver says how to fetch it. (A
# folder of your own that happens to be called "gpt2-bpe" is "./gpt2-bpe".)
DATA_PATH_KEYS = ("paths", "valid_paths", "tokenizer")


def _catalog_tokenizer(value: str, folders: typing.Sequence[Path]) -> str:
    found = find_item(value, folders)
    return str(found.resolve()) if found is not None else value


def _rebase_data_paths(table: dict, recipe_dir: Path, data_dir: Path | None, folders: typing.Sequence[Path]) -> None:
    data = table.get("data")
    if not isinstance(data, dict):
        return
    bases = [data_dir] if data_dir is not None else [recipe_dir, Path.cwd()]

    def rebase(key: str, value):
        if key == "tokenizer" and isinstance(value, str) and value in CATALOG:
            return _catalog_tokenizer(value, folders)
        if not isinstance(value, str) or not value or value.startswith(("hf:", "~")) or Path(value).is_absolute():
            return value
        for base in bases:
            path = os.path.normpath(os.path.abspath(base / value))
            if any(Path(path + suffix).exists() for suffix in ((".idx", ".bin") if key != "tokenizer" else ("",))):
                return path
        return os.path.normpath(os.path.abspath(data_dir / value)) if data_dir is not None else value

    for key in DATA_PATH_KEYS:
        if isinstance(data.get(key), list):
            data[key] = [rebase(key, v) for v in data[key]]
        elif key in data:
            data[key] = rebase(key, data[key])


def _defined_twice(text: str) -> str | None:
    """The first key or [table] a recipe's text defines twice ("train.lr is set twice (lines 5 and 9)"), or None.
    A line scan of `[table]` headers and `key = value` lines; consulted only once tomllib has refused the file."""
    seen: dict[str, int] = {}
    table = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
        assignment = re.match(r"\s*([A-Za-z0-9_-]+)\s*=", line)
        if header:
            table = header.group(1).strip()
            name, what = f"[{table}]", "is defined"
        elif assignment:
            name, what = (f"{table}." if table else "") + assignment.group(1), "is set"
        else:
            continue
        if name in seen:
            return f"{name} {what} twice (lines {seen[name]} and {number})"
        seen[name] = number
    return None


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = (), *, data_dir: str | Path | None = None,
                catalog_dirs: typing.Sequence[str | Path] = ()) -> Recipe:
    """Parse `path`, look its relative data paths up in `data_dir` or the file's folder (DATA_PATH_KEYS), then
    apply the `--set` overrides. A catalog tokenizer name is looked up in `data_dir`, then `catalog_dirs`."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise RecipeError(f"recipe file {path} is not UTF-8 text (byte {err.start}): save it as UTF-8") from None
    except tomllib.TOMLDecodeError as err:
        twice = _defined_twice(path.read_text(encoding="utf-8"))
        if twice:  # tomllib says only "Cannot overwrite a value": name the key and both lines
            raise RecipeError(f"recipe file {path}: {twice}; keep one") from None
        raise RecipeError(f"recipe file {path} is not valid TOML: {err}") from None
    if not table:
        raise RecipeError(f"recipe file {path} is empty: a recipe needs at least a [model] or [data] section "
                          "(see recipes/demo.toml)")
    if data_dir is not None and not Path(data_dir).is_dir():
        raise RecipeError(f"--data-dir {data_dir} is not a folder: give the folder the recipe's data paths are in")
    folders = [Path(d) for d in ([data_dir] if data_dir is not None else []) + list(catalog_dirs)]
    _rebase_data_paths(table, path.parent, Path(data_dir) if data_dir is not None else None, folders)
    for text in overrides:
        (section, key), value = parse_override(text)
        target = table.setdefault(section, {})
        if not isinstance(target, dict):
            raise RecipeError(f"--set {text!r}: {section} is not a section")
        target[key] = _catalog_tokenizer(value, folders) if (section, key) == ("data", "tokenizer") and \
            isinstance(value, str) and value in CATALOG else value
    return from_dict(Recipe, table)

"""The training loop, and the torchrun entry point `python -m megazoo.recipes.train RECIPE.toml [--set k=v ...]`.

One optimizer step = grad_accum micro-batches per dp rank: forward (bf16 autocast on CUDA), vocab-parallel
cross-entropy, backward of loss / grad_accum; then the dp gradient all-reduce, the global gradient norm (tp
aware) and clipping, AdamW with the warmup + cosine schedule. The step number is the whole data position, so
a run can resume at any step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megazoo.data import GlobalBatchSampler
from megazoo.recipes.data_setup import Samples, TrainData, load_data
from megazoo.models.transformer import GPT
from megazoo.models.weights import full_state_dict, init_parameter_, init_weights, named_shards
from megazoo.parallel.tensor.random import TPRNGTracker, seed_default_stream
from megazoo.parallel.topology import Topology, init_distributed
from megazoo.kernels import resolve_kernels
from megazoo.parallel.checkpoint.io import CheckpointError, latest_good_checkpoint, save_checkpoint
from megazoo.parallel.checkpoint.load import load_views
from megazoo.parallel.checkpoint.views import optimizer_steps, set_optimizer_steps
from megazoo.parallel.pipeline.engine import PipelineEngine
from megazoo.parallel.pipeline.partition import rank_chunks
from megazoo.parallel.pipeline.schedules import forward_only, schedule
from megazoo.parallel.zero.build import build_zero
from megazoo.parallel.zero.partitioned import TiedParameters
from megazoo.parallel.zero.loss_scaler import DynamicLossScaler
from megazoo.parallel.zero.stage3 import ZeroStage3
from megazoo.recipes.config import RecipeError, load_recipe
from megazoo.recipes.generate import generate
from megazoo.recipes.metrics import MetricsLog, peak_memory_bytes
from megazoo.recipes.optim import lr_at
from megazoo.recipes.resolve import Resolved, resolve


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    sample: str | None = None
    stopped_at: int | None = None  # set when a stop request (SIGTERM) ended training early


def build_model(res: Resolved, topo: Topology, device=None, dtype: torch.dtype = torch.float32,
                kernels=None) -> list[GPT]:
    """This rank's model chunks: its tp shard of each pipeline (virtual) stage it holds; one chunk, the whole
    model, when pp = 1. Initialised from the recipe's seed: identical full weights for every layout. With
    device="meta" nothing is allocated (ZeRO-3 materialises it unit by unit)."""
    train, par, cfg = res.recipe.train, res.recipe.parallel, res.model
    rng = TPRNGTracker(train.seed, topo.tp_rank, topo.device)
    stages = res.stage_layers
    chunks = []
    for stage in rank_chunks(stages, topo.pp, topo.pp_rank):
        chunk = GPT(cfg, topo, layers=range(stages[stage][0], stages[stage][-1] + 1),
                    with_embedding=stage == 0, with_head=stage == len(stages) - 1, rng=rng,
                    activation_checkpointing=train.activation_checkpointing, device=device or topo.device,
                    dtype=dtype, kernels=kernels)
        if device != "meta":
            init_weights(chunk, train.seed)
        chunks.append(chunk)
    assert len(chunks) == par.virtual_stages
    return chunks


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: "auto" is bf16 on CUDA and fp32 on CPU."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[precision]


class Trainer:
    def __init__(self, res: Resolved, topo: Topology, data: TrainData | None = None):
        self.res, self.topo = res, topo
        t, zero = res.recipe.train, res.recipe.zero
        self.train_cfg = t
        seed_default_stream(t.seed, topo.device)
        self.data = data or load_data(res, topo)
        compute = compute_dtype(t.precision, topo.device)
        half = compute in (torch.float16, torch.bfloat16)
        # Under ZeRO the fp32 masters live in the partitioned optimizer: store parameters in the compute dtype.
        # Stage 0 keeps fp32 parameters and runs half precision as autocast (torch AMP style).
        param_dtype = compute if (half and zero.stage >= 1) or compute == torch.float64 else torch.float32
        # Which implementation runs each fused op; run() prints the choice as the log's first lines.
        self.kernels = resolve_kernels(res.recipe.kernels.choice(), topo.device)
        self.chunks = build_model(res, topo, device="meta" if zero.stage == 3 else None, dtype=param_dtype,
                                  kernels=self.kernels)
        model = self.model = self.chunks[0]  # the whole model when pp = 1
        named = [entry for chunk in self.chunks for entry in named_shards(chunk)]
        chunk_of = {name: i for i, chunk in enumerate(self.chunks) for name, _ in chunk.named_parameters()}
        tied = TiedParameters(frozenset({"wte.weight"}), topo.embedding_group, counted_in_norm=topo.is_first_stage) \
            if topo.pp > 1 else TiedParameters()
        self.zero = build_zero(
            zero.stage, model, named, topo, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
            weight_decay=t.weight_decay, bucket_elements=zero.reduce_bucket_size, offload=zero.offload,
            units=list(model.h.values()), tied=tied, group_of=chunk_of.get, adamw=self.kernels["adamw"].fn,
            init_fn=lambda module, name, tensor, spec: init_parameter_(model, module, name, tensor, spec, t.seed))
        self.optimizer = self.zero.optimizer
        par = res.recipe.parallel
        self.engine = None
        if topo.pp > 1:
            self.engine = PipelineEngine(self.chunks, topo, hidden_size=res.model.d_model, activation_dtype=param_dtype,
                                         loss_fn=self.chunks[-1].loss)
            self.actions = schedule(par.schedule, t.grad_accum, topo.pp, topo.pp_rank, par.virtual_stages)
        self.sampler = GlobalBatchSampler(len(self.data.train), res.global_batch, t.micro_batch, t.grad_accum,
                                          topo.dp_rank, topo.dp, seed=t.seed)
        self.autocast = (lambda: torch.autocast(topo.device.type, dtype=compute)) if half else contextlib.nullcontext
        ls = res.recipe.loss_scale
        self.scaler = DynamicLossScaler(ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale) \
            if compute == torch.float16 else None
        self.consecutive_skips = 0

    def _batch(self, samples: Samples, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = samples.stack(indices).to(self.topo.device, non_blocking=True)  # (b, s + 1)
        return batch[:, :-1], batch[:, 1:]

    def _dp_mean(self, value: torch.Tensor) -> float:
        if self.topo.dp_group is not None:
            dist.all_reduce(value, group=self.topo.dp_group)
            value = value / self.topo.dp
        return value.item()

    def train_step(self, step: int) -> dict:
        """One optimizer step; returns its metrics (the loss is averaged over micro-batches and dp ranks).

        Under fp16 the loss is multiplied by the loss scale before backward; a step whose gradients overflow on
        any rank is skipped everywhere (parameters untouched) and the scaler backs off.
        """
        start = time.perf_counter()
        t, model, zero = self.train_cfg, self.model, self.zero
        lr = lr_at(step, t, self.res.lr_decay_steps)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        zero.comm.reset()
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        micro_batches = self.sampler.indices_for_step(step)
        if self.engine is not None:
            busy_before, total_before = self.engine.stats.busy_s, self.engine.stats.total_s
            batches = [self._batch(self.data.train, indices) for indices in micro_batches]
            losses = self.engine.run(batches, self.actions, loss_scale=scale, autocast=self.autocast,
                                     before_backward=lambda last: zero.begin_micro_batch(last))
            loss_sum += sum(losses) if losses else 0.0
            dist.all_reduce(loss_sum, group=self.topo.pp_group)  # only the last stage computed losses
            busy = self.engine.stats.busy_s - busy_before
            idle = self.engine.stats.total_s - total_before - busy
        for i, indices in enumerate(micro_batches if self.engine is None else []):
            zero.begin_micro_batch(last=i == len(micro_batches) - 1)
            inputs, targets = self._batch(self.data.train, indices)
            with self.autocast():
                logits = model(inputs)
            loss = model.loss(logits, targets)  # fp32 softmax inside
            (loss * (scale / t.grad_accum)).backward()
            loss_sum += loss.detach()
        zero.finish_gradients()
        skipped = False
        if self.scaler is not None:
            skipped = self.scaler.found_overflow(zero.gradients(), self.topo.device)
            self.scaler.update(skipped)
        if skipped:
            zero.zero_grads_()
            norm = torch.tensor(float("nan"))
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.res.recipe.loss_scale.max_consecutive_skips:
                raise FloatingPointError(
                    f"{self.consecutive_skips} consecutive steps overflowed in fp16 (step {step}, loss scale now "
                    f"{self.scaler.scale:g}): the run diverged; lower train.lr, or use precision = \"bf16\"")
        else:
            self.consecutive_skips = 0
            if scale != 1.0:
                zero.scale_grads_(1.0 / scale)
            norm = zero.grad_norm()
            if t.grad_clip > 0:
                zero.clip_(norm, t.grad_clip)
            zero.step(lr)
        loss_value = self._dp_mean(loss_sum / t.grad_accum)
        if not math.isfinite(loss_value) and self.scaler is None:
            raise FloatingPointError(f"training loss is {loss_value} at step {step}: the run diverged "
                                     f"(try a lower train.lr or train.grad_clip)")
        elapsed = time.perf_counter() - start
        metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm.item(),
                   "tokens_per_s": self.res.tokens_per_step / elapsed, "step_time_s": elapsed,
                   "peak_memory_bytes": peak_memory_bytes(self.topo.device),
                   "comm_bytes": zero.comm.summary()["total_bytes"]}
        if self.scaler is not None:
            metrics.update(loss_scale=scale, skipped=skipped)
        if self.engine is not None:  # this rank's pipeline stage: compute vs waiting within the schedule
            metrics.update(pipeline_busy_s=busy, pipeline_idle_s=idle, pipeline_bubble=idle / max(busy + idle, 1e-12))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches global batches of the validation set, split over dp
        ranks: the same samples, so the same number, for every layout. None without validation data."""
        t, model, val = self.train_cfg, self.model, self.data.val
        if val is None:
            return None
        model.eval()
        per_rank = max(1, min(t.eval_batches * self.res.global_batch, len(val)) // self.topo.dp)
        first = self.topo.dp_rank * per_rank
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        micro = [list(range(i, min(i + t.micro_batch, first + per_rank)))
                 for i in range(first, first + per_rank, t.micro_batch)]
        if self.engine is not None:
            batches = [self._batch(val, indices) for indices in micro]
            losses = self.engine.run(batches, forward_only(len(batches), len(self.chunks)), autocast=self.autocast,
                                     forward_only=True)
            total += sum(loss * len(indices) for loss, indices in zip(losses, micro)) if losses else 0.0
            dist.all_reduce(total, group=self.topo.pp_group)
        for indices in micro if self.engine is None else []:
            inputs, targets = self._batch(val, indices)
            with self.autocast():
                logits = model(inputs)
            total += model.loss(logits, targets) * len(indices)
        model.train()
        return self._dp_mean(total / per_rank)

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def layout(self) -> dict:
        par = self.res.recipe.parallel
        return {"dp": par.dp, "tp": par.tp, "pp": par.pp, "virtual_stages": par.virtual_stages,
                "zero_stage": self.res.recipe.zero.stage, "stage_layers": self.res.stage_layers}

    def _views(self):
        """What this rank saves/loads; each value is written by exactly one rank: replicas over dp (handled by
        the optimizer), over tp (tensors not split by tp: tp rank 0) and over pp (the tied embedding: stage 0)."""
        views = self.zero.state_views()
        for view in views:
            if view.spec.dim is None and self.topo.tp_rank != 0:
                view.write = False
            if view.name == "wte.weight" and self.topo.pp > 1 and not self.topo.is_first_stage:
                view.write = False
        return views

    def _rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state(), "tp": self.model.rng.get_state()}
        if self.topo.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.topo.device)
        return state

    def save_checkpoint(self, step: int) -> Path:
        """Save the state after `step` completed steps under run.dir/checkpoints (collective: every rank)."""
        cfg = self.res.recipe.checkpoint
        common = {"step": step, "optimizer_steps": optimizer_steps(self.zero.optimizer),
                  "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                  "recipe": self.res.recipe.to_dict(), "model": dataclasses.asdict(self.res.model)}
        return save_checkpoint(Path(self.res.recipe.run.dir) / "checkpoints", step, self._views(),
                               extras={"rng": self._rng_state(), "layout": self.layout()}, common=common,
                               layout=self.layout(), keep=cfg.keep)

    def load_checkpoint(self, path: str | Path, *, load_optimizer: bool = True) -> int:
        """Load a checkpoint saved at any layout; returns the step to continue from (0 for weights only)."""
        path = Path(path)
        common = torch.load(path / "common.pt", map_location="cpu", weights_only=False) \
            if (path / "common.pt").is_file() else None
        if common is None:
            raise CheckpointError(f"checkpoint {path} has no common.pt")
        mine, saved = dataclasses.asdict(self.res.model), common["model"]
        for key in ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "n_positions"):
            if mine[key] != saved[key]:
                raise CheckpointError(f"checkpoint {path} is for a different model: model.{key} = {saved[key]} "
                                      f"there, {mine[key]} here")
        kinds = None if load_optimizer else ("param", "master")
        manifest = load_views(path, self._views(), kinds=kinds)
        self.zero.after_load()
        if not load_optimizer:
            return 0
        set_optimizer_steps(self.zero.optimizer, common["optimizer_steps"])
        if self.scaler is not None and common["scaler"] is not None:
            self.scaler.load_state_dict(common["scaler"])
        if manifest["layout"] == self.layout() and manifest["world_size"] == self.topo.world_size:
            # Same layout: every rank resumes its own random streams, so dropout continues bit-identically.
            extras = torch.load(path / f"rank{self.topo.rank:05d}.pt", map_location="cpu", weights_only=False)
            rng = extras["extras"]["rng"]
            torch.set_rng_state(rng["cpu"])
            self.model.rng.set_state(rng["tp"])
            if "cuda" in rng and self.topo.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"], self.topo.device)
        return common["step"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters of this rank's stage, whatever the tp and ZeRO layout."""
        gathered = self.zero.gathered() if isinstance(self.zero, ZeroStage3) else contextlib.nullcontext()
        with gathered:
            state = {name: value for chunk in self.chunks for name, value in full_state_dict(chunk).items()}
        if self.topo.pp_group is None:
            return state
        stages = [None] * self.topo.pp
        dist.all_gather_object(stages, state, group=self.topo.pp_group)  # every stage's parameters, all ranks
        return {name: value for part in stages for name, value in part.items()}

    def sample(self) -> str | None:
        s = self.res.recipe.sample
        tok = self.data.tokenizer
        if tok is None or s.tokens == 0 or self.engine is not None:  # sampling is not pipelined (yet)
            return None
        ids = generate(self.model, tok.encode(s.prompt), s.tokens, temperature=s.temperature, top_k=s.top_k,
                       seed=self.train_cfg.seed)
        return tok.decode(ids)

    def _agreed(self, flag: bool) -> bool:
        """True on every rank when any rank says so (a preemption signal may reach ranks at different steps).
        Collective: one all-reduce (max) over all ranks."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.topo.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def fit(self, *, log: MetricsLog | None = None, progress: bool = False, start_step: int = 0,
            stop_requested: Callable[[], bool] | None = None) -> TrainResult:
        """Train steps start_step .. train.steps - 1 (the step number is the whole data position), saving a
        checkpoint every checkpoint.every steps and at the end. When `stop_requested()` turns true on any rank
        (SIGTERM: preemption), the step in progress finishes, a checkpoint is saved and training stops."""
        t, result = self.train_cfg, TrainResult()
        every = self.res.recipe.checkpoint.every
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        for step in range(start_step, t.steps):
            metrics = self.train_step(step)
            stop = stop_requested is not None and self._agreed(stop_requested())
            if stop or (every and ((step + 1) % every == 0 or step + 1 == t.steps)):
                self.save_checkpoint(step + 1)
            if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                metrics["val_loss"] = self.evaluate()
            result.losses.append(metrics["loss"])
            result.grad_norms.append(metrics["grad_norm"])
            if log is not None:
                log.write(metrics)
            if bar is not None:
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}")
                bar.update(1)
            if stop:
                result.stopped_at = step + 1
                break
        if bar is not None:
            bar.close()
        if result.stopped_at is None:
            result.val_loss = self.evaluate()
            result.sample = self.sample()
        return result


def run(res: Resolved, topo: Topology) -> TrainResult:
    """Train as the recipe says, log on rank 0, and print the closing summary there."""
    rank0 = topo.rank == 0
    recipe = res.recipe
    log = MetricsLog(recipe.run.dir, enabled=rank0, wandb_mode=recipe.logging.wandb,
                     project=recipe.logging.wandb_project, config=recipe.to_dict())
    trainer = Trainer(res, topo)
    if rank0:
        print("\n".join(trainer.kernels.describe()), flush=True)
    start_step = _restore(trainer, res, rank0)
    if rank0:
        n_params = sum(p.numel() for p in trainer.model.parameters())
        print(f"megazoo: {res.model.name} ({res.model.num_parameters():,} parameters; {n_params:,} on this rank) "
              f"dp={topo.dp} tp={topo.tp} pp={topo.pp} on {topo.device}; {len(trainer.data.train):,} training "
              f"samples of {recipe.train.seq_len} tokens; global batch {res.global_batch}", flush=True)
    # Preemption: SIGTERM lets the current step finish, then every rank saves a checkpoint and stops.
    terminated = {"flag": False}

    def on_sigterm(*_):
        terminated["flag"] = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM (e.g. the launcher giving up) kills

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = trainer.fit(log=log, progress=rank0 and recipe.logging.progress, start_step=start_step,
                             stop_requested=lambda: terminated["flag"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.close()
    if rank0 and result.stopped_at is not None:
        print(f"megazoo: stopped by SIGTERM after step {result.stopped_at}; checkpoint saved under "
              f"{Path(recipe.run.dir) / 'checkpoints'} (continue with --resume)", flush=True)
    elif rank0:
        if result.losses:
            first, last = result.losses[0], result.losses[-1]
            print(f"train loss {first:.4f} -> {last:.4f} over {len(result.losses)} steps")
        if result.val_loss is None:
            print("validation: no validation data (data.valid_paths is empty)")
        else:
            print(f"validation loss {result.val_loss:.4f}, perplexity {math.exp(min(result.val_loss, 50)):.2f}")
        if result.sample is not None:
            print(f"sample:\n{result.sample}")
        print(f"metrics: {Path(recipe.run.dir) / 'metrics.jsonl'}", flush=True)
    return result


def _restore(trainer: Trainer, res: Resolved, rank0: bool) -> int:
    """--resume: the latest good checkpoint of this run (any layout); else [checkpoint] load; else step 0."""
    cfg = res.recipe.checkpoint
    report = print if rank0 else (lambda *_: None)
    if cfg.resume:
        path = latest_good_checkpoint(Path(res.recipe.run.dir) / "checkpoints", report=report)
        if path is not None:
            step = trainer.load_checkpoint(path)
            report(f"megazoo: resumed from {path} at step {step}")
            return step
        report(f"megazoo: no checkpoint under {Path(res.recipe.run.dir) / 'checkpoints'}: starting at step 0")
    if cfg.load:
        path = Path(cfg.load)
        if not (path / "manifest.json").is_file():  # a checkpoints folder: its latest good checkpoint
            found = latest_good_checkpoint(path, report=report)
            if found is None:
                raise CheckpointError(f"checkpoint.load = {cfg.load}: no good checkpoint there")
            path = found
        step = trainer.load_checkpoint(path, load_optimizer=cfg.load_optimizer)
        report(f"megazoo: loaded {path} ({'with' if cfg.load_optimizer else 'weights only, without'} "
               f"optimizer state), starting at step {step}")
        return step
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megazoo.recipes.train", description="Train a megazoo recipe.")
    parser.add_argument("recipe", help="TOML recipe file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe key (repeatable)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """torchrun entry point: reads the launcher's RANK/WORLD_SIZE, never library code."""
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        res = resolve(load_recipe(args.recipe, args.overrides), world_size=world_size)
    except RecipeError as err:
        print(f"megazoo: error: {err}", file=sys.stderr)
        return 2
    if world_size == 1:
        run(res, Topology.build(res.recipe.parallel.dp, res.recipe.parallel.tp, res.recipe.parallel.pp))
        return 0
    init_distributed(rank, world_size, init_method="env://", timeout_s=res.recipe.parallel.timeout_s)
    par = res.recipe.parallel
    run(res, Topology.build(par.dp, par.tp, par.pp))
    # torch 2.13 + gloo may abort at interpreter exit after all work is done: finish deterministically.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

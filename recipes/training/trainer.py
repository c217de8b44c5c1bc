"""The training loop: steps, not mechanisms.

One optimizer step = grad_accum micro-batches per dp rank, run by the pipeline engine as a schedule (with
pp = 1 a one-chunk 1F1B schedule: forward then backward of each micro-batch in turn). Each micro-batch:
forward (bf16/fp16 autocast when the recipe asks), vocab-parallel cross-entropy, backward of loss / grad_accum
(x the fp16 loss scale), during which the ZeRO stage reduces gradients over dp. Then `optimizer_step`
(parallel/zero/interface.py): overflow check, unscale, global norm across tp / ZeRO partitions / pp, clipping,
AdamW with the warmup + cosine learning rate. The step number is the whole data position, so a run can resume
at any step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megazoo.data.batches import GlobalBatchSampler
from megazoo.data.sft.chat_template import chat_prompt, cut_at_end_of_turn, end_of_turn, resolve_template
from megazoo.data.sft.packing import SFTRows
from megazoo.models.moe.router import update_expert_bias
from megazoo.models.weights import full_state_dict
from megazoo.parallel import accelerator
from megazoo.parallel.context import split_sequence
from megazoo.parallel.pipeline.engine import PipelineEngine
from megazoo.parallel.pipeline.overlap_engine import OverlapPipelineEngine
from megazoo.parallel.pipeline.p2p import evaluation_plan_for, plan_for
from megazoo.parallel.pipeline.schedules import placement
from megazoo.parallel.tensor.random import seed_default_stream
from megazoo.parallel.topology import Topology
from megazoo.parallel.zero.interface import optimizer_step
from megazoo.parallel.fault_tolerance.stragglers import straggler_watch
from megazoo.recipes.training import checkpointing
from megazoo.recipes.training.data_setup import Samples, TrainData, load_data
from megazoo.recipes.training.sample import generate
from megazoo.recipes.training.metrics import MetricsLog, peak_memory_bytes
from megazoo.recipes.training.moe_metrics import MoEStepMetrics, progress_fields, set_aux_grad_scale
from megazoo.models.flops import model_flops_per_token
from megazoo.recipes.gpus import peak_flops
from megazoo.recipes.training.model_setup import (Precision, build_model, build_optimizer, configure_matmuls,
                                                  overlap_sub_stages, run_kernels)
from megazoo.recipes.training.optim import lr_at
from megazoo.recipes.training.progress import Progress
from megazoo.recipes.resolve import Resolved

# recipes/gpus.py states peaks by these names
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_loss: float | None = None
    sample: str | None = None
    stopped_at: int | None = None  # set when a stop request (SIGTERM) ended training early
    checkpoint: Path | None = None  # the last checkpoint this run saved


class Trainer:
    def __init__(self, res: Resolved, topo: Topology, data: TrainData | None = None, replica_group: int = 0):
        self.res, self.topo = res, topo
        self.replicas = None  # fault tolerance: a ReplicaGroup (parallel/fault_tolerance/replica.py), set by the caller
        t, par = res.recipe.train, res.recipe.parallel
        self.train_cfg = t
        seed_default_stream(t.seed, topo.device)
        self.data = data or load_data(res, topo)
        precision = self.precision = Precision.of(res, topo.device)
        configure_matmuls(topo.device, t.tf32)
        # MFU: this rank's share of the model FLOPs of a step over the GPU's spec peak (none on CPU).
        self.flops_per_token = model_flops_per_token(res.model, t.seq_len, res.padded_vocab)
        self.peak_flops = peak_flops(accelerator.device_name(topo.device),
                                     DTYPE_NAMES.get(precision.compute, ""))
        self.kernels = run_kernels(res, topo.device, precision)  # run() prints the choice as the log's first lines
        self.chunks = build_model(res, topo, device="meta" if res.recipe.zero.stage == 3 else None,
                                  dtype=precision.params, kernels=self.kernels)
        self.model = self.chunks[0]  # the whole model when pp = 1
        self.zero = build_optimizer(res, topo, self.chunks, self.kernels)
        self.optimizer = self.zero.optimizer
        # One chunk (pp = 1) runs 1F1B whatever the recipe's schedule: each backward right after its forward.
        self.schedule = par.schedule if topo.pp > 1 else "1f1b"
        # parallel.fb_overlap: DualPipe-V's forward/backward overlap over the chunks' sub-stages (model_setup.py);
        # recipes/layout_checks refused what they do not cover; autocast is entered around each compute sub-stage
        engine, extra = ((OverlapPipelineEngine, {"sub_stages": overlap_sub_stages}) if par.fb_overlap
                         else (PipelineEngine, {}))
        self.engine = engine(self.chunks, topo, hidden_size=res.model.d_model,
                             activation_dtype=precision.params, loss_fn=self._loss,
                             placement=placement(self.schedule), recomputing=t.activation_checkpointing, **extra)
        self.plan = plan_for(self.schedule, t.grad_accum, topo.pp, topo.pp_rank, par.virtual_stages)
        # Replica group g (fault tolerance) reads the g-th share of every global batch: its dp ranks are g x dp + ...
        groups = res.recipe.fault_tolerance.replica_groups if res.recipe.fault_tolerance.enabled else 1
        self.sampler = GlobalBatchSampler(len(self.data.train), res.global_batch, t.micro_batch, t.grad_accum,
                                          replica_group * topo.dp + topo.dp_rank, topo.dp * groups, seed=t.seed)
        self.autocast = precision.autocast
        self.scaler = precision.loss_scaler(res)
        self.consecutive_skips = 0
        self.progress: Progress | None = None  # set by the entry point: where this rank is, for stall reports
        self.rank_times: tuple[list[float], list[float]] | None = None  # the last step's per-rank compute / wait
        self.stragglers = straggler_watch(res.recipe.fault_tolerance, topo)
        # MoE: the routing figures of each step (moe_metrics.py), read with the loss
        self.moe = MoEStepMetrics(self.chunks, res.model, topo) if res.model.n_experts else None
        self.mtp_loss: float | None = None  # the last step's MTP loss (model.mtp_depth > 0)

    def _loss(self, logits: torch.Tensor, targets) -> torch.Tensor:
        """The micro-batch's mean token loss. A tuple (targets, weight, inputs): SFT rows' weight (its share of the
        step's mean, None: 1) and, with multi-token prediction, the inputs its next-token embeddings read."""
        if isinstance(targets, tuple):
            targets, weight, inputs = (*targets, None)[:3]
            loss = self.chunks[-1].loss(logits, targets, inputs)
            return loss if weight is None else loss * weight
        return self.chunks[-1].loss(logits, targets)

    def _batches(self, samples: Samples, micro_batches: list[list[int]],
                 step: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) per micro-batch: the samples' tokens shifted by one; with cp > 1 this cp rank's two
        load-balanced chunks of both (parallel/context/layout.py), (b, s / cp) each."""
        out, cp, cp_rank = [], self.topo.cp, self.topo.cp_rank
        weights, mtp = None, self.res.model.mtp_depth > 0  # MTP: the last stage reads the inputs too
        if isinstance(samples, SFTRows) and step is not None:  # training: the step's mean over all response tokens
            weights = samples.micro_batch_weights(self.sampler.global_indices_for_step(step), micro_batches,
                                                  len(micro_batches) * self.topo.dp)
        for k, indices in enumerate(micro_batches):
            if isinstance(samples, SFTRows):  # fine-tuning rows: targets already -100 off the responses
                inputs, targets, segments = (t.to(self.topo.device, non_blocking=True) for t in samples.batch(indices))
                inputs, targets = split_sequence(inputs, cp, cp_rank), split_sequence(targets, cp, cp_rank)
                if weights is not None or mtp:
                    targets = (targets, None if weights is None else weights[k], inputs)
                out.append((inputs, targets, segments) if samples.packing else (inputs, targets))  # segments: packed
                continue
            batch = samples.stack(indices).to(self.topo.device, non_blocking=True)  # (b, s + 1)
            inputs, targets = split_sequence(batch[:, :-1], cp, cp_rank), split_sequence(batch[:, 1:], cp, cp_rank)
            out.append((inputs, (targets, None, inputs) if mtp else targets))
        return out

    def _host_values(self, total: torch.Tensor, stop: bool = False, norm: torch.Tensor | None = None,
                     per_rank: tuple[float, float] | None = None,
                     extra: torch.Tensor | None = None, mtp: torch.Tensor | None = None) -> tuple[float, bool, float]:
        """The step's host reads, in one place and one collective: the loss averaged over dp x cp (only the last
        pipeline stage computed it; tp ranks hold copies, so tp rank 0 speaks for them), whether any rank asked
        to stop (SIGTERM may reach ranks at different steps) and the gradient norm (the same on every rank:
        rank 0's is taken); `extra`: more float64 slots summed over all ranks (MoE routing figures), their sums
        left in self.extra_values. Collective: one all-reduce (sum) over all ranks, then one device-to-host read."""
        f64, device = torch.float64, total.device
        share = (total.to(f64) / self.topo.grad_size if self.topo.tp_rank == 0
                 else torch.zeros((), dtype=f64, device=device))
        norm = norm.to(device, f64) if norm is not None and self.topo.rank == 0 else torch.zeros((), dtype=f64,
                                                                                                device=device)
        # torch.full, not torch.tensor: a tensor built from a Python number on CUDA is a blocking host-to-device copy
        # (measured on an H100 by tests/gpu/test_host_syncs_cuda.py: two syncs per step instead of one).
        packed = torch.stack([share, torch.full((), float(stop), dtype=f64, device=device), norm])
        if extra is not None:
            packed = torch.cat([packed, extra.to(device, f64)])
        if mtp is not None:  # the MTP modules' mean loss (last stage), averaged like the loss; after the 3 above
            mtp_share = mtp.to(f64) / self.topo.grad_size if self.topo.tp_rank == 0 else torch.zeros_like(share)
            packed = torch.cat([packed, mtp_share.reshape(1)])
        world = self.topo.world_size
        if per_rank is not None and world > 1:  # each rank's (compute, wait) seconds in its own two slots
            slots = torch.zeros(2 * world, dtype=f64, device=device)
            for k, seconds in enumerate(per_rank):  # fill_ with a Python number: a kernel, no host-to-device copy
                slots.narrow(0, 2 * self.topo.rank + k, 1).fill_(seconds)
            packed = torch.cat([packed, slots])
        if world > 1:
            dist.all_reduce(packed)
        loss, stops, grad_norm, *slots_ = packed.tolist()
        n_extra = 0 if extra is None else extra.numel()
        self.extra_values, slots_ = slots_[:n_extra], slots_[n_extra:]
        self.mtp_loss = slots_.pop(0) if mtp is not None else None
        self.rank_times = (slots_[0::2], slots_[1::2]) if slots_ else None
        return loss, stops > 0, grad_norm

    def _mtp_losses(self, micro_batches: int) -> torch.Tensor | None:
        """The step's mean MTP loss on this rank (0 off the last stage), or None without MTP: the micro-batches'
        values the last stage's chunk kept (models/transformer.py: GPT.mtp_losses), cleared here."""
        if not self.res.model.mtp_depth:
            return None
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for chunk in self.chunks:  # only the last stage's chunk has any (under zbv not this rank's last chunk)
            for value in chunk.mtp_losses:
                total += value
            chunk.mtp_losses = []
        return total / micro_batches

    def _set_mode(self, training: bool) -> None:
        for chunk in self.chunks:
            chunk.train(training)

    def train_step(self, step: int, stop: bool = False) -> dict:
        """One optimizer step; returns its metrics (the loss is averaged over micro-batches and dp ranks) and,
        under "stop", whether any rank passed `stop` (agreed in the same collective as the loss).

        Under fp16 the loss is multiplied by the loss scale before backward; a step whose gradients overflow on
        any rank is skipped everywhere (parameters untouched) and the scaler backs off.
        """
        start = time.perf_counter()
        accelerator.reset_peak_memory_stats(self.topo.device)  # peak memory per step, not since the start
        t, zero, stats = self.train_cfg, self.zero, self.engine.stats
        lr = lr_at(step, t, self.res.lr_decay_steps)
        zero.comm.reset()
        self._set_mode(True)
        busy_before, total_before = stats.busy_s, stats.total_s
        self._enter(step, "loading batches")
        batches = self._batches(self.data.train, self.sampler.indices_for_step(step), step)
        self._enter(step, "forward/backward (pipeline schedule, gradient reduction)")
        loss_scale = self.scaler.scale if self.scaler is not None else 1.0
        set_aux_grad_scale(self.chunks, loss_scale / len(batches))  # "layer"-scope router losses: as the loss's
        losses = self.engine.run(batches, self.plan, loss_scale=loss_scale,
                                 autocast=self.autocast, before_backward=lambda last: zero.begin_micro_batch(last))
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for loss in losses:
            loss_sum += loss
        self._enter(step, "optimizer step (gradient norm, AdamW, parameter all-gather)")
        outcome = optimizer_step(zero, lr=lr, grad_clip=t.grad_clip, device=self.topo.device, scaler=self.scaler,
                                 replicas=self.replicas)
        if outcome.committed:  # an uncommitted step (a replica group failed in it) is no fp16 overflow
            self.consecutive_skips = self.consecutive_skips + 1 if outcome.skipped else 0
        # DeepSeek-V3's routing bias moves with the step's load (models/moe/router.py); a skipped or uncommitted
        # step keeps it
        update_expert_bias((m for chunk in self.chunks for m in chunk.modules()),
                           self.res.model.moe_bias_update_rate if outcome.committed and not outcome.skipped else 0.0)
        if outcome.skipped and self.consecutive_skips >= self.res.recipe.loss_scale.max_consecutive_skips:
            raise FloatingPointError(
                f"{self.consecutive_skips} consecutive steps overflowed in fp16 (step {step}, loss scale now "
                f"{self.scaler.scale:g}): the run diverged; lower train.lr, or use precision = \"bf16\"")
        self._enter(step, "step metrics (loss, norm and stop all-reduce)")
        busy = time.perf_counter() - start
        loss_value, stop, grad_norm = self._host_values(loss_sum / t.grad_accum, stop, outcome.grad_norm,
                                                        per_rank=(busy - outcome.wait_s, outcome.wait_s),
                                                        extra=self.moe.slots(len(batches)) if self.moe else None,
                                                        mtp=self._mtp_losses(t.grad_accum))
        if not math.isfinite(loss_value) and self.scaler is None:
            raise FloatingPointError(f"training loss is {loss_value} at step {step}: the run diverged "
                                     f"(try a lower train.lr or train.grad_clip)")
        elapsed = time.perf_counter() - start
        metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": self.res.tokens_per_step / elapsed, "step_time_s": elapsed,
                   "peak_memory_bytes": peak_memory_bytes(self.topo.device),
                   "comm_bytes": zero.comm.summary()["total_bytes"], "stop": stop}
        if self.moe is not None:
            metrics.update(self.moe.read(self.extra_values))
        if self.mtp_loss is not None:  # the MTP modules' own loss (mean over depths), unweighted
            metrics["mtp_loss"] = self.mtp_loss
        if self.peak_flops:
            metrics["mfu"] = metrics["tokens_per_s"] * self.flops_per_token / (self.topo.world_size * self.peak_flops)
        if self.scaler is not None:
            metrics.update(loss_scale=outcome.loss_scale, skipped=outcome.skipped)
        if self.rank_times is not None:  # every rank's compute and wait seconds; a persistently slow one named
            metrics.update(rank_compute_s=self.rank_times[0], rank_wait_s=self.rank_times[1])
            if self.stragglers is not None and (named := self.stragglers.observe(step, self.rank_times[0])):
                metrics["stragglers"] = named
                if self.topo.rank == 0:
                    print("\n".join(f"megazoo: {line}" for line in named), flush=True)
        if isinstance(getattr(zero, "outer_steps", None), int):  # DiLoCo: outer steps taken so far, this one's included
            metrics["diloco_outer_steps"] = zero.outer_steps
        if self.replicas is not None:  # live groups, the global batch they trained, commit, heal
            metrics.update(self.replicas.step_metrics(t.micro_batch, t.grad_accum))
        if self.topo.pp > 1:  # this rank's pipeline stage: compute vs waiting within the schedule
            busy = stats.busy_s - busy_before
            idle = stats.total_s - total_before - busy
            metrics.update(pipeline_busy_s=busy, pipeline_idle_s=idle, pipeline_bubble=idle / max(busy + idle, 1e-12))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over the first eval_batches global batches of the validation set, split over dp
        ranks: the same samples, so the same number, for every layout. None without validation data."""
        t, val = self.train_cfg, self.data.val
        if val is None:
            return None
        self._set_mode(False)
        self._enter(None, "evaluation (validation forward passes)")
        per_rank = max(1, min(t.eval_batches * self.res.global_batch, len(val)) // self.topo.dp)
        first = self.topo.dp_rank * per_rank
        micro = [list(range(i, min(i + t.micro_batch, first + per_rank)))
                 for i in range(first, first + per_rank, t.micro_batch)]
        steps = evaluation_plan_for(self.schedule, len(micro), self.topo.pp, self.topo.pp_rank, len(self.chunks))
        losses = self.engine.run(self._batches(val, micro), steps, autocast=self.autocast, forward_only=True)
        # Each micro-batch's loss is its mean over its tokens: weighted by rows, which hold the same number of
        # tokens, except fine-tuning rows, whose response tokens differ per row: those by their share of every
        # evaluated row's response tokens (all dp ranks), as training weighs them, so any layout gives one number.
        if isinstance(val, SFTRows):
            weights = val.micro_batch_weights(list(range(per_rank * self.topo.dp)), micro, len(micro) * self.topo.dp)
            weights = [w * per_rank / len(micro) for w in weights]
        else:
            weights = [len(indices) for indices in micro]
        total = torch.zeros((), dtype=torch.float64, device=self.topo.device)
        for loss, weight in zip(losses, weights):
            total += loss * weight
        self._set_mode(True)
        return self._host_values(total / per_rank)[0]

    def save_checkpoint(self, step: int) -> Path:
        self._enter(step, "checkpoint save")
        # each part recorded: a rank hung writing its files is told from one waiting in the save's gather
        return checkpointing.save(self, step, lambda what: self._enter(step, f"checkpoint save, {what}"))

    def _enter(self, step: int | None, operation: str) -> None:
        if self.progress is not None:
            self.progress.enter(step, operation)

    def load_checkpoint(self, path: str | Path, *, load_optimizer: bool = True) -> int:
        return checkpointing.load(self, path, load_optimizer=load_optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters of the whole model, whatever the tp, pp and ZeRO layout. Collective."""
        with self.zero.gathered():
            state = {name: value for chunk in self.chunks for name, value in full_state_dict(chunk).items()}
        if self.topo.pp_group is None:
            return state
        stages = [None] * self.topo.pp
        # Pickled through the host: CUDA tensors would be unpickled onto the sender's GPU on every rank.
        cpu_state = {name: value.cpu() for name, value in state.items()}
        dist.all_gather_object(stages, cpu_state, group=self.topo.pp_group)  # every stage's parameters, all ranks
        return {name: value for part in stages for name, value in part.items()}

    def sample(self) -> str | None:
        s, tok = self.res.recipe.sample, self.data.tokenizer
        if tok is None or s.tokens == 0 or self.topo.pp > 1 or self.topo.cp > 1:  # nor sequence-split (yet)
            return None
        if isinstance(self.data.train, SFTRows) and s.prompt:  # a fine-tuned model answers a user turn, in the
            # chat template its dataset was written with (PREFIX.sft.json); the sample is the answer alone
            # (chat_template.chat_prompt); the answer ends at the template's end-of-turn marker, as it was trained
            template = self.data.train.examples.manifest["template"]
            prompt, marker = chat_prompt(tok, template, s.prompt), end_of_turn(resolve_template(tok, template)[1])
            ids = generate(self.model, prompt, s.tokens, temperature=s.temperature, top_k=s.top_k,
                           seed=self.train_cfg.seed, stop=lambda new: marker in tok.decode(new))
            return cut_at_end_of_turn(tok.decode(ids[len(prompt):]), marker)[0]
        # An empty prompt starts where every training document starts: right after an end-of-document token.
        prompt = tok.encode(s.prompt) if s.prompt else [tok.eod_id]
        ids = generate(self.model, prompt, s.tokens, temperature=s.temperature, top_k=s.top_k,
                       seed=self.train_cfg.seed)
        return tok.decode(ids if s.prompt else ids[1:])

    def fit(self, *, log: MetricsLog | None = None, progress: bool = False, start_step: int = 0,
            stop_requested: Callable[[], bool] | None = None) -> TrainResult:
        """Train steps start_step .. train.steps - 1 (the step number is the whole data position), saving a
        checkpoint every checkpoint.every steps and at the end. When `stop_requested()` turns true on any rank
        (SIGTERM: preemption), the step in progress finishes, a checkpoint is saved and training stops."""
        t, result = self.train_cfg, TrainResult()
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        try:
            self._train_steps(result, bar, start_step, log, stop_requested)
            checkpointing.wait_for_save(self)  # checkpoint.async_save: the last save is published (or raises)
        except BaseException:
            checkpointing.abandon_save(self)  # this rank's background write finishes; no collective
            raise
        if bar is not None:
            bar.close()
        if result.stopped_at is None:
            result.val_loss = self.evaluate()
            result.sample = self.sample()
        return result

    def _train_steps(self, result: TrainResult, bar, start_step: int, log: MetricsLog | None,
                     stop_requested: Callable[[], bool] | None) -> None:
        t = self.train_cfg
        every, at_end = self.res.recipe.checkpoint.every, self.res.recipe.checkpoint.at_end
        for step in range(start_step, t.steps):
            metrics = self.train_step(step, stop=stop_requested is not None and stop_requested())
            stop = metrics.pop("stop")
            last = step + 1 == t.steps
            if t.eval_every and (step + 1) % t.eval_every == 0 and not last:
                metrics["val_loss"] = self.evaluate()  # eval mode: no dropout, so no random stream moves
            result.losses.append(metrics["loss"])
            result.grad_norms.append(metrics["grad_norm"])
            if log is not None:
                log.write(metrics)  # on disk before the checkpoint of this step exists (a resume keeps it)
            if stop or (every and (step + 1) % every == 0) or (last and (every or at_end)):
                result.checkpoint = self.save_checkpoint(step + 1)
            if bar is not None:
                mtp = {"mtp": f"{metrics['mtp_loss']:.3f}"} if "mtp_loss" in metrics else {}  # the MTP modules' own
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", **mtp, tok_s=f"{metrics['tokens_per_s']:.0f}",
                                **progress_fields(metrics))
                bar.update(1)
            if stop:
                result.stopped_at = step + 1
                break

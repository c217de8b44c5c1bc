"""`megazoo verify --precision own` and `--device cuda`: the layout in the recipe's own precision against a
data-parallel reference in the same precision, with the tolerance stated for that precision.

In fp64 (the default) two layouts that compute the same function agree to ~1e-15, so 1e-10 separates a bug from
rounding by ten orders of magnitude. In the recipe's own precision they do not agree that closely: tp splits a
matmul's reduction, pp and cp change what is summed where, ZeRO >= 1 stores bf16/fp16 parameters that the
reference (ZeRO 0, fp32 parameters under autocast) does not round. So the reference is the closest thing that is
still obviously right: plain data parallelism over the layout's dp ranks, same micro-batches, same precision,
AdamW, no model parallelism, no ZeRO; and the tolerance is the precision's, set between what a good layout
deviates by and what a bug does, measured on CPU (gloo, bf16 autocast, demo_tp2 shrunk): a good tp=2 layout's
gradient norm deviates by ~1e-3, the injected tp bug of tests/recipes/verify/test_verify.py (an input gradient not all-reduced)
by 0.145, the bf16 tolerance is 0.02.

Tolerances (loss and validation loss: relative, per step; gradient norm: relative, per step), per precision:
"""

from __future__ import annotations

from dataclasses import dataclass

# The unit roundoff of each precision: bf16 2^-8, fp16 2^-11, fp32 2^-24, fp64 2^-53.
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24, "fp64": 2.0 ** -53}


@dataclass(frozen=True)
class Tolerances:
    loss: float  # relative
    grad_norm: float  # relative
    val_loss: float  # relative
    parameters: float  # absolute, per element (fp64); in a low precision, per step (times the steps: `for_steps`)

    def for_steps(self, steps: int, precision: str) -> Tolerances:
        return self if precision == "fp64" else Tolerances(self.loss, self.grad_norm, self.val_loss,
                                                           self.parameters * steps)


# Per precision, loss and gradient norm: about its unit roundoff (losses and norms are means and sums of many
# rounded terms, their errors partly cancel), measured on CPU for bf16 (tp=2 against dp: loss 1.7e-5, gradient
# norm 8.2e-4 over 3 steps) with an order of magnitude kept in hand for wider models. Parameters, in a low
# precision: 2 x lr (1e-3) per step, Adam's bound: an element moves by at most ~lr per step, and where its gradient
# is below the precision's rounding the direction is noise, so the two runs can move it in opposite directions
# (measured on CPU, bf16: 3.3e-3 after 3 steps); this only catches parameters gone wrong outright, the per-step
# loss and gradient norm catch a layout bug. fp64 keeps the CPU verification's 1e-10 everywhere.
TOLERANCES = {
    "fp64": Tolerances(1e-10, 1e-10, 1e-10, 1e-10),
    "fp32": Tolerances(1e-5, 1e-4, 1e-5, 2e-3),
    "bf16": Tolerances(5e-3, 2e-2, 5e-3, 2e-3),
    "fp16": Tolerances(1e-3, 5e-3, 1e-3, 2e-3),
}
__doc__ += "\n".join(f"- {name}: loss {t.loss:g}, gradient norm {t.grad_norm:g}, validation loss {t.val_loss:g}, "
                     f"parameters {t.parameters:g}{' per step' if name != 'fp64' else ''}"
                     for name, t in TOLERANCES.items()) + "\n"


def own_precision(recipe_precision: str, device: str) -> str:
    """The precision the recipe trains in on `device`: "auto" is bf16 on CUDA and fp32 on the CPU."""
    if recipe_precision == "auto":
        return "bf16" if device == "cuda" else "fp32"
    return recipe_precision


def cuda_problem(world_size: int) -> str | None:
    """Why `--device cuda` cannot run a layout of `world_size` ranks here (None: it can). Asked before any
    process starts; it initialises CUDA in this process only to count the devices."""
    from megazoo.parallel import accelerator

    if not accelerator.cuda_available():
        return ("--device cuda: no CUDA device here (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES may "
                "hide them): run `megazoo verify` without --device (CPU, fp64), or --precision own on the CPU")
    count = accelerator.cuda_device_count()
    if count < world_size:
        return (f"--device cuda: the shrunk layout needs {world_size} GPUs (one rank each: NCCL does not share a "
                f"GPU between ranks) but {count} are visible; lower the degrees with --set parallel.dp=1 (tp, pp, "
                "cp) or run on a machine with more GPUs")
    return None

"""One dispatch for every fused op: per op, an ordered list of implementations; pick, per device, and say which.

    choice = KernelChoice(prefer="auto", overrides={"cross_entropy": "torch"})   # the recipe's [kernels]
    kernels = resolve_kernels(choice, device)                                     # {op: Implementation}
    for line in kernels.describe(): log(line)                                      # the run log's first lines
    y = kernels["layer_norm"].fn(x, weight, bias, eps)

Rules (the same for every op):
  * a per-op override names the implementation for that op; `prefer` names it for every op that *has* one;
  * an implementation that was asked for but cannot run here is an error that says why and what can run - never a
    silent fallback;
  * otherwise ("auto", or `prefer` names a family without that op, e.g. apex has no bias-GELU) the op takes the
    first implementation of its own ordered list that runs here. Interpreted Triton (TRITON_INTERPRET=1, the
    only way it runs on CPU) is never picked by auto: it exists for tests.

Implementation names: "apex", "triton", "torch" (torch's own fused kernels), "foreach" (AdamW only: torch's
multi-tensor path), "recompute" (attention only: SDPA that keeps q, k, v and recomputes the rest in backward;
only a per-op override picks it) and "reference" (plain torch ops, the definition the others are tested against).
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

from megazoo.kernels import attention, bias_gelu, cross_entropy, layer_norm, optimizer
from megazoo.kernels.availability import Candidate, triton_interpreted

# op -> its implementations, best first. Each family module owns its list (and says why in that order).
REGISTRY: dict[str, tuple[Candidate, ...]] = {
    "layer_norm": layer_norm.CANDIDATES,
    "bias_gelu": bias_gelu.CANDIDATES,
    "attention": attention.CANDIDATES,
    "cross_entropy": cross_entropy.CANDIDATES,
    "adamw": optimizer.CANDIDATES,
}
OPS = tuple(REGISTRY)
PREFER = ("auto", "apex", "triton", "torch", "reference")

# What GPT does when given no kernels: exactly the ops it ran before the dispatch existed.
MODEL_DEFAULTS = {"layer_norm": "torch", "bias_gelu": "torch", "attention": "torch",
                  "cross_entropy": "reference", "adamw": "reference"}


class KernelError(ValueError):
    """A kernel choice that is invalid, or asks for an implementation that cannot run on this device."""


def implementations(op: str) -> tuple[str, ...]:
    return tuple(c.name for c in REGISTRY[op])


@dataclass(frozen=True)
class KernelChoice:
    """The recipe's `[kernels]`: `prefer` for every op, plus per-op overrides ({op: implementation})."""

    prefer: str = "auto"
    overrides: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.prefer not in PREFER:
            raise KernelError(f"kernels.prefer = {self.prefer!r} is invalid; valid: {', '.join(map(repr, PREFER))}")
        for op, impl in dict(self.overrides).items():
            if op not in REGISTRY:
                raise KernelError(f"kernels.{op} is not a kernel op; valid ops: {', '.join(OPS)}")
            if impl not in implementations(op):
                raise KernelError(f"kernels.{op} = {impl!r} is invalid; valid for {op}: "
                                  f"{', '.join(map(repr, implementations(op)))}")
        # Frozen means frozen: keep a read-only copy, not the caller's dict.
        object.__setattr__(self, "overrides", types.MappingProxyType(dict(self.overrides)))


@dataclass(frozen=True)
class Implementation:
    """The chosen implementation of one op: call `fn`; `why` says how it was chosen."""

    op: str
    name: str
    fn: Callable = dataclasses.field(repr=False)
    detail: str
    why: str

    def line(self) -> str:
        return f"kernels: {self.op:<13} = {self.name:<9} {self.detail}  [{self.why}]"


class Kernels(dict):
    """{op: Implementation} for every op, with `describe()` for the run log."""

    def describe(self) -> list[str]:
        return describe(self)


def describe(kernels: Mapping[str, Implementation]) -> list[str]:
    """One line per op: the implementation chosen, what it runs, and why it was chosen."""
    return [kernels[op].line() for op in OPS if op in kernels]


@dataclass(frozen=True)
class ModelOp:
    """One op a model runs, for the run log: the model's own name for it and the dispatch op that picks its
    implementation, or none (`kernel` None: the model has one implementation, which `fixed` names)."""

    name: str
    kernel: str | None = None
    fixed: str = ""


def describe_ops(kernels: Mapping[str, Implementation], ops: tuple[ModelOp, ...]) -> list[str]:
    """One line per op of the model (models/transformer.py: model_ops): the implementation it runs, and why."""
    lines = []
    for op in ops:
        if op.kernel is None:
            lines.append(f"kernels: {op.name:<13} = {'model':<9} {op.fixed}  [the model's one implementation]")
        else:
            lines.append(dataclasses.replace(kernels[op.kernel], op=op.name).line())
    return lines


def _pick(op: str, candidate: Candidate, why: str) -> Implementation:
    detail = candidate.detail
    if candidate.name == "triton" and triton_interpreted():
        detail += " [interpreted: TRITON_INTERPRET=1]"
    return Implementation(op, candidate.name, candidate.load(), detail, why)


def resolve_op(op: str, choice: KernelChoice, device: torch.device,
               dtype: torch.dtype | None = None) -> Implementation:
    """`op`'s implementation for tensors of `dtype` (None: any) on `device` (see the module docstring)."""
    candidates = {c.name: c for c in REGISTRY[op]}
    if op in choice.overrides:
        wanted, source = choice.overrides[op], f"kernels.{op} = {choice.overrides[op]!r}"
    elif choice.prefer != "auto" and choice.prefer in candidates and candidates[choice.prefer].by_prefer:
        wanted, source = choice.prefer, f"kernels.prefer = {choice.prefer!r}"
    else:
        wanted, source = None, None
    where = f"{device}" + (f" for {str(dtype).removeprefix('torch.')}" if dtype is not None else "")
    if wanted is not None:
        reason = candidates[wanted].unavailable(device, dtype)
        if reason:
            runnable = [c.name for c in REGISTRY[op] if c.unavailable(device, dtype) is None]
            raise KernelError(f"{source}: the {wanted} implementation of {op} cannot run on {where}: {reason}\n"
                              f"Implementations of {op} that run here: {', '.join(runnable)}")
        return _pick(op, candidates[wanted], source)
    skipped = []
    for c in REGISTRY[op]:
        reason = c.unavailable(device, dtype)
        if reason is None and c.name == "triton" and (device.type != "cuda" or triton_interpreted()):
            reason = "interpreted, for tests only"
        if reason is None:
            if choice.prefer == "auto":
                why = "auto"
            elif choice.prefer in candidates:  # the family has one, but `prefer` may not pick it (by_prefer)
                why = f"auto: prefer does not pick the {choice.prefer} {op} (set kernels.{op} to use it)"
            else:
                why = f"auto: no {choice.prefer} implementation of {op}"
            if skipped:
                why += "; not " + ", ".join(skipped)
            return _pick(op, c, why)
        skipped.append(f"{c.name}: {_short(reason)}")
    raise KernelError(f"no implementation of {op} runs on {where}: {'; '.join(skipped)}")  # reference always runs


def _short(reason: str) -> str:
    """The first clause of a reason, for the one-line log ("apex is not installed", ...)."""
    return re.split(r"\s\(|[.;:]\s", reason, maxsplit=1)[0].strip()


def resolve_kernels(choice: KernelChoice | None, device: torch.device | str, dtype: torch.dtype | None = None, *,
                    optimizer_device: torch.device | str | None = None,
                    optimizer_dtype: torch.dtype | None = None) -> Kernels:
    """Every op's implementation under `choice` (default: prefer "auto"): the model's ops for tensors of `dtype`
    on `device`, AdamW for the optimizer states' device and dtype (which differ under ZeRO-Offload: fp32 masters
    in CPU memory), defaulting to the model's."""
    choice = choice or KernelChoice()
    device = torch.device(device)
    opt_device = torch.device(optimizer_device) if optimizer_device is not None else device
    return Kernels({op: resolve_op(op, choice, opt_device, optimizer_dtype or dtype) if op == "adamw"
                    else resolve_op(op, choice, device, dtype) for op in OPS})


def model_defaults() -> Kernels:
    """The kernels GPT uses when given none: torch LayerNorm/GELU/SDPA and the reference cross-entropy."""
    by_name = {op: {c.name: c for c in REGISTRY[op]} for op in OPS}
    return Kernels({op: _pick(op, by_name[op][MODEL_DEFAULTS[op]], "model default: no kernels given")
                    for op in OPS})


def kernels_for_model(kernels: KernelChoice | Mapping[str, Implementation] | None,
                      device: torch.device | str = "cpu") -> Kernels:
    """What a model takes: None (the defaults), a KernelChoice (resolved for `device`) or {op: Implementation}
    for some ops (the rest keep the defaults)."""
    if isinstance(kernels, KernelChoice):
        return resolve_kernels(kernels, device)
    given = dict(kernels or {})
    for op, impl in given.items():
        if op not in REGISTRY:
            raise KernelError(f"{op!r} is not a kernel op; valid ops: {', '.join(OPS)}")
        if not isinstance(impl, Implementation) or impl.op != op:
            raise KernelError(f"kernels[{op!r}] must be the Implementation of {op} that resolve_kernels returns, "
                              f"got {impl!r}")
    return Kernels({**model_defaults(), **given})

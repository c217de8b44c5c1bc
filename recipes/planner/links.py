"""ZeRO's communication per link class (intra-node vs inter-node) for flat ZeRO, HSDP and ZeRO++ hpZ, and which
layout wins for a node size and an inter-node bandwidth. Pure arithmetic, like recipes/planner/zero.py.

Psi parameters per device before ZeRO, N = dp, n = dp ranks per node, m = N / n nodes, A = micro-batches per
step; one(k) = Psi (k - 1) / k (one ring reduce-scatter or all-gather of Psi over k ranks, per rank). A ring over
a group that spans nodes runs at the pace of its cross-node hops, so all its bytes count as inter-node (as the
ZeRO++ paper counts ZeRO-3's cross-node volume, and as parallel/collectives.CommLedger measures it):

    layout  stage   intra-node (per rank, per step)        inter-node (per rank, per step)
    flat    1       -                                      2 one(N)            (all of zero.communication_volume,
    flat    2       -                                      (A + 1) one(N)       when the dp group spans nodes;
    flat    3       -                                      3 A one(N)           intra-node when m = 1)
    hsdp    1       2 one(n)                               2 (Psi / n) (m - 1) / m   (all-reduce of the chunk)
    hsdp    2       (A + 1) one(n)                         the same (once per step: the micro-batches'
    hsdp    3       3 A one(n)                             the same  node sums accumulate in the chunk first)
    hpz     3       A one(n)   (backward gather)           2 A one(N)   (forward gather + reduce-scatter)

Stage 3 gathers each block twice per micro-batch but its root unit (embeddings, final norm: `root` elements)
once, so its "3 one(.)" is (3 Psi - root) (k - 1) / k and hpZ's backward gather is (Psi - root) (n - 1) / n;
root = 0 gives the paper's figures.

ZeRO++'s quantized collectives change bytes, not elements (link_bytes): qwZ (stage 3) sends every gather of the
parameters that compute reads (flat: both; hpZ: the forward one across nodes, the backward one from the
secondaries stays unquantized; HSDP: both, inside the node) as int8 + one scale per block of QUANT_BLOCK
(1 + s / 256 bytes per element, s = the scale's bytes, 4 for 16- and 32-bit parameters). qgZ (stages 1-3, flat
or hpZ) replaces the gradient reduce-scatter of R = Psi (stage 1) or A Psi (stages 2-3) elements by a quantized
all-to-all inside the node, R (n - 1) / n elements, and one across nodes of the node's partial sums, R / n
(m - 1) / m, at b + s / 256 bytes each (b = 1 int8, 1/2 int4): per rank, n times fewer elements cross nodes
than in the flat reduce-scatter, each 2-8x smaller. The FP8 all-gather (zero.fp8_all_gather, stage 3, flat or
HSDP) sends the `fp8` elements of the FP8 linears' weights (never root) at 1 byte in both gathers, plus one
all-reduce per step of one fp32 amax per FP8 weight (`fp8_weights` of them) over the gathers' group.

Memory (model states, parallel/zero/groups.py): HSDP partitions over n instead of N; hpZ keeps stage 3's
partition over N plus a secondary copy of Psi / n parameters (held from a unit's forward to its backward, here
counted whole: the upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazoo.recipes.planner.zero import PlanError, communication_volume, model_state_memory, StateBytes

SHARDINGS = ("flat", "hsdp", "hpz")


@dataclass(frozen=True)
class LinkVolume:
    """Elements each rank sends per step on each link class."""

    sharding: str
    stage: int
    intra: float
    inter: float

    def seconds(self, element_bytes: int, intra_bw: float, inter_bw: float) -> float:
        """Time on the wire, nothing overlapped: intra bytes at intra_bw + inter bytes at inter_bw (bytes/s)."""
        return self.intra * element_bytes / intra_bw + self.inter * element_bytes / inter_bw


def check_sharding(sharding: str, stage: int, dp: int, per_node: int) -> None:
    if sharding not in SHARDINGS:
        raise PlanError(f"sharding {sharding!r} is invalid; valid: {', '.join(SHARDINGS)}")
    if sharding != "flat" and stage == 0:
        raise PlanError(f"sharding {sharding!r} needs ZeRO stage 1-3 (stage 0 partitions nothing)")
    if sharding == "hpz" and stage != 3:
        raise PlanError(f"sharding 'hpz' needs ZeRO stage 3 (got {stage})")
    if not isinstance(per_node, int) or per_node < 1 or (dp % per_node if per_node < dp else per_node % dp):
        raise PlanError(f"dp ranks per node = {per_node!r} must divide dp = {dp} (or be a multiple of it)")


def link_volume(psi: int, dp: int, per_node: int, stage: int, sharding: str = "flat", *,
                grad_accum: int = 1, root: int = 0) -> LinkVolume:
    """The table above: elements per rank per step on each link class (`root`: stage 3's root unit)."""
    check_sharding(sharding, stage, dp, per_node)
    if not 0 <= root <= psi:
        raise PlanError(f"root = {root} elements must be between 0 and psi = {psi}")
    n = min(per_node, dp)
    m = dp // n
    a = grad_accum

    def one(k: int) -> float:
        return psi * (k - 1) / k

    if sharding == "flat":
        total = communication_volume(psi, dp, stage, grad_accum=a).elements
        total -= a * root * (dp - 1) / dp if stage == 3 else 0.0
        return LinkVolume(sharding, stage, 0.0 if m > 1 else total, total if m > 1 else 0.0)
    if sharding == "hpz":
        return LinkVolume(sharding, stage, a * (psi - root) * (n - 1) / n, 2 * a * one(dp))
    chunk_all_reduce = 2 * (psi / n) * (m - 1) / m
    intra = {1: 2 * one(n), 2: (a + 1) * one(n), 3: a * (3 * psi - root) * (n - 1) / n}[stage]
    return LinkVolume(sharding, stage, intra, chunk_all_reduce)


QUANT_BLOCK = 256  # elements per scale (parallel/zero/quantized.py QWZ_BLOCK, qgz.py QGZ_BLOCK)
QUANT_BYTES = {"int8": 1.0, "int4": 0.5}


@dataclass(frozen=True)
class LinkBytes:
    """Bytes each rank sends per step on each link class."""

    intra: float
    inter: float


def wire_bytes(kind: str, element_bytes: float) -> float:
    """Bytes per element on the wire: `element_bytes` unquantized ("none"), else the int8 / int4 value plus its
    share of one scale per QUANT_BLOCK elements (the scale in the tensor's dtype, at least fp32)."""
    if kind == "none":
        return element_bytes
    if kind not in QUANT_BYTES:
        raise PlanError(f"quantization {kind!r} is invalid; valid: none, {', '.join(QUANT_BYTES)}")
    return QUANT_BYTES[kind] + max(4, element_bytes) / QUANT_BLOCK


def link_bytes(psi: int, dp: int, per_node: int, stage: int, sharding: str = "flat", *, grad_accum: int = 1,
               root: int = 0, element_bytes: float = 2, quantized_weights: bool = False,
               quantized_gradients: str = "none", fp8: int = 0, fp8_weights: int = 0) -> LinkBytes:
    """link_volume in bytes, with qwZ (`quantized_weights`, stage 3) and qgZ (`quantized_gradients` "int8" |
    "int4", stages 1-3, not HSDP) applied to the collectives they replace (module docstring)."""
    vol = link_volume(psi, dp, per_node, stage, sharding, grad_accum=grad_accum, root=root)
    if quantized_weights and stage != 3:
        raise PlanError(f"qwZ (quantized weights) needs ZeRO stage 3 (got {stage})")
    if quantized_gradients != "none" and (stage == 0 or sharding == "hsdp"):
        raise PlanError(f"qgZ (quantized gradients) needs ZeRO stage 1-3, flat or hpz (got stage {stage}, "
                        f"{sharding})")
    eb = element_bytes
    # HSDP stages 2-3 with accumulation send the owned chunk across nodes in its fp32 (fp64 stays fp64) master
    # dtype; a single contribution crosses as the reduce-scatter output, in the gradients' dtype
    cross = max(eb, 4) if sharding == "hsdp" and stage >= 2 and grad_accum > 1 else eb
    intra, inter = vol.intra * eb, vol.inter * cross
    n = min(per_node, dp)
    m, a = dp // n, grad_accum
    spans = "inter" if m > 1 else "intra"  # where the flat ring's bytes count
    moved = {"intra": 0.0, "inter": 0.0}  # bytes to take out (unquantized) and put back (quantized)
    if quantized_weights:
        if sharding == "flat":
            gathers, link = a * (2 * psi - root) * (dp - 1) / dp, spans
        elif sharding == "hpz":
            gathers, link = a * psi * (dp - 1) / dp, spans  # the forward gather; the backward one is intra, exact
        else:
            gathers, link = a * (2 * psi - root) * (n - 1) / n, "intra"
        moved[link] += gathers * (wire_bytes("int8", eb) - eb)
    if fp8:  # zero.fp8_all_gather: those elements at 1 byte in every gather, + the step's amax all-reduce
        k, link = (dp, spans) if sharding == "flat" else (n, "intra")
        moved[link] += fp8_gather_change(fp8, fp8_weights, k, eb, a)
    if quantized_gradients != "none":
        reduced = psi * (1 if stage == 1 else a)
        moved[spans] -= reduced * (dp - 1) / dp * eb  # the flat reduce-scatter, gone
        q = wire_bytes(quantized_gradients, eb)
        moved["intra"] += reduced * (n - 1) / n * q
        moved["inter"] += reduced / n * (m - 1) / m * q
    return LinkBytes(intra + moved["intra"], inter + moved["inter"])


def link_state_bytes(psi: int, dp: int, per_node: int, stage: int, sharding: str,
                     state: StateBytes) -> float:
    """Model-state bytes per device (the ZeRO paper's accounting) under `sharding`."""
    check_sharding(sharding, stage, dp, per_node)
    n = min(per_node, dp)
    mem = model_state_memory(psi, n if sharding == "hsdp" else dp, stage, state)
    secondary = psi / n * state.params if sharding == "hpz" else 0.0
    return replace(mem, params_bytes=mem.params_bytes + secondary).device_bytes


@dataclass(frozen=True)
class LinkChoice:
    volume: LinkVolume
    seconds: float
    state_bytes: float


def rank_shardings(psi: int, dp: int, per_node: int, stage: int, *, element_bytes: int, intra_bw: float,
                   inter_bw: float, state: StateBytes, grad_accum: int = 1) -> list[LinkChoice]:
    """Every sharding that applies to `stage`, fastest on the wire first (ties: less memory first)."""
    out = []
    for sharding in SHARDINGS:
        if (sharding == "hpz" and stage != 3) or (sharding != "flat" and stage == 0):
            continue
        vol = link_volume(psi, dp, per_node, stage, sharding, grad_accum=grad_accum)
        out.append(LinkChoice(vol, vol.seconds(element_bytes, intra_bw, inter_bw),
                              link_state_bytes(psi, dp, per_node, stage, sharding, state)))
    return sorted(out, key=lambda c: (c.seconds, c.state_bytes))


def fp8_gather_change(fp8: int, fp8_weights: int, group: int, element_bytes: float, grad_accum: int = 1) -> float:
    """Bytes one rank sends more (negative: fewer) per step under zero.fp8_all_gather, on a gather group of
    `group` ranks: `fp8` elements at 1 byte instead of `element_bytes` in the forward and backward gathers of
    every micro-batch, plus the step's all-reduce of one fp32 amax per FP8 weight (`fp8_weights`)."""
    ring = (group - 1) / group
    return grad_accum * 2 * fp8 * ring * (1 - element_bytes) + 2 * fp8_weights * ring * 4


def fp8_gather_buffer(tensors) -> int:
    """Bytes zero.fp8_all_gather holds beside stage 3's gathered weights: one unit's (block's) FP8 weights
    gathered as 1-byte values before they are dequantized into the unit's buffer (parallel/zero/gather/fp8.py),
    the largest block's; measured by the fake-CUDA dry run (tests/recipes/dry_run/test_dry_run_fp8.py)."""
    blocks: dict[str, int] = {}
    for t in _fp8_weights(tensors):
        block = ".".join(t.name.split(".")[:2])
        blocks[block] = blocks.get(block, 0) + t.numel
    return max(blocks.values(), default=0)


def _fp8_weights(tensors) -> list:
    return [t for t in tensors if t.name.startswith("h.") and (".attn." in t.name or ".mlp." in t.name)
            and t.name.endswith(".weight") and "norm" not in t.name and "router" not in t.name]


def fp8_gathered(tensors) -> dict[str, int]:
    """link_bytes' `fp8` / `fp8_weights` for a stage's tensors (shards.TensorCount) under zero.fp8_all_gather: the
    blocks' attention and MLP projection weights (parallel/tensor/fp8.py enable_fp8; norms and a router stay). A
    ReplicatedKV projection (tp a multiple of the KV heads) also stays high precision and is counted here: an
    over-count of its few elements' bytes."""
    fp8 = _fp8_weights(tensors)
    return {"fp8": sum(t.numel for t in fp8), "fp8_weights": len(fp8)}


# FP8 linears' own transient memory (the activation planner's fp8_workspace; here beside the FP8 gathers' bytes)
FP8_CHUNK_ELEMENTS = 1 << 24  # parallel/tensor/fp8.py's CHUNK_ELEMENTS (its quantize's wide copy), held equal by a test


def _chunk(numel: float, row: float) -> float:
    return min(numel, max(1, FP8_CHUNK_ELEMENTS // row) * row)  # quantize's wide copy: whole rows (tensor/fp8.py)


def fp8_workspace(m: float, n: float, k: float, e: int, ew: int, recipe: str, forward: bool = False) -> float:
    """Bytes an FP8 linear y = x W^T (x m x k, W n x k, dy m x n) holds at its heaviest moment beyond its saved x,
    W and (backward) dy, as parallel/tensor/fp8.py runs it on a GPU (fp32 wide copies, 4 bytes a chunk; e: dx's
    dtype, ew: dW's). Rowwise quantizes dy again (along m) for dW; tensorwise reuses dgrad's copy. Measured by
    the fake-CUDA dry run (tests/recipes/dry_run/test_dry_run_fp8.py); each moment is named below."""
    mk, nk, mn = m * k, n * k, m * n
    # rowwise GEMMs write bf16 only (fp8.scaled_matmul): a wider dx or dW is a cast of that output, both held
    widen = lambda b: b + (2 if recipe == "rowwise" and b != 2 else 0)  # noqa: E731
    dx, dw = widen(e) * mk, widen(ew) * nk
    if forward:  # x's 1-byte copy, then W's beside it while W is quantized
        return max(mk + 4 * _chunk(mk, k), mk + nk + 4 * _chunk(nk, k))
    moments = [mn + 4 * _chunk(mn, n),  # dy quantized (tensorwise: the one copy dgrad and wgrad share)
               mn + nk + 4 * _chunk(nk, k),  # W quantized beside dy's copy
               mn + 2 * nk + dx,  # dgrad's GEMM: W column-major, dx
               dx + mn + mk + 4 * _chunk(mk, k),  # x quantized for dW (after dgrad freed W's copies)
               dx + 2 * mn + 2 * mk + dw]  # wgrad's GEMM: dy^T and x column-major, dW
    if recipe == "rowwise":  # dy again, along the tokens: dy's first copy freed, dx held
        moments.append(e * mk + mn + 4 * _chunk(mn, n))
    return max(moments)

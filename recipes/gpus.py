"""The GPUs megazoo knows, stated once: memory, dense tensor-core peaks per compute dtype, and the links a node of
them has. The planner (`plan --gpu NAME`, fit, search, cost model, reproduce) and the training step's MFU both read
them here. Peaks are NVIDIA's data-sheet dense figures (no sparsity; fp32 matmuls run as TF32); bandwidths are per
GPU in one direction.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPU:
    name: str  # `plan --gpu NAME`
    device_name: str  # what torch.cuda.get_device_name contains for this part ("H100 PCIe" is tried before "H100")
    memory_gb: float  # the planner's GB (1e9 bytes) used as capacity: the marketing size
    peaks: dict = field(compare=False)  # dense FLOP/s by compute dtype name: "bf16", "fp16", "fp32"
    intra_node_bw: float  # bytes/s per GPU within a node (NVLink / NVSwitch, one direction)
    inter_node_bw: float  # bytes/s per GPU across nodes (its share of the node's InfiniBand)
    per_node: int = 8

    @property
    def peak_flops(self) -> float:
        """The dense 16-bit tensor-core peak: what the planner's cost model divides by."""
        return max(self.peaks.get("bf16", 0.0), self.peaks.get("fp16", 0.0))


_HOPPER = {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}
GPUS = {g.name: g for g in (
    # DGX-2: 16 V100 on NVSwitch, 8 x 100 Gb/s IB per 16 GPUs x2. No bf16.
    GPU("v100-32gb", "V100", 32, {"fp16": 125e12, "fp32": 15.7e12}, 150e9, 12.5e9, 16),
    # DGX A100: NVLink3 600 GB/s bidirectional, 200 Gb/s HDR per GPU
    GPU("a100-40gb", "A100", 40, {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, 300e9, 25e9),
    GPU("a100-80gb", "A100", 80, {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}, 300e9, 25e9),
    # DGX H100: NVLink4 900 GB/s bidirectional, 400 Gb/s NDR per GPU
    GPU("h100-80gb", "H100", 80, _HOPPER, 450e9, 50e9),
    # PCIe card: NVLink bridges between pairs at most; PCIe Gen5 x16 (~64 GB/s) between the rest
    GPU("h100-pcie-80gb", "H100 PCIe", 80, {"bf16": 756e12, "fp16": 756e12, "fp32": 378e12}, 64e9, 50e9),
    # H800 (the DeepSeek-V3 report's cluster): the H100 SXM's chip and 80 GB, NVLink cut to 400 GB/s bidirectional;
    # 400 Gb/s InfiniBand per GPU (the report: 8 GPUs a node, IB across)
    GPU("h800-80gb", "H800", 80, _HOPPER, 200e9, 50e9),
    # DGX H200: the H100's chip and links, 141 GB of HBM3e
    GPU("h200-141gb", "H200", 141, _HOPPER, 450e9, 50e9),
)}


def gpu_by_device_name(device_name: str) -> GPU | None:
    """The GPU whose part name `device_name` (torch.cuda.get_device_name) contains; the longest match wins, so
    "NVIDIA H100 PCIe" is the PCIe part and "NVIDIA H100 80GB HBM3" the SXM one. None for an unlisted device."""
    found = [g for g in GPUS.values() if g.device_name in device_name]
    return max(found, key=lambda g: len(g.device_name)) if found else None


def peak_flops(device_name: str | None, dtype_name: str) -> float | None:
    """The dense peak of the GPU `device_name` names (torch.cuda.get_device_name; None for the CPU) for the compute
    dtype ("bf16", "fp16", "fp32"), from the table above; None when unknown (the CPU, an unlisted GPU, a
    dtype the part has no tensor-core rate for)."""
    gpu = gpu_by_device_name(device_name) if device_name else None
    return gpu.peaks.get(dtype_name) if gpu else None

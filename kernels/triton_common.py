"""Shared pieces of our Triton kernels: the interpreter probe and launch-size helpers.

Triton fixes at `@triton.jit` time whether a kernel is compiled (CUDA) or interpreted (TRITON_INTERPRET=1, any
device, numpy underneath). Every kernel module imports this one first, so INTERPRETED says which mode all our
kernels are in.

Each kernel module registers its launches as torch ops (`torch.library.custom_op("megazoo::...")`) with a fake
implementation (output shapes and dtypes only: what FakeTensorMode - the dry run, fake CUDA, torch.compile's
tracing - calls instead of launching) and, for the forward ops, an autograd formula that calls the matching
backward op. So the model's Triton ops are single nodes to Dynamo and AOTAutograd (no graph break), and a fake
tensor never reaches a launch. custom_op, not torch.library.triton_op (which would let Inductor see into the
kernel and fuse around it on a GPU): under the interpreter, the only way Triton runs here, triton_op's tracing
runs the interpreted kernel on fake tensors (torch 2.13: "Attempted to access the data pointer on an invalid
python storage" under aot_eager), so it could not be tested on this machine. On a GPU Inductor calls a custom op
as an extern kernel: the same launch, no fusion across it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _probe(x_ptr):
    tl.store(x_ptr, 0)


INTERPRETED: bool = type(_probe).__name__ == "InterpretedFunction"

# The interpreter runs each program instance as Python over numpy arrays: fewer, larger programs (more rows
# per block) are much faster there, while on a GPU smaller blocks keep more SMs busy. Results do not depend on it.
INTERPRETER_ROWS = 64


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(n)


def rows_per_program(n_cols_block: int, gpu_elements: int = 4096, max_rows: int = 16) -> int:
    """Rows one program handles, as a power of two: enough to fill ~`gpu_elements` per block on a GPU."""
    if INTERPRETED:
        return INTERPRETER_ROWS
    return max(1, min(max_rows, gpu_elements // n_cols_block))


def num_warps(block_n: int) -> int:
    """Threads for a program holding whole rows of block_n columns: enough that a wide row does not spill
    registers (T-NLG's 4256 features make an 8192-wide block)."""
    return 16 if block_n >= 8192 else 8 if block_n >= 2048 else 4


def num_programs_for_reduction(device, n_blocks: int) -> int:
    """Programs of a kernel that accumulates per-column partial sums (LayerNorm's dweight/dbias): a few per SM
    on CUDA, each looping over row blocks, so the partial-sum buffer stays small; 1-4 in the interpreter."""
    if INTERPRETED or device.type != "cuda":
        return max(1, min(n_blocks, 4))
    import megazoo.parallel.accelerator as accelerator
    sms = accelerator.multi_processor_count(device)
    return max(1, min(n_blocks, 4 * sms))

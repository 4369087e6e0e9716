"""Pure functions (no parameters): KDA, short conv, AttnRes mixing, attention, MoE routing/experts, activations."""
import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so fp64 reference runs keep full precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def fp32_math(x: torch.Tensor):
    """Context in which the spec's fp32 computations (router scores, AttnRes logits and mix) stay fp32 under
    autocast: `f32(a) @ f32(b)` alone is not enough, autocast would still run that matmul in bf16."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def mm_acc32(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a @ b of 16-bit a, b with fp32 accumulation, the result in out_dtype (CUDA: cuBLAS `mm.dtype` for an fp32
    result; CPU: the same products in fp32). fp32 / fp64 inputs: their plain product, in their dtype."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if a.is_cuda:
        if out_dtype == torch.float32:
            return torch.ops.aten.mm.dtype(a, b, torch.float32)
        return torch.mm(a, b).to(out_dtype)
    return (a.float() @ b.float()).to(out_dtype)

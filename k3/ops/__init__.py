"""Pure functions (no parameters): KDA, short conv, AttnRes mixing, attention, MoE routing/experts, activations."""
import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so fp64 reference runs keep full precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def fp32_math(x: torch.Tensor):
    """Context in which the spec's fp32 computations (router scores, AttnRes logits and mix) stay fp32 under
    autocast: `f32(a) @ f32(b)` alone is not enough, autocast would still run that matmul in bf16."""
    return torch.autocast(device_type=x.device.type, enabled=False)

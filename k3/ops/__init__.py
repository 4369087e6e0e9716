"""Pure functions (no parameters): KDA, short conv, AttnRes mixing, attention, MoE routing/experts, activations."""
import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    """Upcast to at least fp32 (fp64 stays fp64, so fp64 reference runs keep full precision)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()

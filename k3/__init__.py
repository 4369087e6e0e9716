"""k3: an open PyTorch implementation of the Kimi K3 model family."""
__version__ = "0.1.0"

from k3.config import K3Config  # noqa: E402
from k3.errors import CheckpointError, K3ConfigError, K3Error, TokenizerError  # noqa: E402


def __getattr__(name):  # lazy: keep `import k3` light
    if name in ("K3ForCausalLM",):
        from k3.model import K3ForCausalLM
        return K3ForCausalLM
    if name == "K3ForConditionalGeneration":
        from k3.multimodal import K3ForConditionalGeneration
        return K3ForConditionalGeneration
    if name == "generate":
        from k3.generation import generate
        return generate
    raise AttributeError(name)


def compile_model(model, mode: str = "modules", **kw):
    """torch.compile a K3ForCausalLM in place (see k3.compile)."""
    from k3.compile import compile_model as _cm
    return _cm(model, mode=mode, **kw)

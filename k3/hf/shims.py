"""The `trust_remote_code` files k3 writes next to exported weights. Each is a one-line re-export of a class
from the installed k3 package (k3.hf.*), so no model code is copied into checkpoints and a k3 upgrade upgrades
every exported checkpoint."""
from __future__ import annotations

__all__ = ["AUTO_MAP", "TOKENIZER_AUTO_MAP", "shim_files"]

AUTO_MAP = {"AutoConfig": "configuration_k3.K3HFConfig",
            "AutoModel": "modeling_k3.K3HFForCausalLM",
            "AutoModelForCausalLM": "modeling_k3.K3HFForCausalLM"}
TOKENIZER_AUTO_MAP = {"AutoTokenizer": ["tokenization_k3.TikTokenTokenizer", None]}

_HEADER = ('"""transformers `trust_remote_code` shim written by k3: it delegates to '
           'the installed\n`k3` package (pip install k3). {what}"""\n')

_FILES = {
    "configuration_k3.py": ("The config class.", "from k3.hf.configuration import K3HFConfig\n\n__all__ = "
                            "[\"K3HFConfig\"]\n"),
    "modeling_k3.py": ("The model class.", "from k3.hf.modeling import K3HFForCausalLM\n\n__all__ = "
                       "[\"K3HFForCausalLM\"]\n"),
    "tokenization_k3.py": ("The tokenizer class.", "from k3.hf.tokenization import TikTokenTokenizer\n\n__all__ = "
                           "[\"TikTokenTokenizer\"]\n"),
}


def shim_files() -> dict:
    """{file name: source text} of the three shim files."""
    return {name: _HEADER.format(what=what) + body for name, (what, body) in _FILES.items()}

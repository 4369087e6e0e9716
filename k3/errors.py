"""Typed errors. Each names the key, path or field at fault."""


class K3Error(Exception):
    """Base class of every error k3 raises on purpose."""


class K3ConfigError(K3Error, ValueError):
    """An invalid or inconsistent configuration value."""


class CheckpointError(K3Error):
    """A checkpoint that is missing, corrupt, or does not match the model."""


class TokenizerError(K3Error):
    """A tokenizer that cannot be loaded or does not match the model."""


class RequestError(K3Error, ValueError):
    """A bad generation/serving request."""

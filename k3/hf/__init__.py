"""transformers integration: `trust_remote_code` shims that k3 writes next to exported weights.

The files written into a checkpoint (`configuration_k3.py`, `modeling_k3.py`, `tokenization_k3.py`, see
`k3.hf.shims`) only import from here; the classes here delegate to the installed k3 package (model, checkpoint
loader, tokenizer). `transformers` is imported only by these submodules, never by `import k3`.
"""

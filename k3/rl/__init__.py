"""Post-training building blocks: SFT data on the K3 chat format and GRPO-family agentic RL.

    k3.rl.env        the environment protocol, the safe calculator, built-in tasks (calculator, kv-lookup, multi-tool)
    k3.rl.sft_data   generated SFT set of the built-in tasks, chats.jsonl loader, assistant-only masks, packing
    k3.rl.grpo       group advantages, clipped token-level policy loss, k3 KL, truncated importance sampling
    k3.rl.logprobs   chunked fp32 per-token log-probs / entropies from the final hidden states
    k3.rl.routing    record the sampler's expert choices during generate and replay them in training
    k3.rl.rollout    multi-turn batched rollouts through k3.generate, partial rollouts, token budgets
    k3.rl.safety     output filter, reward audit log, human-review gate
    k3.rl.loop       one GRPO update over packed rollouts (routing replayed), metrics.jsonl rows
    k3.rl.trainer    `k3 rl`: the RL run (RLConfig, RLRunner): rollouts, safety hooks, updates, checkpoints, resume
    k3.rl.cli        the `k3 rl` flags (`k3 sft` is in k3/train/cli.py: the pre-training trainer on chat data)
"""
from k3.rl.env import (CalculatorEnv, Env, EnvError, EnvProtocolError, KVLookupEnv, MultiToolEnv, ToolCallError,
                       ToolEnv, checked, list_envs, make_env, register_env, safe_eval)
from k3.rl.grpo import GRPOConfig, group_advantages, grpo_loss
from k3.rl.logprobs import token_logprobs
from k3.rl.loop import flatten_groups, grpo_update, metrics_row
from k3.rl.rollout import RolloutConfig, RolloutEngine, Trajectory, pack_trajectories
from k3.rl.routing import GenerateRoutingRecorder, replay_routing
from k3.rl.safety import AuditLog, OutputFilter, ReviewHook
from k3.rl.sft_data import SFTLoader, builtin_sft_set, encode_chat, load_chats

__all__ = ["CalculatorEnv", "Env", "EnvError", "EnvProtocolError", "KVLookupEnv", "MultiToolEnv", "ToolCallError",
           "ToolEnv", "checked", "list_envs", "make_env", "register_env", "safe_eval", "GRPOConfig",
           "group_advantages", "grpo_loss", "token_logprobs", "RolloutConfig", "RolloutEngine", "Trajectory",
           "pack_trajectories", "GenerateRoutingRecorder", "replay_routing", "AuditLog", "OutputFilter",
           "ReviewHook", "SFTLoader", "builtin_sft_set", "encode_chat", "load_chats", "flatten_groups", "grpo_update",
           "metrics_row"]

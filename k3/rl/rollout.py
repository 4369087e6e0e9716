"""Multi-turn agent rollouts through `k3.generate` (batched, cached decoding: the code the server uses).

Every active trajectory of a batch is one prompt of a `generate` call; a call stops a row at `<|end_of_msg|>`
(the turn end). The finished turn is parsed with `k3.chat.parse_assistant`: tool calls go to `env.step` and their
results are appended as rendered `role="tool"` messages plus the next generation prompt; a turn without calls is
the final answer (`env.check_answer`). The token sequence is kept as ids (the model's own tokens are never
re-tokenised); `gen_mask` is True exactly on the tokens the model sampled, so tool outputs, prompts and the
generation-prompt headers get no gradient.

Budgets: `max_tokens` caps a whole trajectory (prompt + turns + tool results; over it the episode ends with
finish_reason "budget" and reward 0), `max_new_tokens_per_turn` caps one assistant turn ("turn_length"),
`max_turns` caps the assistant turns ("max_turns"). Partial rollouts: with `iteration_budget` a trajectory that has
generated that many tokens in the current `collect` call pauses (even mid-turn) and resumes in the next call; a
GRPO group is returned only when all of its samples are finished.

Sampler log-probs (`compute_logprobs`): `k3.generate(..., return_logprobs=True)` returns the log-probability of
every sampled token under the distribution it was drawn from (temperature applied; with top-k/top-p the truncated,
renormalised distribution), so nothing is recomputed. `recompute_logprobs=True` instead recomputes them after the
episode with `token_logprobs` under no_grad (sampling temperature applied, top-k/top-p truncation not), replaying
the rollout's routing when it was recorded: the trainer's view of the same tokens (tests check the two agree).
Routing (`record_routing`): `k3.generate(..., record_routing=True)` (k3/rl/routing.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from k3.chat import assistant_turn_problem, parse_assistant, render_messages
from k3.errors import K3ConfigError
from k3.rl.env import CheckedEnv, EnvProtocolError, ToolCallError, checked, make_env, normalize_tool_call
from k3.rl.logprobs import token_logprobs
from k3.rl.routing import concat_routing, replay_routing

__all__ = ["RolloutConfig", "Trajectory", "RolloutEngine", "pack_trajectories"]


@dataclass
class RolloutConfig:
    group_size: int = 8
    max_turns: int = 8
    max_new_tokens_per_turn: int = 256
    max_tokens: int = 4096
    iteration_budget: Optional[int] = None   # generated tokens per trajectory per collect() call; None = no pause
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    thinking: bool = False
    prefill_chunk_size: Optional[int] = 2048
    record_routing: bool = True
    compute_logprobs: bool = True            # sampler log-probs from k3.generate (return_logprobs=True)
    recompute_logprobs: bool = False         # instead: recompute them with token_logprobs after the episode
    logprob_chunk: int = 1024
    logprob_pack_tokens: int = 16384         # tokens per packed no-grad forward for the sampler log-probs
    seed: int = 0

    def validate(self) -> None:
        for k in ("group_size", "max_turns", "max_new_tokens_per_turn", "max_tokens"):
            if int(getattr(self, k)) < 1:
                raise K3ConfigError(f"rollout.{k} must be >= 1, got {getattr(self, k)}")
        if self.iteration_budget is not None and self.iteration_budget < 1:
            raise K3ConfigError(f"rollout.iteration_budget must be >= 1 or None, got {self.iteration_budget}")
        if self.do_sample and not self.temperature > 0:
            raise K3ConfigError(f"rollout.temperature must be > 0, got {self.temperature}")


@dataclass
class Trajectory:
    env_name: str
    seed: int
    group: int
    index: int
    prompt: Dict[str, Any]                      # {"messages", "tools"} from env.reset
    token_ids: List[int]
    gen_mask: List[bool]
    prompt_len: int
    messages: List[Dict[str, Any]] = field(default_factory=list)   # the whole conversation (for the audit log)
    tool_calls: List[Dict[str, Any]] = field(default_factory=list)
    observations: List[str] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)               # decoded assistant turns
    final_answer: Optional[str] = None
    rewards: List[float] = field(default_factory=list)             # tool steps, then the answer
    reward: float = 0.0
    done: bool = False
    finish_reason: Optional[str] = None        # answer | env_done | malformed | budget | turn_length | max_turns
    format_error: Optional[str] = None         # why a turn was not a well-formed message (finish "malformed")
    turns: int = 0
    iterations: int = 0                        # collect() calls this trajectory took part in
    sampler_logprobs: Optional[List[float]] = None
    routing: Optional[Dict[str, torch.Tensor]] = None   # router name -> [len(token_ids), k], -1 unknown
    filtered: bool = False
    filter_rules: List[str] = field(default_factory=list)
    env: Any = field(default=None, repr=False)
    turn_start: int = 0
    iter_tokens: int = 0

    @property
    def num_generated(self) -> int:
        return sum(self.gen_mask)

    def to_record(self) -> Dict[str, Any]:
        """JSON-ready summary (no tensors, no env)."""
        return {"env": self.env_name, "seed": self.seed, "group": self.group, "index": self.index,
                "prompt": self.prompt, "tool_calls": self.tool_calls, "observations": self.observations,
                "outputs": self.outputs, "final_answer": self.final_answer, "rewards": self.rewards,
                "reward": self.reward, "finish_reason": self.finish_reason, "turns": self.turns,
                "tokens": len(self.token_ids), "generated_tokens": self.num_generated,
                "filtered": self.filtered, "filter_rules": self.filter_rules, "format_error": self.format_error}


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "big")


class RolloutEngine:
    """Runs groups of `cfg.group_size` trajectories per prompt seed (see the module docstring).

        eng = RolloutEngine(model, tokenizer, "calculator", RolloutConfig(group_size=4))
        groups = eng.collect([100, 101])     # finished groups (lists of Trajectory); paused ones resume later
    """

    def __init__(self, model, tokenizer, env: Union[str, Callable[[], Any]], cfg: Optional[RolloutConfig] = None,
                 env_options: Optional[Dict[str, Any]] = None):
        self.model, self.tok = model, tokenizer
        self.cfg = cfg or RolloutConfig()
        self.cfg.validate()
        if isinstance(env, str):
            name = env
            self.env_factory = lambda: make_env(name, **(env_options or {}))
        elif callable(env):
            self.env_factory = lambda: checked(env())
        else:
            raise K3ConfigError(f"RolloutEngine: env must be a registered name or a factory, got {type(env)}")
        self.eom = tokenizer.eos_id
        if model.config.vocab_size < tokenizer.vocab_size:
            raise K3ConfigError(f"model vocab {model.config.vocab_size} < tokenizer vocab {tokenizer.vocab_size}")
        th = self.cfg.thinking
        full = render_messages([], thinking=th, add_generation_prompt=True, tokenizer=tokenizer)
        bare = render_messages([], thinking=th, add_generation_prompt=False, tokenizer=tokenizer)
        self.gen_prompt_ids = full[len(bare):]
        self.pending: List[List[Trajectory]] = []
        self.calls = 0
        self.stats = {"generated_tokens": 0, "generate_seconds": 0.0}

    @property
    def _from_generate(self) -> bool:
        """Sampler log-probs come from k3.generate (not recomputed after the episode)."""
        return self.cfg.compute_logprobs and not self.cfg.recompute_logprobs

    # ------------------------------------------------------------------------------------------ groups
    def start_group(self, seed: int, group: int) -> List[Trajectory]:
        out = []
        for j in range(self.cfg.group_size):
            env = self.env_factory()
            prompt = env.reset(int(seed))
            ids = render_messages(prompt["messages"], prompt["tools"] or None, thinking=self.cfg.thinking,
                                  add_generation_prompt=True, tokenizer=self.tok)
            if len(ids) >= self.cfg.max_tokens:
                raise K3ConfigError(f"env {env.name!r} seed {seed}: the prompt has {len(ids)} tokens, "
                                    f"rollout.max_tokens is {self.cfg.max_tokens}")
            t = Trajectory(env.name, int(seed), group, j, prompt, list(ids), [False] * len(ids), len(ids),
                           messages=[dict(m) for m in prompt["messages"]], env=env, turn_start=len(ids))
            if self._from_generate:
                t.sampler_logprobs = [0.0] * len(ids)
            out.append(t)
        return out

    def collect(self, seeds: Sequence[int], group_ids: Optional[Sequence[int]] = None) -> List[List[Trajectory]]:
        """Start a group per seed, advance them and every paused group within this iteration's budget; return
        the groups whose samples have all finished (the rest stay pending)."""
        gids = list(group_ids) if group_ids is not None else list(range(len(seeds)))
        self.pending += [self.start_group(s, g) for s, g in zip(seeds, gids)]
        trajs = [t for g in self.pending for t in g if not t.done]
        self.run(trajs)
        ready = [g for g in self.pending if all(t.done for t in g)]
        self.pending = [g for g in self.pending if not all(t.done for t in g)]
        if self.cfg.compute_logprobs and self.cfg.recompute_logprobs:
            self.sampler_logprobs([t for g in ready for t in g])
        for g in ready:
            for t in g:
                t.env = None
        return ready

    # ------------------------------------------------------------------------------------------ the loop
    def _cap(self, t: Trajectory) -> int:
        c = self.cfg
        cap = min(c.max_new_tokens_per_turn - (len(t.token_ids) - t.turn_start), c.max_tokens - len(t.token_ids))
        if c.iteration_budget is not None:
            cap = min(cap, c.iteration_budget - t.iter_tokens)
        return cap

    def run(self, trajs: List[Trajectory]) -> None:
        import time
        from k3.generation import generate
        c = self.cfg
        for t in trajs:
            t.iter_tokens = 0
            t.iterations += 1
        active = [t for t in trajs if not t.done]
        while active:
            caps = [self._cap(t) for t in active]
            batch = [t for t, k in zip(active, caps) if k > 0]
            caps = [k for k in caps if k > 0]
            if not batch:
                break
            prompts = [list(t.token_ids) for t in batch]
            self.calls += 1
            kw = dict(do_sample=c.do_sample, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k) \
                if c.do_sample else {}
            if c.record_routing:
                kw["record_routing"] = True
            if self._from_generate:
                kw["return_logprobs"] = True
            t0 = time.perf_counter()
            out = generate(self.model, prompts, max(caps), stop_token_ids=[self.eom], seed=_seed(c.seed, self.calls),
                           prefill_chunk_size=c.prefill_chunk_size, return_dict=True, **kw)
            picks = out.routing if c.record_routing else None
            self.stats["generate_seconds"] += time.perf_counter() - t0
            for i, (t, cap) in enumerate(zip(batch, caps)):
                new = list(out.new_tokens[i][:cap])
                self.stats["generated_tokens"] += len(new)
                self._merge_routing(t, picks[i] if picks is not None else None, len(prompts[i]) + len(new))
                t.token_ids += new
                t.gen_mask += [True] * len(new)
                if self._from_generate:
                    t.sampler_logprobs += [float(x) for x in out.logprobs[i][:len(new)]]
                t.iter_tokens += len(new)
                if new and new[-1] == self.eom:
                    self._end_turn(t)
                elif len(t.token_ids) >= c.max_tokens:
                    self._finish(t, "budget")
                elif len(t.token_ids) - t.turn_start >= c.max_new_tokens_per_turn:
                    self._finish(t, "turn_length")
            active = [t for t in active if not t.done]

    def _merge_routing(self, t: Trajectory, picks: Optional[Dict[str, torch.Tensor]], n: int) -> None:
        if not self.cfg.record_routing:
            return
        if picks is None:          # this call could not be mapped: the trajectory carries no routing
            t.routing = {}
            return
        if t.routing is None:
            t.routing = {k: v[:n].clone() for k, v in picks.items()}
            return
        if not t.routing:
            return
        for k, v in picks.items():
            old = t.routing[k]
            v = v[:n].clone()
            m = old.shape[0]
            keep = old >= 0
            v[:m] = torch.where(keep, old, v[:m])   # first recording of a position wins
            t.routing[k] = v

    def _finish(self, t: Trajectory, reason: str) -> None:
        t.done, t.finish_reason = True, reason
        t.reward = float(sum(t.rewards)) if reason in ("answer", "env_done") else 0.0

    def _end_turn(self, t: Trajectory) -> None:
        gen = t.token_ids[t.turn_start:]
        text = self.tok.decode([i for i in gen if i < self.tok.vocab_size])
        t.outputs.append(text)
        t.turns += 1
        problem = assistant_turn_problem(gen, self.tok, thinking=self.cfg.thinking)
        if problem is not None:   # not a message: no answer, no tool calls, reward 0 (it stays in the batch)
            t.format_error = problem
            t.messages.append({"role": "assistant", "content": text})
            self._finish(t, "malformed")
            return
        try:
            msg = parse_assistant(gen, tokenizer=self.tok, thinking=self.cfg.thinking)
        except Exception:   # an untrained model need not produce a parsable turn: treat it as an (empty) answer
            msg = {"reasoning_content": None, "content": "", "tool_calls": []}
        calls = msg["tool_calls"]
        amsg = {"role": "assistant", "content": msg["content"]}
        if msg["reasoning_content"] is not None:
            amsg["reasoning_content"] = msg["reasoning_content"]
        if calls:
            amsg["tool_calls"] = calls
        t.messages.append(amsg)
        env: CheckedEnv = t.env
        if not calls:
            t.final_answer = msg["content"].strip()
            t.rewards.append(env.check_answer(t.final_answer))
            self._finish(t, "answer")
            return
        results, env_done = [], False
        for call in calls:
            try:
                t.tool_calls.append(normalize_tool_call(call))
            except ToolCallError:
                t.tool_calls.append({"name": (call.get("function") or {}).get("name"), "raw": call})
            try:
                obs, r, env_done = env.step(call)
            except EnvProtocolError:
                raise
            except ToolCallError as e:
                obs, r = f"error: {e}", 0.0
            t.observations.append(obs)
            t.rewards.append(r)
            name = (call.get("function") or {}).get("name") or "unknown"
            results.append({"role": "tool", "name": name, "content": obs})
            t.messages.append({"role": "tool", "tool_call_id": call.get("id"), "name": name, "content": obs})
            if env_done:
                break
        if env_done:
            self._finish(t, "env_done")
            return
        tool_ids = render_messages(results, None, thinking=False, add_generation_prompt=False, tokenizer=self.tok)
        suffix = tool_ids + self.gen_prompt_ids
        t.token_ids += suffix
        t.gen_mask += [False] * len(suffix)
        if t.sampler_logprobs is not None and self._from_generate:
            t.sampler_logprobs += [0.0] * len(suffix)
        if t.routing:
            for k, v in t.routing.items():
                t.routing[k] = torch.cat([v, v.new_full((len(suffix), v.shape[1]), -1)])
        t.turn_start = len(t.token_ids)
        if t.turns >= self.cfg.max_turns:
            self._finish(t, "max_turns")
        elif len(t.token_ids) >= self.cfg.max_tokens:
            self._finish(t, "budget")

    # ------------------------------------------------------------------------------------------ log-probs
    def sampler_logprobs(self, trajs: List[Trajectory]) -> None:
        """Fill `sampler_logprobs` (per token, 0 off the generated tokens) with packed no-grad forwards of up to
        `logprob_pack_tokens` tokens, replaying the recorded routing when every trajectory of a pack has it."""
        pack: List[Trajectory] = []
        for t in trajs:
            if pack and sum(len(x.token_ids) for x in pack) + len(t.token_ids) > self.cfg.logprob_pack_tokens:
                self._sampler_logprobs(pack)
                pack = []
            pack.append(t)
        if pack:
            self._sampler_logprobs(pack)

    @torch.no_grad()
    def _sampler_logprobs(self, trajs: List[Trajectory]) -> None:
        batch = pack_trajectories(trajs, device=self.model.device)
        ctx = replay_routing(self.model, batch["routing"]) if batch["routing"] else None
        was = self.model.training
        self.model.eval()
        try:
            if ctx is not None:
                with ctx:
                    lp = token_logprobs(self.model, batch["input_ids"], batch["mask"], batch["cu_seqlens"],
                                        chunk=self.cfg.logprob_chunk, temperature=self._temp())
            else:
                lp = token_logprobs(self.model, batch["input_ids"], batch["mask"], batch["cu_seqlens"],
                                    chunk=self.cfg.logprob_chunk, temperature=self._temp())
        finally:
            self.model.train(was)
        lp = lp[0].tolist()
        for t, s, e in zip(trajs, batch["starts"], batch["starts"][1:] + [len(lp)]):
            t.sampler_logprobs = lp[s:e]

    def _temp(self) -> float:
        return self.cfg.temperature if self.cfg.do_sample else 1.0


def pack_trajectories(trajs: Sequence[Trajectory], advantages: Optional[Sequence[float]] = None,
                      device=None) -> Dict[str, Any]:
    """One packed training batch: input_ids [1, N], cu_seqlens [n+1] int32, mask [1, N] (generated tokens),
    advantages [1, N] (a trajectory's advantage on its tokens; zeros if not given), sampler_logp [1, N] (when
    every trajectory has it), routing {router: [N, k]} (when every trajectory has it, else {}), starts."""
    ids, mask, starts = [], [], []
    for t in trajs:
        starts.append(len(ids))
        ids += t.token_ids
        mask += t.gen_mask
    n = len(ids)
    cu = torch.tensor(starts + [n], dtype=torch.int32, device=device)
    out: Dict[str, Any] = {"input_ids": torch.tensor([ids], dtype=torch.long, device=device), "cu_seqlens": cu,
                           "mask": torch.tensor([mask], dtype=torch.bool, device=device), "starts": starts}
    adv = torch.zeros(1, n, device=device)
    if advantages is not None:
        if len(advantages) != len(trajs):
            raise K3ConfigError(f"pack_trajectories: {len(advantages)} advantages for {len(trajs)} trajectories")
        for t, s, a in zip(trajs, starts, advantages):
            adv[0, s:s + len(t.token_ids)] = float(a)
    out["advantages"] = adv
    if all(t.sampler_logprobs is not None for t in trajs):
        out["sampler_logp"] = torch.tensor([[x for t in trajs for x in t.sampler_logprobs]], device=device)
    if all(t.routing for t in trajs):
        out["routing"] = concat_routing([t.routing for t in trajs])
    else:
        out["routing"] = {}
    return out

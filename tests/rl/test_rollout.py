"""Rollouts: the turn logic against a scripted expert (exact token layout, masks, rewards, partial rollouts) and a
random tiny model end to end through k3.generate (shapes, masks, routing, sampler log-probs)."""
import warnings

import pytest
import torch

import k3.generation
from k3.chat import render_messages, render_messages_with_mask
from k3.generation import GenerationOutput
from k3.rl.env import make_env
from k3.rl.rollout import RolloutConfig, RolloutEngine, pack_trajectories
from k3.rl.sft_data import expert_conversation


def _expert_ids(tok, env_name, seed):
    conv = expert_conversation(make_env(env_name), seed)
    return render_messages_with_mask(conv["messages"], conv["tools"], thinking=False, tokenizer=tok)


@pytest.fixture
def scripted(monkeypatch, toy_tok):
    """generate() replaced by the expert: continues each prompt (a prefix of the expert conversation) up to and
    including its next <|end_of_msg|>."""
    state = {"expert": {}, "calls": 0}

    def fake(model, prompts, max_new_tokens, **kw):
        state["calls"] += 1
        new = []
        for p in prompts:
            ex = next(e for e in state["expert"].values() if e[:len(p)] == p)
            j = ex.index(toy_tok.eos_id, len(p))
            new.append(ex[len(p):j + 1][:max_new_tokens])
        return GenerationOutput(None, [len(p) for p in prompts], new, ["stop_token"] * len(new))
    monkeypatch.setattr(k3.generation, "generate", fake)
    return state


@pytest.mark.parametrize("env_name", ["calculator", "multi-tool"])
def test_scripted_expert_layout_masks_rewards(scripted, toy_tok, toy_model, env_name):
    ids, mask = _expert_ids(toy_tok, env_name, 7)
    scripted["expert"][7] = ids
    cfg = RolloutConfig(group_size=2, record_routing=False, compute_logprobs=False, max_tokens=4000)
    eng = RolloutEngine(toy_model, toy_tok, env_name, cfg)
    groups = eng.collect([7])
    assert len(groups) == 1 and len(groups[0]) == 2
    t = groups[0][0]
    # the incrementally built sequence is exactly the full rendering of the expert conversation
    assert t.token_ids == ids
    # generated tokens = the assistant outputs minus the `<|open|>response<|sep|>` the generation prompt supplies
    hdr = 2 + len(toy_tok.encode("response"))
    assert eng.gen_prompt_ids[-hdr:] == [toy_tok.token_to_id("<|open|>")] + toy_tok.encode("response") + [
        toy_tok.token_to_id("<|sep|>")]
    exp = list(mask)
    i = 0
    while i < len(exp):
        if exp[i] and (i == 0 or not exp[i - 1]):
            for k in range(i, i + hdr):
                exp[k] = False
            i += hdr
        i += 1
    assert t.gen_mask == exp
    assert t.reward == 1.0 and t.finish_reason == "answer" and t.final_answer
    assert t.turns == len(t.tool_calls) + 1 and all(isinstance(o, str) for o in t.observations)
    assert t.messages[-1] == {"role": "assistant", "content": t.final_answer}
    b = pack_trajectories(groups[0], advantages=[0.5, -0.5])
    n = 2 * len(ids)
    assert b["input_ids"].shape == (1, n) and b["mask"].shape == (1, n) and b["cu_seqlens"].tolist() == [0, len(ids), n]
    assert b["advantages"][0, :len(ids)].eq(0.5).all() and b["routing"] == {}


def test_partial_rollouts_pause_and_resume(scripted, toy_tok, toy_model):
    ids, _ = _expert_ids(toy_tok, "multi-tool", 3)
    scripted["expert"][3] = ids
    cfg = RolloutConfig(group_size=1, iteration_budget=6, record_routing=False, compute_logprobs=False,
                        max_tokens=4000)
    eng = RolloutEngine(toy_model, toy_tok, "multi-tool", cfg)
    out, iters = eng.collect([3]), 1
    while not out:
        assert len(eng.pending) == 1 and not eng.pending[0][0].done
        out, iters = eng.collect([]), iters + 1
        assert iters < 200
    t = out[0][0]
    assert t.token_ids == ids and t.reward == 1.0 and t.iterations == iters > 3
    assert eng.pending == []


def test_unknown_tool_becomes_observation_and_budget(scripted, toy_tok, toy_model):
    env = make_env("calculator")
    p = env.reset(1)
    msgs = p["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "search", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "error: env 'calculator'.step: unknown tool 'search' "
                                                          "(tools: calculator)"},
        {"role": "assistant", "content": "nope"}]
    ids = render_messages(msgs, p["tools"], thinking=False, add_generation_prompt=False, tokenizer=toy_tok)
    scripted["expert"][1] = ids
    eng = RolloutEngine(toy_model, toy_tok, "calculator", RolloutConfig(group_size=1, record_routing=False,
                                                                          compute_logprobs=False))
    t = eng.collect([1])[0][0]
    assert t.token_ids == ids and t.observations[0].startswith("error: ") and t.reward == 0.0
    assert t.finish_reason == "answer"
    # a budget that ends inside the first turn
    short = RolloutEngine(toy_model, toy_tok, "calculator",
                          RolloutConfig(group_size=1, record_routing=False, compute_logprobs=False,
                                        max_tokens=t.prompt_len + 10))
    t2 = short.collect([1])[0][0]
    assert t2.finish_reason == "budget" and len(t2.token_ids) == t.prompt_len + 10 and t2.reward == 0.0


def test_random_model_end_to_end(toy_tok, make_tiny_model):
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=4,
                            dtype=torch.float64)
    cfg = RolloutConfig(group_size=2, max_new_tokens_per_turn=6, max_turns=2, temperature=1.0, seed=1,
                        prefill_chunk_size=64)
    eng = RolloutEngine(model, toy_tok, "calculator", cfg)
    # capture the sampler's own distributions (lm_head outputs inside generate) to compare with replayed log-probs
    seen = []
    h = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # the routing recording must map every router call
        groups = eng.collect([11])
    h.remove()
    assert len(groups) == 1
    trajs = groups[0]
    for t in trajs:
        T = len(t.token_ids)
        assert len(t.gen_mask) == T == len(t.sampler_logprobs)
        assert t.prompt_len < T and not any(t.gen_mask[:t.prompt_len]) and all(t.gen_mask[t.prompt_len:])
        assert t.done and t.finish_reason in ("answer", "turn_length", "budget")
        assert t.reward in (0.0, 1.0)
        lp = torch.tensor(t.sampler_logprobs)
        gm = torch.tensor(t.gen_mask)
        assert (lp[gm] < 0).all() and (lp[~gm] == 0).all()
        assert set(t.routing) and all(v.shape == (T, model.config.num_experts_per_token)
                                      for v in t.routing.values())
        for v in t.routing.values():      # every position but the last one was routed by the sampler
            assert (v[:-1] >= 0).all() and (v[-1] == -1).all()
    # the first sampled token of each row: its sampler distribution is the prefill's last-position logits
    assert trajs[0].prompt_len == trajs[1].prompt_len        # one prefill batch, in chunks of 64
    # then decode step s feeds token s and yields the distribution of token s + 1: the packed training forward
    # with the replayed routing reproduces the sampler's log-prob of every token of the first turn
    n_pre = (trajs[0].prompt_len + 63) // 64
    for i, t in enumerate(trajs):
        n = 0
        while t.prompt_len + n < len(t.token_ids) and t.gen_mask[t.prompt_len + n]:
            n += 1
        for s in range(n):
            ref = torch.log_softmax(seen[n_pre - 1 + s][i, -1].double(), -1)[t.token_ids[t.prompt_len + s]]
            assert abs(float(ref) - t.sampler_logprobs[t.prompt_len + s]) < 1e-6, (i, s)
    b = pack_trajectories(trajs, advantages=[1.0, -1.0])
    assert b["sampler_logp"].shape == b["input_ids"].shape
    assert all(v.shape[0] == b["input_ids"].shape[1] for v in b["routing"].values())
    assert eng.stats["generated_tokens"] == sum(t.num_generated for t in trajs)


def test_random_model_partial_rollout_keeps_routing(toy_tok, make_tiny_model):
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=6)
    cfg = RolloutConfig(group_size=2, max_new_tokens_per_turn=7, max_turns=1, iteration_budget=3, seed=3)
    eng = RolloutEngine(model, toy_tok, "calculator", cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outs = [eng.collect([5]), eng.collect([])]
        assert outs == [[], []] and all(t.num_generated == 6 for t in eng.pending[0])
        groups = eng.collect([])
    assert len(groups) == 1 and eng.pending == []
    for t in groups[0]:
        assert t.iterations == 3 and t.num_generated <= 7 and t.finish_reason in ("turn_length", "answer")
        for v in t.routing.values():
            assert v.shape[0] == len(t.token_ids) and (v[:-1] >= 0).all()
        assert len(t.sampler_logprobs) == len(t.token_ids)


def test_ragged_prompts_routing_and_packs(toy_tok, make_tiny_model):
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=7)
    cfg = RolloutConfig(group_size=1, max_new_tokens_per_turn=4, max_turns=1, seed=4, logprob_pack_tokens=1)
    eng = RolloutEngine(model, toy_tok, "kv-lookup", cfg, env_options={"num_lines": 8, "hops": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups = eng.collect([1, 2, 3])
    lens = {g[0].prompt_len for g in groups}
    assert len(groups) == 3 and len(lens) > 1          # ragged: prefilled row by row
    for g in groups:
        t = g[0]
        assert all((v[:-1] >= 0).all() for v in t.routing.values())
        # one pack per trajectory (logprob_pack_tokens=1) gives the same values as a single pack
    single = RolloutEngine(model, toy_tok, "kv-lookup", RolloutConfig(group_size=1, max_turns=1, seed=4,
                                                                      max_new_tokens_per_turn=4),
                           env_options={"num_lines": 8, "hops": 2})
    trajs = [g[0] for g in groups]
    old = [list(t.sampler_logprobs) for t in trajs]
    single.sampler_logprobs(trajs)
    for a, t in zip(old, trajs):
        assert torch.allclose(torch.tensor(a), torch.tensor(t.sampler_logprobs), atol=1e-5)


def test_scripted_expert_thinking_mode(scripted, toy_tok, toy_model):
    conv = expert_conversation(make_env("multi-tool"), 9, reasoning=True)
    ids = render_messages(conv["messages"], conv["tools"], thinking=True, add_generation_prompt=False,
                          tokenizer=toy_tok)
    scripted["expert"][9] = ids
    eng = RolloutEngine(toy_model, toy_tok, "multi-tool", RolloutConfig(group_size=1, thinking=True,
                                                                          record_routing=False,
                                                                          compute_logprobs=False))
    t = eng.collect([9])[0][0]
    assert t.token_ids == ids and t.reward == 1.0 and len(t.tool_calls) == 3
    assert t.messages[2]["reasoning_content"] == "I need get_price."


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_generate_logprobs_equal_recomputed_with_replay(toy_tok, make_tiny_model, dtype):
    """The sampler log-probs k3.generate returns equal the trainer's recomputation (packed forward, replayed
    routing, same temperature) within fp tolerance, over multi-turn ragged rollouts."""
    model = make_tiny_model(toy_tok.vocab_size, toy_tok.eos_id, toy_tok.pad_id, toy_tok.bos_id, seed=8, dtype=dtype)
    cfg = RolloutConfig(group_size=2, max_new_tokens_per_turn=6, max_turns=2, temperature=0.7, seed=5,
                        prefill_chunk_size=32)
    eng = RolloutEngine(model, toy_tok, "multi-tool", cfg)
    groups = eng.collect([3, 4])
    trajs = [t for g in groups for t in g]
    got = [list(t.sampler_logprobs) for t in trajs]
    for t, g in zip(trajs, got):
        assert len(g) == len(t.token_ids)
        assert all(x == 0.0 for x, m in zip(g, t.gen_mask) if not m) and all(x < 0 for x, m in zip(g, t.gen_mask) if m)
    eng.sampler_logprobs(trajs)                # the recompute (token_logprobs, routing replayed)
    for t, g in zip(trajs, got):
        torch.testing.assert_close(torch.tensor(g, dtype=torch.float64),
                                   torch.tensor(t.sampler_logprobs, dtype=torch.float64), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("thinking", [False, True])
def test_assistant_turn_problem_accepts_rendered_turns_and_names_broken_ones(toy_tok, thinking):
    """Every assistant turn the chat format renders (answers, tool calls, with and without thinking) is well-formed;
    an unclosed tools block, a wrong close, text outside the blocks, a missing <|end_of_msg|> are named."""
    from k3.chat import assistant_turn_problem
    conv = expert_conversation(make_env("multi-tool"), 3)
    msgs, tools = conv["messages"], conv["tools"]
    if thinking:
        msgs = [dict(m, reasoning_content="think first") if m["role"] == "assistant" else m for m in msgs]
    turns = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render_messages(msgs[:i], tools, thinking=thinking, tokenizer=toy_tok)
        full = render_messages(msgs[:i + 1], tools, thinking=thinking, add_generation_prompt=False, tokenizer=toy_tok)
        assert full[:len(prompt)] == prompt
        assert assistant_turn_problem(full[len(prompt):], toy_tok, thinking=thinking) is None, i
        turns += 1
    assert turns >= 3
    # the last (answer) turn, broken in four ways
    prompt = render_messages(msgs[:-1], tools, thinking=thinking, tokenizer=toy_tok)
    good = render_messages(msgs, tools, thinking=thinking, add_generation_prompt=False, tokenizer=toy_tok)[len(prompt):]
    op, cl, sep, eom = (toy_tok.token_to_id(s) for s in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
    close_msg = [cl] + toy_tok.encode("message") + [sep, eom]
    assert good[-len(close_msg):] == close_msg
    body = good[:-len(close_msg)]
    cases = {
        "unclosed tools": (body + [op] + toy_tok.encode("tools") + [sep] + toy_tok.encode("x") + [eom], "'tools'"),
        "wrong close": (body + [cl] + toy_tok.encode("tools") + [sep, eom], "<|close|>tools while 'message'"),
        "text outside": (body + toy_tok.encode(" 42") + close_msg, "text outside a block: '42'"),
        "no end": (good[:-1], "no <|end_of_msg|>"),
    }
    for name, (ids, want) in cases.items():
        p = assistant_turn_problem(ids, toy_tok, thinking=thinking)
        assert p is not None and want in p, (name, p)


def test_malformed_answer_turn_earns_nothing(scripted, toy_tok, toy_model):
    """An answer followed by a tools block that never closes (a loophole RL found: the lenient parser read it as
    the answer) finishes as "malformed" with reward 0 and the reason in the audit record."""
    env = make_env("calculator")
    conv = expert_conversation(env, 5)
    good, _ = _expert_ids(toy_tok, "calculator", 5)
    op, sep, eom = (toy_tok.token_to_id(s) for s in ("<|open|>", "<|sep|>", "<|end_of_msg|>"))
    cl = toy_tok.token_to_id("<|close|>")
    close_msg = [cl] + toy_tok.encode("message") + [sep, eom]
    assert good[-len(close_msg):] == close_msg
    bad = good[:-len(close_msg)] + [op] + toy_tok.encode("tools") + [sep, eom]
    for ids, reward, reason in ((good, 1.0, "answer"), (bad, 0.0, "malformed")):
        scripted["expert"].clear()
        scripted["expert"][5] = ids
        eng = RolloutEngine(toy_model, toy_tok, "calculator", RolloutConfig(group_size=1, record_routing=False,
                                                                              compute_logprobs=False, max_tokens=4000))
        t = eng.collect([5])[0][0]
        assert t.token_ids == ids and t.finish_reason == reason and t.reward == reward, (reason, t.to_record())
        rec = t.to_record()
        assert (rec["format_error"] is None) == (reason == "answer")
    assert conv["messages"][-1]["role"] == "assistant"

"""The scored KV policies (h2o, keyformer, snapkv): exact kept sets on crafted scores, the
kernels' scores against their PyTorch definition, and generations equal to a dense model that
applies each policy's definition step by step, layer by layer and kv head by kv head."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import random_prompts as prompts

from loom import LLM, SamplingParams
from loom.kernels import load_kernels
from loom.kv.cache import KVCache
from loom.kv.policy import SNAPKV_POOL, SNAPKV_WINDOW, KVPolicy
from loom.kv.scores import (HeadScores, drop_head_entries, gumbel_reference, lowest_unprotected, reference_row_scores,
                             row_key)

BLOCK = 8


# ---- selection on crafted scores --------------------------------------------------------------
def kept_positions(policy: KVPolicy, positions: torch.Tensor, scores: torch.Tensor, last: int,
                   num_prompt: int) -> list[list[list[int]]]:
    dropped = policy.heads_to_drop(positions, scores, last, num_prompt)
    keep = torch.ones_like(positions, dtype=torch.bool)
    if dropped is not None:
        keep.scatter_(-1, dropped, False)
    return [[sorted(positions[l, h][keep[l, h]].tolist()) for h in range(positions.shape[1])]
            for l in range(positions.shape[0])]


def test_h2o_keeps_the_recent_window_and_the_top_scores_of_each_head():
    positions = torch.arange(12, dtype=torch.int32).expand(2, 2, 12).clone()
    scores = torch.tensor([[[9., 1, 8, 2, 7, 3, 6, 4, 5, 0.5, 0, 0], [0., 9, 0.1, 8, 0.2, 7, 0.3, 6, 0.4, 5, 5, 5]],
                           [[1., 1.1, 1.2, 1.3, 9, 8, 1.4, 1.5, 1.6, 1.7, 0, 0], [5., 4, 3, 2, 1, 0, 0.1, 0.2, 0.3, .4, 9, 9]]])
    policy = KVPolicy("h2o", budget=6, recent=2)  # 10 and 11, and the top 4 of 0..9 in each head
    assert kept_positions(policy, positions, scores, last=11, num_prompt=12) == [
        [[0, 2, 4, 6, 10, 11], [1, 3, 5, 7, 10, 11]], [[4, 5, 8, 9, 10, 11], [0, 1, 2, 3, 10, 11]]]
    # Stored order is not position order after holes were filled: the window is by position
    # (stored index 0 holds position 11), the scores by stored index (position 0 scored 11).
    shuffled = torch.tensor([11, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0], dtype=torch.int32).expand(1, 1, 12)
    flat = torch.tensor([[[0., 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]])
    assert kept_positions(policy, shuffled, flat, 11, 12) == [[[0, 7, 8, 9, 10, 11]]]
    assert policy.heads_to_drop(positions[:, :, :6], scores[:, :, :6], 5, 6) is None  # within budget


def test_keyformer_temperature_rises_from_one_to_two_over_max_tokens():
    policy = KVPolicy.resolve("keyformer", 0.5, num_prompt_tokens=40, recent_ratio=0.25, max_tokens=10)
    assert (policy.budget, policy.recent) == (20, 5)
    assert [policy.score_temperature(p, 40) for p in (0, 39, 40, 45, 49)] == [1.0, 1.0, 1.0, 1.5, 1.9]
    h2o = KVPolicy.resolve("h2o", 0.5, 40)
    assert [h2o.score_temperature(p, 40) for p in (0, 45)] == [1.0, 1.0] and not h2o.noisy and policy.noisy


def test_snapkv_scores_only_its_window_pools_and_then_keeps_every_generated_token():
    policy = KVPolicy.resolve("snapkv", 40, num_prompt_tokens=100)
    assert policy.recent == SNAPKV_WINDOW
    assert [policy.score_temperature(p, 100) for p in (67, 68, 99, 100)] == [0.0, 1.0, 1.0, 0.0]
    positions = torch.arange(100, dtype=torch.int32).view(1, 1, 100)
    scores = torch.zeros(1, 1, 100)
    scores[0, 0, 20] = 1.0  # one hit: pooling keeps its neighbours, 8 of them fill the budget
    kept = kept_positions(policy, positions, scores, 99, 100)[0][0]
    half = SNAPKV_POOL // 2
    assert kept[:SNAPKV_POOL] == list(range(20 - half, 20 + half + 1)) and kept[-SNAPKV_WINDOW:] == list(range(68, 100))
    assert len(kept) == 40
    # Generated tokens never go: with 5 generated the budget is 45.
    grown = torch.cat([positions[:, :, :40], torch.arange(100, 105, dtype=torch.int32).view(1, 1, 5)], -1)
    assert policy.heads_to_drop(grown, torch.zeros(1, 1, 45), 104, 100) is None


def test_head_scores_fill_each_heads_holes_from_its_tail():
    state = HeadScores(1, 2, capacity=2)
    state.append(0, 6)
    state.scores.copy_(torch.arange(12.).view(1, 2, 6))
    dropped = torch.tensor([[[1, 5], [3, 4]]])
    assert state.written_by(dropped) == {1, 3}
    moves = state.drop(dropped, [7, 2], [9, 2], block_size=4)  # index i in slot ids[i // 4] * 4 + i % 4
    assert state.positions.tolist() == [[[0, 4, 2, 3], [0, 1, 2, 5]]]
    assert state.scores.tolist() == [[[0., 4, 2, 3], [6, 7, 8, 11]]]
    assert moves.tolist() == [[0, 0, 8, 37], [0, 1, 9, 39]]
    copy = state.clone()
    copy.append(6, 1)
    assert state.num_tokens == 4 and copy.positions[0, 0].tolist() == [0, 4, 2, 3, 6]


# ---- the kernels' scores against their definition --------------------------------------------
def test_gumbel_noise_is_keyed_and_distributed_as_gumbel():
    load_kernels()
    keys = torch.tensor([row_key(0, 0, p) for p in range(64)])
    positions = torch.arange(2048, dtype=torch.int32)
    noise = torch.ops.loom.gumbel_noise(keys, 3, 2, positions)
    assert torch.allclose(noise, gumbel_reference(keys, 3, positions.expand(2, -1)), atol=1e-6)
    euler_gamma, variance = 0.5772, torch.pi ** 2 / 6
    assert abs(noise.mean() - euler_gamma) < 0.01 and abs(noise.var() - variance) < 0.03
    assert not torch.equal(noise[:, 0], noise[:, 1]) and not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise, torch.ops.loom.gumbel_noise(keys, 4, 2, positions))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,block_size", [(2, 16), (1, 8), (4, 16)])
@pytest.mark.parametrize("temp", [1.5, 1.0])
def test_decode_kernel_adds_scores_of_their_definition_to_each_rows_state(dtype, kv_heads, block_size, temp):
    """Row 0 scores with noise (Keyformer), row 1 without (H2O: the attention's own
    probabilities), row 2 not at all; each scored row's state gains exactly the scores of the
    definition in the called layer, and nothing elsewhere; row 0 also gets each head's lowest
    entry old enough to drop."""
    load_kernels()
    g = torch.Generator().manual_seed(0)
    heads, head_dim, batch, num_blocks, num_layers = 4, 32, 3, 40, 2
    cache = KVCache(num_layers, num_blocks, kv_heads, head_dim, block_size, dtype, "cpu")
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=g))
    lens = torch.tensor([37, 70, 5], dtype=torch.int32)
    per_seq = -(-70 // block_size)
    tables = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq).int()
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    temps = torch.tensor([temp, 1.0, 0.0])
    keys = torch.tensor([row_key(1, 0, 37), -1, 5])
    states = []
    for n in lens.tolist():
        state = HeadScores(num_layers, kv_heads, capacity=n + 3)  # wider than the context, as after growth
        state.append(0, n)
        state.positions.copy_(torch.randint(0, 1000, state.positions.shape, generator=g, dtype=torch.int32))
        state.scores.copy_(torch.rand(state.scores.shape, generator=g))  # what earlier steps added
        states.append(state)
    before = [s.scores.clone() for s in states]
    rows = torch.tensor([s.address() for s in states])
    rows[2] = 0  # a row not scored has no state
    newest = torch.tensor([600, -1, -1])
    attn, _ = torch.ops.loom.paged_decode_attention_scored(q, cache.keys[1], cache.values[1], tables, lens, 0.3,
                                                           rows, temps, keys, newest, 1)
    plain, _ = torch.ops.loom.paged_decode_attention(q, cache.keys[1], cache.values[1], tables, lens, 0.3)
    if dtype == torch.float32:
        assert torch.equal(attn, plain)  # scoring changes nothing of the attention
    else:  # but where the CPU has AVX-512 BF16, an unscored bf16 call multiplies by pair products
        torch.testing.assert_close(attn.float(), plain.float(), atol=2e-2, rtol=2e-2)
    for b in range(2):
        n, state = int(lens[b]), states[b]
        k, _ = cache.gather(1, tables[b, :(n + block_size - 1) // block_size].long(), n)
        logits = torch.einsum("hd,htd->ht", q[b].float(), k.float().repeat_interleave(heads // kv_heads, 0)) * 0.3
        added = reference_row_scores(logits[:, None], kv_heads, torch.tensor([n]), temps[b:b + 1], keys[b:b + 1],
                                     1, state.positions[1])
        assert torch.allclose(state.scores[1], before[b][1] + added, atol=1e-5), b
        assert torch.allclose(added.sum(-1), torch.full((kv_heads,), heads / kv_heads))  # probabilities per query head
        assert torch.equal(state.scores[0], before[b][0])  # other layers untouched
    assert torch.equal(states[0].lowest[1], lowest_unprotected(states[0].scores[1], states[0].positions[1], 600))
    assert not states[0].lowest[0].any() and not states[1].lowest.any()  # other layers, and rows not asked
    assert torch.equal(states[2].scores, before[2])  # temperature 0: not scored
    short = rows.clone()
    short[1, 3] = 69  # a state narrower than its row's context is refused, not overrun
    with pytest.raises(RuntimeError, match="shorter than its context"):
        torch.ops.loom.paged_decode_attention_scored(q, cache.keys[1], cache.values[1], tables, lens, 0.3,
                                                     short, temps, keys, newest, 1)


def test_prompt_row_scores_equal_their_definition():
    load_kernels()
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 20, generator=g) * 3
    visible = torch.tensor([15, 16, 17, 18, 19, 20])
    temps = torch.tensor([1.0, 0.0, 1.0, 1.0, 2.0, 1.0])
    keys = torch.tensor([-1, -1, 7, 8, 9, -1])
    out = torch.ops.loom.attention_row_scores(logits, 2, visible, temps, keys, 5)
    assert torch.allclose(out, reference_row_scores(logits, 2, visible, temps, keys, 5), atol=1e-5)
    assert torch.allclose(out.sum(), torch.tensor(4 * 5.0))  # 5 scored rows, 4 query heads each


# ---- generations against a dense model that applies the definitions ---------------------------
def dense_policy_greedy(hf, prompt: list[int], max_tokens: int, name: str, budget: float,
                        recent_ratio: float = 0.3, seed: int = 0) -> list[int]:
    """The reference: the Hugging Face model's weights run densely one token at a time, every
    token's K/V kept in full, with a mask per layer and kv head of what the policy keeps,
    updated after every step from scores computed here by their definition."""
    model = hf.model
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim, group = cfg.hidden_size // heads, heads // kv_heads
    policy = KVPolicy.resolve(name, budget, len(prompt), recent_ratio, max_tokens)
    layers = len(model.layers)
    ks = [torch.zeros(kv_heads, 0, head_dim) for _ in range(layers)]
    vs = [torch.zeros(kv_heads, 0, head_dim) for _ in range(layers)]
    kept = torch.zeros(layers, kv_heads, 0, dtype=torch.bool)  # per stored position
    acc = torch.zeros(layers, kv_heads, 0)
    ids = list(prompt)

    def run(tokens: list[int], start: int) -> torch.Tensor:
        """Runs tokens at positions start.. (a prompt at once, or one decode token); returns the
        last row's logits and adds each scored row's scores to acc."""
        nonlocal kept, acc
        n = len(tokens)
        pos = torch.arange(start, start + n)
        kept = torch.cat([kept, torch.ones(layers, kv_heads, n, dtype=torch.bool)], -1)
        acc = torch.cat([acc, torch.zeros(layers, kv_heads, n)], -1)
        x = model.embed_tokens(torch.tensor([tokens]))
        cos, sin = model.rotary_emb(x, pos[None])
        temps = torch.tensor([policy.score_temperature(p, len(prompt)) for p in pos.tolist()])
        for l, layer in enumerate(model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(1, n, heads, head_dim).transpose(1, 2)
            k = a.k_proj(h).view(1, n, kv_heads, head_dim).transpose(1, 2)
            v = a.v_proj(h).view(1, n, kv_heads, head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            ks[l], vs[l] = torch.cat([ks[l], k[0]], 1), torch.cat([vs[l], v[0]], 1)
            total = ks[l].shape[1]
            logits = torch.einsum("hqd,htd->hqt", q[0], ks[l].repeat_interleave(group, 0)) / head_dim ** 0.5
            causal = torch.arange(total)[None, :] <= pos[:, None]                     # [n, total]
            visible = causal[None] & kept[l][:, None, :]                               # [kvh, n, total]
            visible = visible.repeat_interleave(group, 0)
            p = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
            out = torch.einsum("hqt,htd->hqd", p, vs[l].repeat_interleave(group, 0))
            x = x + a.o_proj(out.transpose(0, 1).reshape(1, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            # Scores, by definition: softmax((x + g) / tau) over the visible keys, summed over the
            # group's query heads and the rows.
            noise = torch.zeros(kv_heads, n, total)
            if policy.noisy:
                rows = torch.tensor([row_key(seed, 0, r) for r in pos.tolist()])
                noise = gumbel_reference(rows, l, torch.arange(total).expand(kv_heads, total)).transpose(0, 1)
            y = (logits.view(kv_heads, group, n, total) + noise[:, None]) / temps.clamp(min=1e-9)[None, None, :, None]
            f = torch.softmax(y.masked_fill(~visible.view(kv_heads, group, n, total), float("-inf")), -1)
            acc[l] += (f * (temps > 0)[None, None, :, None]).sum((1, 2))
        return hf.lm_head(model.norm(x))[0, -1]

    def compress(last: int) -> None:
        """Per layer and kv head: the budget's worth of kept tokens, the recent window first."""
        for l in range(layers):
            for h in range(kv_heads):
                alive = kept[l, h].nonzero().squeeze(1)
                limit = policy.budget
                if name == "snapkv":
                    limit += max(0, last + 1 - len(prompt))
                if len(alive) <= limit:
                    continue
                score = acc[l, h, alive]
                if name == "snapkv":
                    score = F.avg_pool1d(score[None], SNAPKV_POOL, 1, SNAPKV_POOL // 2, count_include_pad=False)[0]
                    protected = alive >= len(prompt) - policy.recent
                else:
                    protected = alive > last - policy.recent
                order = sorted(range(len(alive)), key=lambda i: (protected[i].item(), score[i].item()))
                for i in order[:len(alive) - limit]:
                    kept[l, h, alive[i]] = False

    with torch.no_grad():
        logits = run(prompt, 0)
        compress(len(prompt) - 1)
        for _ in range(max_tokens):
            ids.append(int(logits.argmax()))
            if len(ids) - len(prompt) == max_tokens:
                break
            logits = run([ids[-1]], len(ids) - 1)
            compress(len(ids) - 1)
    return ids[len(prompt):]


@pytest.mark.parametrize("policy", ["h2o", "keyformer", "snapkv"])
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_generations_equal_the_dense_policy_model(gqa, policy, backend):
    model_dir, hf = gqa
    llm = LLM(str(model_dir), block_size=BLOCK, attention_backend=backend, max_num_batched_tokens=24)
    batch = prompts(3, 45, seed=7)
    # snapkv's window is 32 tokens: its budget must leave room for more
    budget = 40 if policy == "snapkv" else 0.5
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_policy=policy, kv_budget=budget)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for p, out in zip(batch, outs):
        assert out.outputs[0].token_ids == dense_policy_greedy(hf, p, 24, policy, budget)
    full = llm.generate([{"prompt_token_ids": p} for p in batch],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert any(f.outputs[0].token_ids != o.outputs[0].token_ids for f, o in zip(full, outs))
    assert llm.stats().num_free_blocks == llm.stats().num_blocks


def count_key_set_changes(model_dir) -> tuple[int, int]:
    """Over a keyformer generation, per layer and kv head and decode step: how often the token
    leaving the recent window was kept, and how often an older key token was evicted."""
    llm = LLM(str(model_dir), block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_policy="keyformer", kv_budget=0.5)
    llm.engine.add_request({"prompt_token_ids": prompts(1, 40, seed=9)[0]}, params)
    leaving_kept = key_evicted = 0
    previous = None
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for seq in llm.engine.scheduler.running:
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                continue
            policy, state = seq.request.kv_policy, seq.kv_scores
            last = seq.num_computed_tokens - 1
            kept = [set(state.positions[l, h].tolist()) for l in range(2) for h in range(2)]
            leaving_kept += sum(last - policy.recent in k for k in kept)
            if previous is not None:  # a key token older than the one leaving the window is gone
                key_evicted += sum(bool({p for p in old if p < last - policy.recent} - new)
                                   for old, new in zip(previous, kept))
            previous = kept
    return leaving_kept, key_evicted


def test_keyformer_key_set_keeps_changing_after_the_prompt(gqa, monkeypatch):
    """Keyformer's reference code drops the token at index n - r (the one leaving the recent
    window) at every step, which freezes the key tokens chosen at the prompt. Here a token
    leaving the window competes with the key tokens by score: some are kept, and key tokens
    chosen earlier are evicted for them. The same count under the reference's rule is zero."""
    model_dir, _ = gqa
    leaving_kept, key_evicted = count_key_set_changes(model_dir)
    assert leaving_kept > 0 and key_evicted > 0

    ours = KVPolicy.heads_to_drop

    def off_by_one(self, positions, scores, last_position, num_prompt_tokens):
        if last_position < num_prompt_tokens:  # the prompt is compressed as before
            return ours(self, positions, scores, last_position, num_prompt_tokens)
        if positions.shape[-1] <= self.budget:
            return None
        return (positions == last_position - self.recent).int().argmax(-1, keepdim=True)

    monkeypatch.setattr(KVPolicy, "heads_to_drop", off_by_one)
    assert count_key_set_changes(model_dir) == (0, 0)


@pytest.mark.parametrize("num_dropped", [1, 3, 15])
def test_drop_moves_equal_a_plain_compaction(num_dropped):
    """Whatever holes each head has, its kept tokens end up in its first entries, in some order,
    and each move's slots are the entries' own: checked against the kept set itself, for the
    PyTorch path and Loom's op, which also agree move for move."""
    load_kernels()
    g = torch.Generator().manual_seed(num_dropped)
    state = HeadScores(3, 4)
    state.append(100, 20)
    state.scores.copy_(torch.rand(3, 4, 20, generator=g))
    dropped = torch.rand(3, 4, 20, generator=g).argsort(-1)[..., :num_dropped]
    old_ids, new_ids = torch.tensor([4, 9]), torch.tensor([6, 1])
    kept = 20 - num_dropped

    def index(block_ids: torch.Tensor, slot: int) -> int:
        return block_ids.tolist().index(slot // 16) * 16 + slot % 16

    results = []
    for op in (drop_head_entries, torch.ops.loom.drop_head_entries):
        positions, scores = state._positions.clone(), state._scores.clone()
        moves = op(positions, scores, dropped, 20, old_ids, new_ids, 16)
        results.append((moves, positions, scores))
        for l in range(3):
            for h in range(4):
                keep = sorted(set(range(20)) - set(dropped[l, h].tolist()))
                assert sorted(positions[l, h, :kept].tolist()) == sorted(state.positions[l, h, keep].tolist())
                assert sorted(scores[l, h, :kept].tolist()) == sorted(state.scores[l, h, keep].tolist())
        for l, h, src, dst in moves.tolist():  # the entry read from the source slot is the one now at its index
            assert positions[l, h, index(new_ids, dst)] == state.positions[l, h, index(old_ids, src)]
    (ref, *_), (fast, *_) = results
    assert torch.equal(ref, fast) and all(torch.equal(a, b) for a, b in zip(results[0][1:], results[1][1:]))
    assert state.written_by(dropped) == {i for i in dropped.flatten().tolist() if i < kept}


def test_drop_op_rejects_a_bad_drop_changing_nothing():
    load_kernels()
    state = HeadScores(1, 2)
    state.append(0, 6)
    before = state._positions.clone()
    for dropped in ([[[1, 1], [2, 3]]], [[[1, 6], [2, 3]]]):  # repeated; outside the stored
        with pytest.raises(RuntimeError, match="repeated or outside"):
            torch.ops.loom.drop_head_entries(state._positions, state._scores, torch.tensor(dropped), 6,
                                             torch.tensor([0]), torch.tensor([0]), 16)
    assert torch.equal(state._positions, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kernel_equals_the_pytorch_moves(dtype):
    """KVCache.move by Loom's op and by plain PyTorch: whole-slot pairs first, then per-head
    moves, all reads before any write (a pair's destination is also a head move's, and a
    head move reads a slot a pair overwrites)."""
    load_kernels()
    g = torch.Generator().manual_seed(3)
    caches = [KVCache(3, 6, 2, 16, 8, dtype, "cpu", kernels=kernel) for kernel in (True, False)]
    for t in range(6):
        fill = [torch.randn(caches[0].keys[0].shape, generator=g).to(dtype) for _ in caches[0].keys]
        for c in caches:
            for k, v, f in zip(c.keys, c.values, fill):
                k.copy_(f)
                v.copy_(f.transpose(2, 3))
    old = [k.clone() for k in caches[0].keys]
    pairs = [(8, 40), (9, 41), (40, 9)]
    heads = torch.tensor([[0, 1, 40, 3], [2, 0, 8, 41], [1, 1, 17, 40], [2, 1, 9, 16]])
    for c in caches:
        c.move(pairs, heads)
    for a, b in zip(caches[0].keys + caches[0].values, caches[1].keys + caches[1].values):
        assert torch.equal(a, b)

    def key(keys, layer, head, slot):
        return keys[layer][slot // 8, head, :, slot % 8]

    new = caches[0].keys
    assert torch.equal(key(new, 0, 0, 41), key(old, 0, 0, 9))      # a pair
    assert torch.equal(key(new, 2, 0, 41), key(old, 2, 0, 8))      # a head move over a pair's slot wins
    assert torch.equal(key(new, 2, 1, 16), key(old, 2, 1, 9))      # read before the pair (40 -> 9) wrote it
    assert torch.equal(key(new, 0, 1, 3), key(old, 0, 1, 40))      # read before the pair (8 -> 40) wrote it
    assert torch.equal(key(new, 1, 0, 9), key(old, 1, 0, 40))


def test_lowest_unprotected_op_equals_its_definition():

    load_kernels()
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(3, 5, 300, generator=g)
    positions = torch.randperm(300, generator=g).int().expand(3, 5, 300).contiguous()
    fast = torch.ops.loom.lowest_unprotected(scores, positions, 199)
    plain = scores.masked_fill(positions > 199, float("inf")).argmin(-1, keepdim=True)
    assert torch.equal(fast, plain) and torch.equal(lowest_unprotected(scores, positions, 199), plain)
    assert (positions.gather(-1, fast) <= 199).all()


def test_keyformer_does_not_depend_on_batch_or_chunking(gqa):
    """The noise is keyed by what a query and a key are, and scores add per row: the same
    tokens whether sequences run alone or together, in prompt chunks of 16 or whole."""
    model_dir, _ = gqa
    batch = [{"prompt_token_ids": p} for p in prompts(4, 48, seed=11)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, kv_policy="keyformer", kv_budget=0.5)
    runs = [LLM(str(model_dir), block_size=BLOCK, **kw).generate(batch, params, use_tqdm=False)
            for kw in ({}, {"max_num_seqs": 1}, {"max_num_batched_tokens": 16}, {"enable_chunked_prefill": False})]
    tokens = [[o.outputs[0].token_ids for o in run] for run in runs]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0] and tokens[3] == tokens[0]

"""Sampler, SamplingParams and logprob helpers.

Every sampling-parameter test is built so it would FAIL if the parameter were ignored: the crafted logits
make the "ignored" outcome observable (a different greedy winner, or draws outside the allowed set).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sglang_backend.runtime.layers.logits_processor import token_ids_logprobs, token_logprobs, top_logprobs
from sglang_backend.runtime.layers.sampler import Sampler, SamplingBatchInfo
from sglang_backend.runtime.sampling_params import SamplingParams

EOS = 0
sampler = Sampler()


def run(params, logits, prompts=None, outputs=None, generators=None, eos=frozenset({EOS})):
    """Sample one step for len(params) rows; ``logits`` may be one row (broadcast) or [B, V]."""
    batch = len(params)
    logits = torch.as_tensor(logits, dtype=torch.float32)
    if logits.dim() == 1:
        logits = logits.expand(batch, -1)
    info = SamplingBatchInfo.from_requests(
        params,
        prompts if prompts is not None else [[] for _ in range(batch)],
        outputs if outputs is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch,
        set(eos),
        logits.shape[1],
    )
    return sampler(logits, info)


def draws(p: SamplingParams, logits, n=4000, seed=0) -> Counter:
    """n independent draws of one request's distribution (n identical rows, global RNG seeded)."""
    torch.manual_seed(seed)
    return Counter(run([p] * n, logits).tolist())


def probs_to_logits(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def entropy(counter: Counter) -> float:
    total = sum(counter.values())
    return -sum(c / total * math.log(c / total) for c in counter.values())


# ---------------------------------------------------------------------------------------- greedy


def test_temperature_zero_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(16, 50)
    ids = run([SamplingParams(temperature=0.0)] * 16, logits)
    assert torch.equal(ids, logits.argmax(-1))


def test_greedy_rows_are_argmax_even_when_the_distribution_is_flat():
    # Top token has only ~12% mass; ignoring temperature=0 would sample other tokens most of the time.
    logits = torch.zeros(10)
    logits[7] = 0.3
    counts = draws(SamplingParams(temperature=0.0), logits, n=500)
    assert counts == Counter({7: 500})


def test_top_k_one_is_greedy():
    logits = torch.zeros(10)
    logits[3] = 0.3
    assert SamplingParams(top_k=1).is_greedy
    assert draws(SamplingParams(top_k=1, temperature=1.0), logits, n=500) == Counter({3: 500})


def test_mixed_batch_greedy_and_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(6, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    ids = run(params, logits)
    assert torch.equal(ids[0::2], logits[0::2].argmax(-1))
    assert ids.dtype == torch.int64 and ids.shape == (6,)


def test_sampler_does_not_modify_input_logits():
    logits = torch.randn(2, 20)
    before = logits.clone()
    run([SamplingParams(repetition_penalty=1.5, logit_bias={1: 5.0}, min_new_tokens=3)] * 2, logits,
        prompts=[[1, 2], [3]], outputs=[[4], []])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------- filters


def test_top_k_never_samples_outside_top_k():
    logits = torch.linspace(0.0, 0.5, 10)  # near-uniform: without top_k all 10 tokens show up
    counts = draws(SamplingParams(top_k=2), logits)
    assert set(counts) == {8, 9}
    assert len(draws(SamplingParams(), logits)) == 10


def test_top_p_small_keeps_only_top_token():
    logits = probs_to_logits([0.1, 0.4, 0.3, 0.2])
    assert draws(SamplingParams(top_p=0.05), logits) == Counter({1: 4000})


def test_top_p_keeps_smallest_set_reaching_p():
    logits = probs_to_logits([0.2, 0.5, 0.3])
    counts = draws(SamplingParams(top_p=0.6), logits)  # {1} has 0.5 < 0.6, {1, 2} has 0.8
    assert set(counts) == {1, 2}
    # renormalised: 0.5/0.8 = 0.625
    assert abs(counts[1] / 4000 - 0.625) < 0.04
    # exactly reaching p: {1} already has 0.5 >= 0.5
    assert set(draws(SamplingParams(top_p=0.5), logits)) == {1}
    # top_p = 1 keeps everything
    assert set(draws(SamplingParams(top_p=1.0), logits)) == {0, 1, 2}


def test_top_p_applies_after_top_k():
    # top_k=2 leaves {0.4, 0.35} -> renormalised {0.533, 0.467}; top_p=0.5 then keeps only the first.
    logits = probs_to_logits([0.4, 0.35, 0.25])
    assert set(draws(SamplingParams(top_k=2, top_p=0.5), logits)) == {0}
    assert set(draws(SamplingParams(top_k=2), logits)) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max():
    logits = probs_to_logits([0.5, 0.3, 0.15, 0.05])
    assert set(draws(SamplingParams(min_p=0.2), logits)) == {0, 1, 2}  # threshold 0.1
    assert set(draws(SamplingParams(min_p=0.5), logits)) == {0, 1}  # threshold 0.25
    assert set(draws(SamplingParams(min_p=0.0), logits)) == {0, 1, 2, 3}


def test_temperature_changes_entropy():
    logits = probs_to_logits([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    cold = entropy(draws(SamplingParams(temperature=0.3), logits))
    base = entropy(draws(SamplingParams(temperature=1.0), logits))
    hot = entropy(draws(SamplingParams(temperature=3.0), logits))
    assert cold < base - 0.3
    assert hot > base + 0.1


def test_temperature_one_matches_softmax_frequencies():
    probs = [0.5, 0.3, 0.2]
    counts = draws(SamplingParams(), probs_to_logits(probs), n=8000)
    for tok, p in enumerate(probs):
        assert abs(counts[tok] / 8000 - p) < 0.03


# ---------------------------------------------------------------------------------------- penalties


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_repetition_penalty_divides_positive_logits_of_seen_tokens():
    logits = torch.tensor([2.0, 1.9, 0.0, -5.0])
    assert run([greedy()], logits, prompts=[[0]]).item() == 0
    # 2.0 / 1.2 = 1.67 < 1.9: token 0 (seen in the PROMPT) loses
    assert run([greedy(repetition_penalty=1.2)], logits, prompts=[[0]]).item() == 1
    # seen in the OUTPUT counts too
    assert run([greedy(repetition_penalty=1.2)], logits, outputs=[[0]]).item() == 1
    # unseen: no effect
    assert run([greedy(repetition_penalty=1.2)], logits, prompts=[[2]]).item() == 0
    # < 1 encourages repeats: 1.9 / 0.5 = 3.8 > 2.0
    assert run([greedy(repetition_penalty=0.5)], logits, prompts=[[1]]).item() == 1


def test_repetition_penalty_multiplies_negative_logits():
    logits = torch.tensor([-1.0, -1.1, -5.0])
    # -1.0 * 1.2 = -1.2 < -1.1 (dividing would give -0.83 and keep token 0 on top)
    assert run([greedy(repetition_penalty=1.2)], logits, prompts=[[0]]).item() == 1


def test_frequency_penalty_scales_with_output_count():
    logits = torch.tensor([2.0, 1.5, 0.0])
    # one occurrence: 2.0 - 0.2 = 1.8 > 1.5
    assert run([greedy(frequency_penalty=0.2)], logits, outputs=[[0]]).item() == 0
    # three occurrences: 2.0 - 0.6 = 1.4 < 1.5
    assert run([greedy(frequency_penalty=0.2)], logits, outputs=[[0, 0, 0]]).item() == 1
    # prompt tokens are not counted (OpenAI semantics)
    assert run([greedy(frequency_penalty=0.2)], logits, prompts=[[0, 0, 0]]).item() == 0
    # negative penalty promotes repeated tokens
    assert run([greedy(frequency_penalty=-0.3)], logits, outputs=[[1, 1]]).item() == 1


def test_presence_penalty_is_independent_of_count():
    logits = torch.tensor([2.0, 1.5, 0.0])
    assert run([greedy(presence_penalty=0.6)], logits, outputs=[[0]]).item() == 1  # 1.4 < 1.5
    assert run([greedy(presence_penalty=0.3)], logits, outputs=[[0, 0, 0, 0]]).item() == 0  # 1.7, not 0.8
    assert run([greedy(presence_penalty=0.6)], logits, prompts=[[0]]).item() == 0  # prompt ignored
    assert run([greedy()], logits, outputs=[[0]]).item() == 0


def test_penalties_are_per_row():
    logits = torch.tensor([2.0, 1.5, 0.0])
    params = [greedy(frequency_penalty=0.2), greedy(), greedy(presence_penalty=0.6)]
    ids = run(params, logits, outputs=[[0, 0, 0], [0, 0, 0], [2]])
    assert ids.tolist() == [1, 0, 0]


def test_out_of_vocab_history_ids_are_ignored():
    # e.g. image-hash placeholder ids in the prompt
    logits = torch.tensor([2.0, 1.9, 0.0])
    ids = run([greedy(repetition_penalty=1.5, frequency_penalty=1.0)], logits,
              prompts=[[10**9, -5]], outputs=[[77]])
    assert ids.item() == 0


# ---------------------------------------------------------------------------------------- min_new_tokens


def test_min_new_tokens_blocks_eos():
    logits = torch.tensor([5.0, 1.0, 0.5])  # EOS = 0 is the clear favourite
    assert run([greedy(min_new_tokens=3)], logits, outputs=[[1, 2]]).item() == 1
    assert run([greedy(min_new_tokens=3)], logits, outputs=[[1, 2, 1]]).item() == EOS
    # sampled rows: EOS never drawn while blocked
    assert EOS not in draws(SamplingParams(min_new_tokens=2), logits, n=1000)
    # all eos ids are blocked
    assert run([greedy(min_new_tokens=1)], torch.tensor([5.0, 4.0, 0.5]), eos={0, 1}).item() == 2


def test_min_new_tokens_blocks_stop_token_ids():
    logits = torch.tensor([0.0, 5.0, 1.0])
    assert run([greedy(stop_token_ids=[1])], logits).item() == 1
    assert run([greedy(stop_token_ids=[1], min_new_tokens=1)], logits).item() == 2
    # also while ignore_eos (stop_token_ids are the user's own stop condition)
    assert run([greedy(stop_token_ids=[1], min_new_tokens=1, ignore_eos=True)], logits).item() == 2


def test_min_new_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.tensor([5.0, 1.0, 0.5])
    assert run([greedy(min_new_tokens=3, ignore_eos=True)], logits).item() == EOS


# ---------------------------------------------------------------------------------------- logit_bias


def test_logit_bias_forces_a_token():
    logits = torch.tensor([3.0, 2.0, -4.0, 0.0])
    assert run([greedy(logit_bias={2: 100.0})], logits).item() == 2
    assert set(draws(SamplingParams(logit_bias={2: 100.0}), logits, n=500)) == {2}


def test_logit_bias_can_ban_a_token():
    logits = torch.tensor([3.0, 2.0, -4.0])
    assert run([greedy(logit_bias={0: -math.inf})], logits).item() == 1
    assert 0 not in draws(SamplingParams(logit_bias={0: -100.0}), logits, n=1000)


def test_logit_bias_applies_before_penalties():
    # bias lifts token 1 to 2.5 (positive); repetition 2.0 then halves it to 1.25 < 2.0
    logits = torch.tensor([2.0, 0.5])
    assert run([greedy(logit_bias={1: 2.0})], logits).item() == 1
    assert run([greedy(logit_bias={1: 2.0}, repetition_penalty=2.0)], logits, prompts=[[1]]).item() == 0


# ---------------------------------------------------------------------------------------- seeds


def seeded_sequence(seed: int, neighbours: list[SamplingParams], steps=25, position=0, vocab=200):
    """Draws of one seeded request over `steps` steps, sharing each batch with `neighbours`."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(1234 + len(neighbours))  # the global RNG differs between configurations
    logits_gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(steps):
        row = torch.randn(vocab, generator=logits_gen)
        params = list(neighbours)
        params.insert(position, SamplingParams(seed=seed, top_p=0.95))
        gens = [None] * len(params)
        gens[position] = gen
        logits = torch.randn(len(params), vocab)
        logits[position] = row
        out.append(run(params, logits, generators=gens)[position].item())
    return out


def test_same_seed_same_draws_whatever_the_batch():
    alone = seeded_sequence(7, [])
    crowded = seeded_sequence(
        7,
        [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=3),
         SamplingParams(min_p=0.1, temperature=2.0)],
        position=2,
    )
    assert alone == crowded
    assert alone == seeded_sequence(7, [SamplingParams(temperature=0.5)], position=1)


def test_different_seeds_differ():
    assert seeded_sequence(7, []) != seeded_sequence(8, [])


def test_seeded_rows_do_not_touch_each_others_generators():
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    logits = torch.zeros(2, 1000)
    ids = run([SamplingParams(seed=1)] * 2, logits, generators=[g1, g2])
    assert ids[0] == ids[1]


# ---------------------------------------------------------------------------------------- SamplingParams


def test_defaults_match_upstream():
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop is None and p.stop_token_ids is None and p.seed is None and p.n == 1
    assert not p.ignore_eos and p.skip_special_tokens and p.spaces_between_special_tokens and not p.no_stop_trim
    assert not p.is_greedy


def test_from_dict_unknown_field_names_it():
    with pytest.raises(ValueError) as e:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9, "bogus": 1})
    msg = str(e.value)
    assert "top_q" in msg and "bogus" in msg
    assert "top_p" in msg  # lists the valid ones


@pytest.mark.parametrize(
    "field,value",
    [("temperature", "hot"), ("max_new_tokens", 1.5), ("max_new_tokens", True), ("ignore_eos", 1),
     ("stop", [1, 2]), ("stop_token_ids", ["a"]), ("logit_bias", [1]), ("logit_bias", {"x": 1.0}),
     ("regex", 3), ("top_k", "5")],
)
def test_from_dict_wrong_type_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict({field: value})


def test_from_dict_values_and_round_trip():
    d = {"max_new_tokens": 16, "temperature": 0, "stop": "\n", "stop_token_ids": [5, 3],
         "logit_bias": {"42": -100, 7: 1}, "sampling_seed": 11, "top_k": None, "json_schema": {"type": "object"}}
    p = SamplingParams.from_dict(d)
    assert p.max_new_tokens == 16 and p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.logit_bias == {42: -100.0, 7: 1.0}
    assert p.seed == 11 and p.top_k == -1 and p.is_greedy
    assert p.json_schema == '{"type": "object"}'
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(None) == SamplingParams()


BAD = [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(min_new_tokens=-1), "min_new_tokens"),
    (dict(min_new_tokens=10, max_new_tokens=5), "min_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(presence_penalty=2.1), "presence_penalty"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(n=0), "n must"),
    (dict(stop_token_ids=[100]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={100: 1.0}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"),
    (dict(regex="a+", json_schema="{}"), "regex, json_schema"),
    (dict(regex="a+", ebnf="root ::= 'a'"), "regex, ebnf"),
]


@pytest.mark.parametrize("kwargs,needle", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_verify_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs).verify(vocab_size=100)


def test_verify_accepts_edge_values():
    for kwargs in [dict(max_new_tokens=0), dict(temperature=0.0), dict(top_p=1.0), dict(top_k=-1), dict(top_k=1),
                   dict(min_p=1.0), dict(frequency_penalty=2.0), dict(presence_penalty=-2.0),
                   dict(repetition_penalty=2.0), dict(min_new_tokens=5, max_new_tokens=5),
                   dict(stop_token_ids=[0, 99], logit_bias={99: -math.inf}), dict(regex="a+")]:
        SamplingParams(**kwargs).verify(vocab_size=100)
    SamplingParams(stop_token_ids=[10**6]).verify()  # no vocab size: id range unchecked


class CharTokenizer:
    def encode(self, s, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(c) for c in s]


def test_normalize():
    p = SamplingParams(stop="END", stop_token_ids=[3, 3, 4])
    p.normalize(CharTokenizer())
    assert p.stop == ["END"] and p.stop_token_ids == {3, 4}
    assert p.stop_str_max_len >= 3
    p.normalize(CharTokenizer())  # idempotent
    assert p.stop == ["END"] and p.stop_token_ids == {3, 4}

    q = SamplingParams(stop=["a", "longer stop"])
    q.normalize(CharTokenizer())
    assert q.stop_str_max_len >= len("longer stop")

    r = SamplingParams()
    r.normalize(None)
    assert r.stop == [] and r.stop_token_ids == set() and r.stop_str_max_len == 0
    s = SamplingParams(stop=["é!"])
    s.normalize(None)
    assert s.stop_str_max_len >= 3  # byte bound without a tokenizer
    assert SamplingParams.from_dict(p.to_dict()).stop == ["END"]


def test_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-8).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(temperature=0.1, top_k=2).is_greedy


# ---------------------------------------------------------------------------------------- logprobs


def test_token_logprobs_match_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 4
    ids = torch.randint(0, 40, (5,))
    ref = torch.log_softmax(logits, -1)[torch.arange(5), ids]
    assert torch.allclose(token_logprobs(logits, ids), ref)
    # half-precision logits are upcast before log_softmax
    lp = token_logprobs(logits.bfloat16(), ids)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, torch.log_softmax(logits.bfloat16().float(), -1)[torch.arange(5), ids])


def test_top_logprobs():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    values, ids = top_logprobs(logits, 4)
    ref = torch.log_softmax(logits, -1)
    ref_values, ref_ids = ref.topk(4, dim=-1)
    assert torch.equal(ids, ref_ids) and torch.allclose(values, ref_values)
    assert (values[:, :-1] >= values[:, 1:]).all()
    values, ids = top_logprobs(logits, 100)  # capped at V
    assert values.shape == (3, 40)
    assert top_logprobs(logits, 0)[0].shape == (3, 0)


def test_token_ids_logprobs():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    ref = torch.log_softmax(logits, -1)
    out = token_ids_logprobs(logits, [[1, 5], [], [39]])
    assert out[1] == []
    assert out[0] == pytest.approx([ref[0, 1].item(), ref[0, 5].item()], abs=1e-6)
    assert out[2] == pytest.approx([ref[2, 39].item()], abs=1e-6)
    assert token_ids_logprobs(logits, [[], [], []]) == [[], [], []]


def test_logprobs_ignore_sampling_processing():
    # logprobs come from the raw logits, not the penalised/biased ones
    logits = torch.tensor([[2.0, 0.5, 0.1]])
    chosen = run([greedy(logit_bias={2: 10.0})], logits[0])
    assert chosen.item() == 2
    assert token_logprobs(logits, chosen).item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())

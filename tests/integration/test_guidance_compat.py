"""sglang_guidance: guidance-style programs on our runtime give the native DSL's answers (temperature 0).

Programs: HellaSwag-style select, MMLU few-shot (gen and select), JSON (schema-constrained), role blocks with
generation right after text the program wrote into the assistant turn, ``@guidance`` composition, forking.
"""

from __future__ import annotations

import json as _json

import pytest

import sglang_backend as sgl
from sglang_guidance import assistant, gen, guidance, json, models, select, system, user


@pytest.fixture(scope="module")
def backend(smollm_engine):
    return sgl.EngineBackend(smollm_engine)


@pytest.fixture
def lm(backend, smollm_engine):  # smollm_engine named so the pool is checked whole after each test
    return models.SGLang(backend)


# HellaSwag: pick the most likely continuation ------------------------------------------------------------------------
HS_FEW_SHOT = (
    "A man is sitting on a roof. He starts pulling up roofing on a roof.\n\n"
    "A woman is outside with a bucket and a dog. The dog is running around trying to avoid a bath. "
    "She gets the dog wet, then it runs away again.\n\n"
)
HS_ITEMS = [
    ("A boy is holding a glass of milk. He", [" drinks the milk.", " throws the car into the ocean.",
                                             " paints the sky green.", " sings to the refrigerator."]),
    ("The chef cracks two eggs into a bowl. She", [" whisks them with a fork.", " drives the bowl to school.",
                                                    " climbs into the bowl.", " mails the eggs to the moon."]),
    ("A woman puts on her running shoes. She", [" goes out for a jog.", " eats the shoes for dinner.",
                                                 " plants the shoes in a pot.", " swims in the shoes."]),
]


def test_hellaswag_select_matches_native(lm, backend):
    @sgl.function
    def native(s, context, choices):
        s += HS_FEW_SHOT + context
        s += sgl.select("answer", choices=choices)

    @guidance
    def guided(lm, context, choices):
        lm += HS_FEW_SHOT + context
        lm += select(choices, name="answer", mode="likelihood")
        return lm

    states = native.run_batch([{"context": c, "choices": ch} for c, ch in HS_ITEMS], backend=backend)
    for (context, choices), state in zip(HS_ITEMS, states):
        out = lm + guided(context, choices)
        assert out["answer"] == state["answer"]
        assert str(out) == state.text()
        # Scores come from the same runtime call shape: identical normalised log-likelihoods.
        ours = out.meta("answer")["normalized_prompt_logprobs"]
        theirs = state.get_meta_info("answer")["normalized_prompt_logprobs"]
        assert ours == pytest.approx(theirs, abs=1e-4)


def test_select_constrained_mode_guidance_semantics(lm):
    out = lm + "Q: Is fire hot or cold?\nA: It is" + select([" hot", " cold"], name="answer")
    assert out["answer"] in (" hot", " cold")
    assert str(out).endswith(out["answer"])
    likely = lm + "Q: Is fire hot or cold?\nA: It is" + select([" hot", " cold"], name="answer", mode="likelihood")
    assert out["answer"] == likely["answer"] == " hot"


# MMLU few-shot ----------------------------------------------------------------------------------------------------
MMLU_SHOTS = (
    "The following are multiple choice questions (with answers) about geography.\n\n"
    "What is the capital of France?\nA. Berlin\nB. Paris\nC. Rome\nD. Madrid\nAnswer: B\n\n"
    "Which ocean is the largest?\nA. Pacific\nB. Atlantic\nC. Indian\nD. Arctic\nAnswer: A\n\n"
)
MMLU_QS = [
    "What is the capital of Italy?\nA. Paris\nB. Madrid\nC. Rome\nD. Lisbon\nAnswer:",
    "What is the capital of Germany?\nA. Berlin\nB. Vienna\nC. Warsaw\nD. Prague\nAnswer:",
    "Which is the longest river in Africa?\nA. Congo\nB. Niger\nC. Zambezi\nD. Nile\nAnswer:",
]


def test_mmlu_few_shot_matches_native(lm, backend):
    @sgl.function
    def native(s, question):
        s += MMLU_SHOTS + question
        s += sgl.gen("answer", max_tokens=2, temperature=0)
        s += "\nChoice:" + sgl.select("choice", choices=[" A", " B", " C", " D"])

    @guidance
    def guided(lm, question):
        lm += MMLU_SHOTS + question
        lm += gen("answer", max_tokens=2, temperature=0)
        lm += "\nChoice:" + select([" A", " B", " C", " D"], name="choice", mode="likelihood")
        return lm

    states = native.run_batch([{"question": q} for q in MMLU_QS], backend=backend, temperature=0)
    for q, state in zip(MMLU_QS, states):
        out = lm + guided(q)
        assert out["answer"] == state["answer"]
        assert out["choice"] == state["choice"]
        assert str(out) == state.text()


# JSON ---------------------------------------------------------------------------------------------------------------
CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["name", "country", "population_millions"],
    "additionalProperties": False,
}


def test_json_matches_native(lm, backend):
    prompt = "Give facts about Paris as JSON.\n"

    @sgl.function
    def native(s):
        s += prompt
        s += sgl.gen("city", max_tokens=96, temperature=0, json_schema=_json.dumps(CITY_SCHEMA))

    state = native.run(backend=backend)
    out = lm + prompt + json("city", schema=CITY_SCHEMA, max_tokens=96)
    assert out["city"] == state["city"]
    obj = _json.loads(out["city"])
    assert set(obj) == {"name", "country", "population_millions"}

    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    parsed = City.model_validate_json((lm + prompt + json("c", schema=City, max_tokens=64))["c"])
    assert isinstance(parsed.name, str)


# Roles, assistant-turn text, composition, forks -------------------------------------------------------------------
def test_roles_and_generation_after_assistant_text_match_native(lm, backend):
    @sgl.function
    def native(s):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user("What is the capital of France?")
        s += sgl.assistant(sgl.gen("a1", max_tokens=16))
        s += sgl.user("And of Germany?")
        s += sgl.assistant_begin()
        s += "The capital of Germany is" + sgl.gen("a2", max_tokens=8, stop=".")
        s += sgl.assistant_end()

    state = native.run(backend=backend, temperature=0)

    with system():
        lm += "You are a helpful assistant."
    with user():
        lm += "What is the capital of France?"
    with assistant():
        lm += gen("a1", max_tokens=16)
    with user():
        lm += "And of Germany?"
    with assistant():
        lm += "The capital of Germany is" + gen("a2", max_tokens=8, stop=".")
    lm += ""  # outside every block: closes the assistant turn

    assert lm["a1"] == state["a1"] and "Paris" in lm["a1"]
    assert lm["a2"] == state["a2"] and "Berlin" in lm["a2"]
    assert str(lm) == state.text()
    assert [m["role"] for m in lm.messages()] == ["system", "user", "assistant", "user", "assistant"]


def test_immutable_forks_and_composition(lm, smollm_engine):
    @guidance
    def qa(lm, question, name):
        lm += f"Q: {question}\nA:" + gen(name, stop="\n", max_tokens=12)
        return lm

    @guidance(stateless=True)
    def capital_of(lm, country):
        return lm + qa(f"What is the capital of {country}?", "capital")

    shots = "Q: What is the capital of Japan?\nA: Tokyo\nQ: What is the capital of Egypt?\nA: Cairo\n"
    base = lm + shots
    forks = [base + capital_of(c) for c in ("France", "Italy", "Spain")]
    assert str(base) == shots and "capital" not in base  # the base did not change
    assert "Paris" in forks[0]["capital"] and "Rome" in forks[1]["capital"] and "Madrid" in forks[2]["capital"]
    # list_append captures, chained
    lst = lm + "Numbers: 1," + gen("n", max_tokens=2, regex=r" [0-9]", list_append=True) + "," + \
        gen("n", max_tokens=2, regex=r" [0-9]", list_append=True)
    assert len(lst["n"]) == 2 and all(x.strip().isdigit() for x in lst["n"])


def test_guidance_over_server(server):
    lm = models.SGLang(base_url=server.url, api_key=server.api_key)
    out = lm + "Q: Is fire hot or cold?\nA: It is" + select([" hot", " cold"], name="a", mode="likelihood")
    assert out["a"] == " hot"
    with user():
        lm += "What is the capital of France? One word."
    with assistant():
        lm += gen("city", max_tokens=6)
    assert "Paris" in lm["city"]


def test_real_guidance_package_sglang_model(server):
    """If the real ``guidance`` package is installed, its SglangModel talks to our server."""
    guidance_pkg = pytest.importorskip("guidance")
    from guidance.models.experimental import SglangModel

    # top_k=1 (sent as extra_body.top_k) = greedy: guidance 0.3.1 never sends temperature=0 (it drops falsy
    # temperatures), so without it the answer is sampled at temperature 1. More in test_guidance_sglang_model.py.
    glm = SglangModel(model="default", sampling_params={"top_k": 1}, base_url=server.url + "/v1",
                      api_key=server.api_key)
    with guidance_pkg.user():
        glm += "What is the capital of France? One word."
    with guidance_pkg.assistant():
        glm += guidance_pkg.gen("city", max_tokens=6)
    assert "Paris" in glm["city"]

"""Grammar masks at sampling: constraints compile or are refused, masks hold whatever else shares the batch."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from orchard.node.constraint import Constraint, UnsupportedConstraint
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.errors import InvalidSamplingParams
from orchard.node.structured import apply_bitmask
from orchard.node.types import SamplingParams
from tests.node.test_engine import _assert_no_leak

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,6}@example\.com"


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[tuple[str, str]]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [(o.text, o.finish_reason, tuple(o.token_ids)) for o in out.outputs]
    _assert_no_leak(engine)
    return finals


def _engine(model_dirs, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dirs["demo"]), block_size=4, **kw))


def test_constraint_kinds_compile_from_the_gateway_shape():
    for spec in ({"json_object": True}, {"json_schema": PERSON, "strict": True}, {"json_schema": json.dumps(PERSON)},
                 {"regex": EMAIL}, {"choice": ["yes", 'say "no"']}, {"grammar": 'start: "a" | "b" start'},
                 {"grammar": 'root ::= "x" | "y"'}):
        params = SamplingParams(constraint=spec)
        assert isinstance(params.constraint, Constraint) and params.constraint.grammar
        assert params.reads_outputs


@pytest.mark.parametrize("spec", [
    {"json_schema": {"not": {"type": "string"}}},
    {"json_schema": {"type": "string", "format": "no-such-format"}},
    {"json_schema": {"$ref": "http://example.com/remote.json"}},
    {"json_schema": "{not json"},
    {"regex": "[a-z"},
    {"grammar": "start: undefined_rule"},
    {"grammar": "0"},  # neither Lark nor GBNF
    {"choice": []},
    {"regex": EMAIL, "choice": ["a"]},
])
def test_an_unsupported_or_malformed_constraint_is_refused_by_name(spec):
    with pytest.raises(UnsupportedConstraint) as info:
        SamplingParams(constraint=spec)
    assert isinstance(info.value, InvalidSamplingParams) and info.value.param == "constraint"


def test_a_constraint_crosses_pickle_and_rays_serializer_with_its_compiled_grammar():
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    params = SamplingParams(constraint={"json_schema": PERSON})
    for back in (pickle.loads(pickle.dumps(params)), cloudpickle.loads(cloudpickle.dumps(params))):
        assert back.constraint == params.constraint and back.constraint.grammar == params.constraint.grammar
    resumed = dataclasses.replace(params, resumed_outputs=3)  # the gateway's resume after a lost node
    assert resumed.constraint is params.constraint


def test_apply_bitmask_keeps_exactly_the_set_bits_of_each_row():
    logits = mx.zeros((2, 40))
    bitmask = np.zeros((2, 2), np.int32)
    bitmask[0, 0] = 1 << 3
    bitmask[0, 1] = 1 << 7  # token 39
    bitmask[1] = -1  # all allowed
    out = np.asarray(apply_bitmask(logits, bitmask))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == [3, 39]
    assert np.isfinite(out[1]).all()


def test_constrained_outputs_match_their_grammar_and_unconstrained_rows_are_untouched(model_dirs):
    engine = _engine(model_dirs, num_blocks=256)
    prompt = engine.tokenizer.encode("A person as JSON:")
    free = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    alone = _run(engine, {"free": (prompt, free)})["free"]
    finals = _run(engine, {
        "json": (prompt, SamplingParams(temperature=0.9, seed=1, max_tokens=60, n=3, constraint={"json_schema": PERSON})),
        "regex": (prompt, SamplingParams(temperature=1.0, seed=2, max_tokens=20, constraint={"regex": EMAIL})),
        "choice": (prompt[:3], SamplingParams(temperature=0.0, max_tokens=20, constraint={"choice": ["yes", "no", "maybe so"]})),
        "free": (prompt, free),
    })
    assert finals["free"] == alone
    assert len(finals["json"]) == 3
    for text, reason, _ in finals["json"]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _, _ in finals["json"]}) > 1  # each continuation samples under its own matcher
    assert re.fullmatch(EMAIL, finals["regex"][0][0]) and finals["regex"][0][1] == "stop"
    assert finals["choice"][0][0] in ("yes", "no", "maybe so")


def test_eos_is_only_sampled_where_the_grammar_accepts(model_dirs):
    engine = _engine(model_dirs, num_blocks=256)
    prompt = engine.tokenizer.encode("Digits:")
    # "[0-9]{2,}" never completes by itself: the output ends at EOS (only allowed after two digits) or at max_tokens.
    finals = _run(engine, {f"r{i}": (prompt, SamplingParams(temperature=1.5, seed=i, max_tokens=8, constraint={"regex": "[0-9]{2,}"}))
                           for i in range(6)})
    for [(text, reason, _)] in finals.values():
        assert re.fullmatch("[0-9]+", text) and (len(text) >= 2 or reason == "length")


def test_overlapped_steps_preemption_and_mixed_steps_give_the_same_constrained_tokens(model_dirs):
    """Async vs sync scheduling, a roomy pool vs one that preempts (recompute), chunked prefills beside decodes."""
    results = []
    for overlap, blocks in ((False, 256), (True, 256), (True, 24)):
        engine = _engine(model_dirs, num_blocks=blocks, max_num_batched_tokens=16, async_scheduling=overlap, preemption="recompute")
        prompts = [engine.tokenizer.encode("x " * n + "JSON:") for n in (3, 9, 14, 5)]
        results.append(_run(engine, {
            f"r{i}": (p, SamplingParams(temperature=0.9, seed=i, max_tokens=40, n=2 if i == 1 else 1,
                                        constraint={"json_schema": PERSON} if i % 2 == 0 or i == 1 else None))
            for i, p in enumerate(prompts)
        }))
        if blocks == 24:
            assert engine.scheduler.num_preemptions > 0
    assert results[0] == results[1] == results[2]
    for rid, outs in results[0].items():
        if rid != "r3":
            for text, _, _ in outs:
                jsonschema.validate(json.loads(text), PERSON)


def test_a_resumed_request_continues_its_grammar_from_the_earlier_outputs(model_dirs):
    engine = _engine(model_dirs, num_blocks=256)
    prompt = engine.tokenizer.encode("A person as JSON:")
    params = SamplingParams(temperature=0.0, max_tokens=60, constraint={"json_schema": PERSON})
    [(text, _, tokens)] = _run(engine, {"first": (prompt, params)})["first"]
    cut = 5
    resumed = SamplingParams(temperature=0.0, max_tokens=60 - cut, constraint={"json_schema": PERSON}, resumed_outputs=cut)
    [(rest, _, _)] = _run(engine, {"again": (prompt + list(tokens[:cut]), resumed)})["again"]
    jsonschema.validate(json.loads(engine.tokenizer.decode(list(tokens[:cut])) + rest), PERSON)

"""Structured outputs in the engine: llguidance masks, batched with unconstrained requests.

References are independent of the engine's masking path: `jsonschema` validates every JSON
output, Python's `re` checks regex outputs, unconstrained rows are compared with a run
without any constraint, and greedy constrained output is recomputed with the dense training
forward plus a fresh llguidance matcher's mask, token by token.
"""

from __future__ import annotations

import asyncio
import json
import random
import re

import jsonschema
import pytest
import torch
from llguidance.torch import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    fill_next_token_bitmask,
)

from astrai.inference import InferenceEngine
from astrai.inference.constrain import apply_token_bitmask_eager
from astrai.inference.grammar import grammar_compiler
from astrai.inference.structured import StructuredOutput
from astrai.model import ModelConfig, Transformer


# ---------------------------------------------------------------------- random schemas
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every output is short (bounded strings, arrays, properties), so a
    random-weight model always completes it: finish reason `stop`, never `length`."""
    if depth == 0:
        return _object(rng, depth)
    kinds = ["integer", "number", "boolean", "string", "enum"]
    if depth < 2:
        kinds += ["array", "object"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        low = rng.uniform(-10, 10)
        # multipleOf bounds the fraction digits too (a bounded range alone does not)
        return {
            "type": "number",
            "minimum": round(low, 2),
            "maximum": round(low + 20, 2),
            "multipleOf": 0.25,
        }
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "enum":
        pool = ["red", "green", "blue", 1, 2, None, "a b", 'q"x']
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 2),
        }
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(
        ["id", "name", "tags", "size", "ok", "kind", "items", "x_y"], rng.randint(1, 3)
    )
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    with InferenceEngine(model, tokenizer, max_batch_size=32, max_seq_len=512, start=False) as e:
        yield e


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 384) for _ in range(rng.randint(3, 12))] for _ in range(n)]


@pytest.mark.slow
def test_fifty_random_schemas_batched_with_unconstrained_requests(engine, tokenizer):
    rng = random.Random(1604)
    schemas = [random_schema(rng) for _ in range(50)]
    # Unconstrained prompts whose 300-token greedy paths have top-2 logit gaps >= 1e-3:
    # batch composition cannot flip a near-tie, so equality is exact.
    prompts = _prompts(50, seed=5) + _prompts(10, seed=105)
    constraints = [StructuredOutput.json_schema(s) for s in schemas] + [None] * 10
    order = list(range(60))
    random.Random(2).shuffle(order)  # constrained and unconstrained rows interleaved
    out = engine.run_batch(
        [prompts[i] for i in order],
        max_tokens=300,
        temperature=0.0,
        structured=[constraints[i] for i in order],
        return_details=True,
    )
    by_index = {i: r for i, r in zip(order, out)}
    for i, schema in enumerate(schemas):
        r = by_index[i]
        assert r.finish_reason == "stop", (schema, r)
        value = json.loads(_text(engine.tokenizer, r.token_ids))
        jsonschema.validate(value, schema)
    plain = engine.run_batch(prompts[50:], max_tokens=300, temperature=0.0)
    assert [by_index[50 + k].token_ids for k in range(10)] == plain


def test_random_schemas_sampled_validate(engine, tokenizer):
    """Sampled (temperature 1, seeded) outputs under eight schemas validate too."""
    rng = random.Random(77)
    schemas = [random_schema(rng) for _ in range(8)]
    out = engine.run_batch(
        _prompts(8, seed=9),
        max_tokens=300,
        temperature=1.0,
        seed=3,
        structured=[StructuredOutput.json_schema(s) for s in schemas],
        return_details=True,
    )
    for schema, r in zip(schemas, out):
        assert r.finish_reason == "stop", r
        jsonschema.validate(json.loads(_text(tokenizer, r.token_ids)), schema)


def _masked_greedy(model, tokenizer, prompt, spec, n) -> list[int]:
    """Greedy decoding by dense recomputation, each step masked by a fresh llguidance
    matcher (the library's own mask, applied by hand): the engine-independent reference."""
    compiler = grammar_compiler(tokenizer)
    matcher = compiler.matcher(spec)
    ids, out = list(prompt), []
    bitmask = allocate_token_bitmask(1, compiler.vocab_size)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids]))[0, -1].float()
            fill_next_token_bitmask(matcher, bitmask)
            bits = [(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(logits.shape[0])]
            logits[torch.tensor(bits) == 0] = float("-inf")
            tok = int(logits.argmax())
            out.append(tok)
            assert matcher.consume_token(tok)
            if matcher.is_stopped():
                break
            ids.append(tok)
    return out


def test_greedy_constrained_output_matches_a_dense_masked_reference(engine, model, tokenizer):
    rng = random.Random(11)
    specs = [StructuredOutput.json_schema(random_schema(rng)) for _ in range(3)]
    specs.append(StructuredOutput.regex(r"(ab|cd){1,4}[0-9]{2}"))
    prompts = _prompts(4, seed=12)
    out = engine.run_batch(
        prompts, max_tokens=200, temperature=0.0, structured=specs, return_details=True
    )
    for p, spec, r in zip(prompts, specs, out):
        assert r.finish_reason == "stop"
        assert r.token_ids == _masked_greedy(model, tokenizer, p, spec, 200)
    assert re.fullmatch(r"(ab|cd){1,4}[0-9]{2}", _text(tokenizer, out[3].token_ids))


def test_regex_lark_json_object_and_tool_call_kinds(engine, tokenizer):
    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 5}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    ]
    specs = [
        StructuredOutput.regex(r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)"),
        StructuredOutput.lark('start: "yes" | "no" | "maybe"'),
        StructuredOutput.tool_call(tools),
    ]
    out = engine.run_batch(
        _prompts(3, seed=4),
        max_tokens=120,
        temperature=0.0,
        structured=specs,
        return_details=True,
    )
    assert all(r.finish_reason == "stop" for r in out), out
    texts = [_text(tokenizer, r.token_ids) for r in out]
    assert re.fullmatch(r"[a-z]{1,5}@[a-z]{1,5}\.(com|org)", texts[0])
    assert texts[1] in ("yes", "no", "maybe")
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", texts[2], re.S)
    assert m, texts[2]
    call = json.loads(m.group(1))
    tool = {t["name"]: t for t in tools}[call["name"]]
    jsonschema.validate(call["arguments"], tool["parameters"])


def test_generate_and_submit_take_a_structured_constraint(model, tokenizer):
    spec = StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}},
            "required": ["n"],
            "additionalProperties": False,
        }
    )
    with InferenceEngine(model, tokenizer, max_batch_size=4, max_seq_len=256) as eng:
        r = eng.submit([5, 6, 7], max_tokens=50, temperature=0.5, seed=1, structured=spec)
        r.wait_completion(timeout=120)
        assert r.finish_reason == "stop"
        assert json.loads(r.text)["n"] in (1, 2, 3)
        text = eng.generate("def f", max_tokens=50, structured=spec, temperature=0.0)
        assert json.loads(text)["n"] in (1, 2, 3)

        async def collect() -> str:
            parts = [d async for d in eng.generate_async("x", max_tokens=50, structured=spec)]
            return "".join(parts)

        assert json.loads(asyncio.run(collect()))["n"] in (1, 2, 3)


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: StructuredOutput.json_schema({"type": "objectx"}),
            "structured: invalid json_schema",
        ),
        (lambda: StructuredOutput.json_schema("{not json"), "structured: the JSON schema"),
        (lambda: StructuredOutput.json_schema([1, 2]), "structured: a JSON schema must be"),
        (lambda: StructuredOutput.regex("(unclosed"), "structured: invalid regex"),
        (lambda: StructuredOutput.lark("start: undefined_rule"), "structured: invalid lark"),
        (lambda: "json", "structured must be a StructuredOutput"),
    ],
)
def test_bad_constraints_are_value_errors_naming_the_field(engine, make, match):
    with pytest.raises(ValueError, match=match):
        engine.run_batch([[5, 6]], max_tokens=4, structured=make())


def test_padded_model_vocabulary_is_masked(tokenizer):
    """Model vocabulary larger than the tokenizer's: the padded ids are never drawn, even
    when the model prefers them."""
    cfg = ModelConfig(
        vocab_size=len(tokenizer) + 40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    padded = Transformer(cfg).eval()
    with torch.no_grad():
        padded.lm_head.weight[len(tokenizer) :] *= 50  # padded ids dominate every row
    spec = StructuredOutput.regex(r"[a-z]{3,8}")
    with InferenceEngine(padded, tokenizer, max_batch_size=4, max_seq_len=128, start=False) as eng:
        free, constrained = eng.run_batch(
            [[5, 6, 7], [5, 6, 7]],
            max_tokens=20,
            temperature=0.0,
            structured=[None, spec],
            return_details=True,
        )
    assert any(t >= len(tokenizer) for t in free.token_ids)  # the trap is real
    assert all(t < len(tokenizer) for t in constrained.token_ids)
    assert re.fullmatch(
        r"[a-z]{3,8}", tokenizer.decode(constrained.token_ids, skip_special_tokens=True)
    )


def test_a_failing_matcher_fails_only_its_request(engine, tokenizer, monkeypatch):
    """A matcher that raises (standing in for any grammar fault) aborts its request with
    the cause; the other constrained and unconstrained requests finish as without it."""
    spec = StructuredOutput.regex(r"[a-z]{2,6}!")
    poisoned = StructuredOutput.regex(r"[0-9]{2,6}!")
    rows = engine.runner.grammar_rows
    real = rows.compiler.matcher

    class Exploding:
        def __init__(self, inner):
            self.inner = inner
            self.calls = 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def consume_token(self, tok):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("matcher blew up")
            return self.inner.consume_token(tok)

    monkeypatch.setattr(
        rows.compiler, "matcher", lambda s: Exploding(real(s)) if s == poisoned else real(s)
    )
    prompts = _prompts(4, seed=31)
    out = engine.run_batch(
        prompts,
        max_tokens=40,
        temperature=0.0,
        structured=[spec, poisoned, None, spec],
        return_details=True,
    )
    assert out[1].finish_reason == "aborted" and "matcher blew up" in out[1].error
    assert len(out[1].token_ids) == 2
    monkeypatch.undo()
    clean = engine.run_batch(
        [prompts[0], prompts[2], prompts[3]],
        max_tokens=40,
        temperature=0.0,
        structured=[spec, None, spec],
        return_details=True,
    )
    assert [r.token_ids for r in (out[0], out[2], out[3])] == [r.token_ids for r in clean]
    assert out[0].finish_reason == out[3].finish_reason == "stop"


def test_grammar_compiled_once_per_spec(engine, tokenizer):
    compiler = grammar_compiler(tokenizer)
    spec = StructuredOutput.json_schema(
        {
            "type": "object",
            "properties": {"q": {"type": "boolean"}},
            "required": ["q"],
            "additionalProperties": False,
        }
    )
    before = compiler.stats()
    engine.run_batch(_prompts(5, seed=1), max_tokens=20, structured=spec, temperature=0.0)
    after = compiler.stats()
    assert after["misses"] - before["misses"] <= 1
    assert after["hits"] - before["hits"] >= 5  # the check of each request, then each matcher


@pytest.mark.slow
def test_constrained_requests_survive_preemption(model, tokenizer):
    """Twelve constrained greedy requests in a pool for about three: preempted, recomputed,
    each output equals the same request's on an engine with ample memory, and validates."""
    schema = {
        "type": "object",
        "properties": {
            "words": {
                "type": "array",
                "items": {"type": "string", "maxLength": 6},
                "minItems": 4,
                "maxItems": 6,
            },
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["words", "n"],
        "additionalProperties": False,
    }
    spec = StructuredOutput.json_schema(schema)
    rng = random.Random(26)
    prompts = [[rng.randrange(5, 384) for _ in range(rng.randint(20, 36))] for _ in range(12)]

    def run(**pool):
        with InferenceEngine(
            model, tokenizer, max_batch_size=12, max_seq_len=160, start=False, **pool
        ) as eng:
            out = eng.run_batch(
                prompts, max_tokens=100, temperature=0.0, structured=spec, return_details=True
            )
            return out, eng.get_stats()["preemptions"]

    small, preempted = run(cache_mode="paged", page_size=4, kv_tokens=300)
    big, none = run(cache_mode="paged", page_size=4, kv_tokens=4096)
    assert preempted > 0 and none == 0
    assert [r.token_ids for r in small] == [r.token_ids for r in big]
    for r in small:
        assert r.finish_reason == "stop"
        jsonschema.validate(
            json.loads(tokenizer.decode(r.token_ids, skip_special_tokens=True)), schema
        )


@pytest.mark.parametrize("vocab", [384, 390, 420])
def test_eager_mask_fallback_equals_llguidance_kernel(vocab):
    """The eager fallback (no compiler on the machine) masks exactly like llguidance's."""
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 12), dtype=torch.int32, generator=gen)
    logits = torch.randn(3, vocab, generator=gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_eager(ours, bitmask)
    apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours).any() and torch.isfinite(ours).any()


def test_tool_call_tags_are_tokens_when_the_tokenizer_has_them(engine, tokenizer):
    """`<tool_call>` is one added token of our tokenizer: the grammar asks for that token
    (how the model writes it); a tag the tokenizer lacks is matched as text."""
    empty = {"type": "object", "properties": {}, "additionalProperties": False}
    tools = [{"name": "ping", "parameters": empty}]
    ours = StructuredOutput.tool_call(tools)
    other = StructuredOutput.tool_call(tools, start="[CALL]", end="[/CALL]")
    tag = tokenizer.token_to_id("<tool_call>")
    assert tag is not None and f"<[{tag}]>" in ours.grammar(grammar_compiler(tokenizer).special_id)
    out = engine.run_batch(
        [[5, 6, 7], [5, 6, 7]],
        max_tokens=80,
        temperature=0.0,
        structured=[ours, other],
        return_details=True,
    )
    assert out[0].token_ids[0] == tag
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in out]
    assert re.fullmatch(
        r'<tool_call>\n\{"name": "ping", "arguments": \{\}\}\n</tool_call>', texts[0]
    )
    assert re.fullmatch(r'\[CALL\]\n\{"name": "ping", "arguments": \{\}\}\n\[/CALL\]', texts[1])

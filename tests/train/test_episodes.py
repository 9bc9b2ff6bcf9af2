"""The episode runner: token transcripts, action masks and log-probs of multi-turn rollouts.

References are independent of the runner: the engine's own results of each turn (recorded
by a pass-through engine), one dense training forward over the whole transcript, the chat
template's rendering and `encode_chat`'s assistant mask of the final conversation, and the
prefix-cache figure the paged engine's page size implies.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any

import pytest
import torch

from astrai.data.builtin import arithmetic_problems
from astrai.inference import InferenceEngine, SamplingParams
from astrai.inference.batch import BatchResult
from astrai.model import ModelConfig, Transformer
from astrai.tokenizer import AutoTokenizer
from astrai.train.environments import Calculator, Environment, StepResult, run_episodes
from astrai.train.environments.calculator import CALC_TOOL
from astrai.train.environments.episodes import TURN_SEED_STRIDE

PAGE = 4
RECORDS = arithmetic_problems(6, seed=3)
TOOL_TEXT = (
    "\n<|im_start|>user\n<tool_response>\n68\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok() -> AutoTokenizer:
    texts = [f"{p['prompt']} {p['solution']}" for p in arithmetic_problems(60)]
    return AutoTokenizer.train(texts * 2, vocab_size=300)


@pytest.fixture(scope="module")
def model(tok) -> Transformer:
    cfg = ModelConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return Transformer(cfg).eval()


@pytest.fixture(scope="module")
def params(tok) -> SamplingParams:
    """GRPO's rollout settings, with a stop set that ends a random model's turns early."""
    stops = frozenset(range(0, len(tok), 7)) | frozenset(tok.stop_ids)
    return SamplingParams(max_tokens=12, logprobs_mode="scaled", stop_ids=stops, n=2)


def _engine(model, tok, **options) -> InferenceEngine:
    kw = dict(cache_mode="paged", page_size=PAGE, max_seq_len=256, max_batch_size=16)
    return InferenceEngine(model, tok, start=False, **{**kw, **options})


class Recording:
    """An engine that records every `run_batch` call and its results, then passes through."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.calls = engine, []

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def run_batch(self, prompts, params, **kw):
        results = self.engine.run_batch(prompts, params, **kw)
        self.calls.append(([list(p) for p in prompts], params, kw, results))
        return results


class TwoTurns(Environment):
    """Turn 1 gets a tool result (reward 0.25), turn 2 ends the episode (reward 1.0)."""

    def __init__(self, fail_reset: bool = False, fail_step: int | None = None) -> None:
        self.fail_reset, self.fail_step, self.turn = fail_reset, fail_step, 0

    def reset(self, record):
        if self.fail_reset:
            raise RuntimeError("boom in reset")
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages):
        self.turn += 1
        assert messages[-1]["role"] == "assistant"
        if self.turn == self.fail_step:
            raise RuntimeError(f"boom in step {self.turn}")
        if self.turn == 1:
            return StepResult([{"role": "tool", "content": "68"}], 0.25, False)
        return StepResult(None, 1.0, True)


def _segments(mask: list[int], values: list[Any]) -> list[tuple[int, list[Any]]]:
    """Runs of equal mask values: (mask value, the values under it)."""
    out: list[tuple[int, list[Any]]] = []
    for m, v in zip(mask, values):
        if out and out[-1][0] == m:
            out[-1][1].append(v)
        else:
            out.append((m, [v]))
    return out


SEED = 2  # every turn 1 of `_run` ends on a stop token (asserted where it matters)


def _run(model, tok, params, records=RECORDS[:2], seed=SEED, make_env=TwoTurns, **options):
    engine = Recording(_engine(model, tok, **options))
    episodes = run_episodes(engine, tok, make_env, records, params, max_turns=3, seed=seed)
    return episodes, engine


# ---------------------------------------------------------------------- masks and log-probs
def test_model_tokens_carry_the_mask_and_their_rollout_logprobs(model, tok, params):
    episodes, engine = _run(model, tok, params)
    assert len(episodes) == 4 and [e.turns for e in episodes] == [2] * 4  # the premise
    assert all(e.error is None and e.reward == (0.25 if e.truncated else 1.25) for e in episodes)
    (p1, params1, kw1, turn1), (p2, params2, kw2, turn2) = engine.calls
    # Turn 1: one group per record (n = 2); turn 2: every transcript alone, its own seeds.
    assert p1 == [episodes[0].prompt_ids, episodes[2].prompt_ids] and params1.n == 2
    assert kw1["seed"] == SEED and params2.n == 1 and kw2["seed"] == SEED + TURN_SEED_STRIDE
    assert [r.token_ids for r in turn1] != [r.token_ids for r in turn2]  # fresh draws
    for k, ep in enumerate(episodes):
        first, second = turn1[k], turn2[k]
        segments = _segments(ep.action_mask, ep.completion_ids)
        assert [m for m, _ in segments] == [1, 0, 1]
        assert segments[0][1] == first.token_ids and segments[2][1] == second.token_ids
        assert first.finish_reason == "stop"
        assert ep.truncated == (second.finish_reason == "length")
        # The observation: ChatML's text, with the template's <|im_end|> when the model's
        # turn ended on another stop id.
        ended = first.token_ids[-1] in tok.stop_ids
        assert tok.decode(segments[1][1]) == ("" if ended else "<|im_end|>") + TOOL_TEXT
        assert p2[k] == ep.prompt_ids + ep.completion_ids[: -len(second.token_ids)]
        assert ep.logprobs == first.logprobs + [0.0] * len(segments[1][1]) + second.logprobs
        assert ep.masked_fraction == pytest.approx(len(segments[1][1]) / len(ep.action_mask))
        # One training forward over the whole transcript gives the same log-probs.
        ids = torch.tensor([ep.prompt_ids + ep.completion_ids])
        with torch.no_grad():
            logits = model(ids)[0, :-1].float()
        ref = torch.log_softmax(logits / params.temperature, -1)
        ref = ref.gather(-1, ids[0, 1:, None])[:, 0][len(ep.prompt_ids) - 1 :]
        mask = torch.tensor(ep.action_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(ep.logprobs)[mask], ref[mask], atol=1e-5, rtol=0)
    assert episodes[0].messages[-2] == {"role": "tool", "content": "68"}


def test_turn_two_reuses_turn_one_from_the_prefix_cache(model, tok, params):
    one = dataclasses.replace(params, n=1)
    (ep,), engine = _run(model, tok, one, records=RECORDS[:1])
    (_, _, _, (first,)), _ = engine.calls
    assert ep.turns == 2 and ep.cached_prompt_tokens[0] == 0  # a fresh engine
    # Turn 1's request cached its complete pages when it finished: all but its last token.
    materialized = len(ep.prompt_ids) + len(first.token_ids) - 1
    assert ep.cached_prompt_tokens[1] == materialized // PAGE * PAGE > 0
    # Several episodes: turn 1's followers share the prompt, turn 2 reuses every transcript.
    episodes, engine = _run(model, tok, params)
    (_, _, _, turn1), _ = engine.calls
    prompt = len(episodes[0].prompt_ids)
    leaders = sum(e.cached_prompt_tokens[0] == 0 for e in episodes)
    followers = [e.cached_prompt_tokens[0] for e in episodes if e.cached_prompt_tokens[0]]
    assert leaders == 2 and followers  # two records (n = 2): one leader each
    assert set(followers) == {(prompt - 1) // PAGE * PAGE}  # each request's own figure
    for e, r in zip(episodes, turn1):  # every episode's turn 2 covers its turn 1
        assert (
            e.cached_prompt_tokens[1] >= (len(e.prompt_ids) + len(r.token_ids) - 1) // PAGE * PAGE
        )
    episodes, _ = _run(model, tok, params, prefix_cache=False)
    assert all(e.cached_prompt_tokens == [0, 0] for e in episodes)


def test_turn_seeds_draw_their_own_random_streams():
    """The engine seeds a request's generator with `SamplingParams.make_generator`; torch's
    CPU generators keep a seed's low 32 bits only, so the turn stride must show there."""
    streams = {
        tuple(torch.rand(8, generator=SamplingParams(seed=s).make_generator()).tolist())
        for turn in range(4)
        for s in (7 + turn * TURN_SEED_STRIDE, 7 + turn * TURN_SEED_STRIDE + 1)
    }
    assert len(streams) == 8


def test_same_seed_same_episodes_other_seed_others(model, tok, params):
    a, _ = _run(model, tok, params, seed=11)
    b, _ = _run(model, tok, params, seed=11)
    c, _ = _run(model, tok, params, seed=12)
    assert a == b
    assert [e.completion_ids for e in a] != [e.completion_ids for e in c]


# ---------------------------------------------------------------------- failures
def test_a_raising_environment_fails_its_episode_alone(model, tok, params, caplog):
    count = itertools.count()

    def make_env() -> TwoTurns:
        k = next(count)  # the factory is called once per episode, in episode order
        if k == 4:
            raise ValueError("no environment today")
        return TwoTurns(fail_reset=k == 1, fail_step={2: 2, 3: 1}.get(k))

    with caplog.at_level(logging.WARNING, logger="astrai.train.environments.episodes"):
        episodes, engine = _run(model, tok, params, records=RECORDS[:3], make_env=make_env)
    healthy, _ = _run(model, tok, params, records=RECORDS[:3])
    errors = [e.error for e in episodes]
    assert errors[0] is None and errors[5] is None
    assert errors[1] == "reset raised RuntimeError: boom in reset"
    assert errors[2] == "step raised RuntimeError: boom in step 2"
    assert errors[3] == "step raised RuntimeError: boom in step 1"
    assert errors[4] == "factory raised ValueError: no environment today"
    assert [e.reward for e in episodes][1:5] == [0.0] * 4  # 0.25 from turn 1 of episode 2: gone
    assert [e.reward for e in (episodes[0], episodes[5])] == [
        0.25 if e.truncated else 1.25 for e in (episodes[0], episodes[5])
    ]
    assert [e.turns for e in episodes] == [2, 0, 2, 1, 0, 2]
    # No prompt of its own: a sibling's, so that the group keeps one prompt.
    assert episodes[1].prompt_ids == episodes[0].prompt_ids and episodes[1].completion_ids == []
    assert episodes[4].prompt_ids == episodes[5].prompt_ids
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 4
    for k in (1, 2, 3, 4):
        assert [t for t in warned if t.startswith(f"episode {k}: ") and errors[k] in t]
    # With a group broken, turn 1 runs the live prompts alone, seeded by their place: the
    # first episode draws what it drew with the groups whole.
    (prompts, first, kw, _), *_ = engine.calls
    assert len(prompts) == 4 and first.n == 1 and kw["seed"] == SEED
    got, want = (_segments(e.action_mask, e.completion_ids)[0] for e in (episodes[0], healthy[0]))
    assert got == want
    n = len(want[1])
    assert episodes[0].logprobs[:n] == pytest.approx(healthy[0].logprobs[:n], abs=1e-5)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (([{"role": "tool", "content": "1"}], 0.0, "no"), "done must be a bool, got 'no'"),
        ((None, 0.0, False), "must give an observation (a list of messages) unless done"),
        (([{"role": "robot", "content": "1"}], 0.0, False), "unknown role 'robot'"),
        (([{"role": "tool", "content": "1"}], float("nan"), False), "reward must be a finite"),
        ("done", "must return a StepResult(observation, reward, done)"),
    ],
)
def test_a_malformed_step_answer_is_the_environments_error(tok, answer, error):
    class Bad(TwoTurns):
        def step(self, messages):
            return answer

    (ep,) = run_episodes(
        Scripted(tok, ["hi"]), tok, Bad, RECORDS[:1], SamplingParams(), max_turns=2, seed=0
    )
    assert ep.error.startswith("step raised ValueError: ") and error in ep.error
    assert (ep.reward, ep.turns, ep.action_mask) == (0.0, 1, [1] * len(ep.completion_ids))


# ---------------------------------------------------------------------- scripted replies
class Scripted:
    """An engine whose model says `replies[t]` (then its stop token) on turn `t`."""

    def __init__(self, tok, replies, *, reasons=None, max_seq_len=2048, stop="<|im_end|>") -> None:
        self.tok, self.replies, self.reasons = tok, replies, reasons or {}
        self.max_seq_len, self.turn, self.prompts = max_seq_len, 0, []
        self.stop = stop  # None: each reply ends with its own stop token

    def run_batch(self, prompts, params, *, seed, return_details):
        text = self.replies[min(self.turn, len(self.replies) - 1)]
        reason = self.reasons.get(self.turn, "stop")
        ends = reason == "stop" and self.stop is not None
        ids = self.tok.encode(text) + ([self.tok.token_to_id(self.stop)] if ends else [])
        self.turn += 1
        self.prompts.append(prompts)
        return [
            BatchResult(list(ids), [-0.5] * len(ids), reason, None)
            for _ in prompts
            for _ in range(params.n)
        ]


CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "23 + 45"}}\n</tool_call>'


@pytest.mark.parametrize("announce", [False, True])
def test_calculator_transcript_is_the_templates_rendering_with_its_assistant_mask(tok, announce):
    record = {"prompt": "What is 23 + 45?", "answer": "68"}
    engine = Scripted(tok, [CALL, "23 + 45 = 68. The answer is 68."])
    params = SamplingParams(n=2)
    episodes = run_episodes(
        engine,
        tok,
        lambda: Calculator(announce_tools=announce),
        [record],
        params,
        max_turns=4,
        seed=0,
    )
    assert len(episodes) == 2 and episodes[0] == episodes[1]
    ep = episodes[0]
    assert (ep.turns, ep.tool_calls, ep.reward, ep.truncated, ep.error) == (2, 1, 0.0, False, None)
    assert ep.final_text == "23 + 45 = 68. The answer is 68."
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "23 + 45"}}}
    assert ep.messages == [
        {"role": "user", "content": "What is 23 + 45?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "68"},
        {"role": "assistant", "content": "23 + 45 = 68. The answer is 68."},
    ]
    tools = [CALC_TOOL] if announce else None
    ids, mask = tok.encode_chat(ep.messages, tools=tools)
    assert tok.decode(ids[-1:]) == "\n"  # what the template writes after the last turn
    assert ep.prompt_ids + ep.completion_ids == ids[:-1]
    assert [0] * len(ep.prompt_ids) + ep.action_mask == mask[:-1]
    assert ep.prompt_ids == tok.apply_chat_template(
        ep.messages[:1], tools=tools, add_generation_prompt=True, tokenize=True
    )
    assert ep.logprobs == [-0.5 if m else 0.0 for m in ep.action_mask]


def test_max_turns_cut_tokens_and_the_context_truncate(tok):
    record = {"prompt": "What is 23 + 45?"}

    def run(engine: Scripted, turns: int = 2) -> list:
        params = SamplingParams(max_tokens=40)
        return run_episodes(engine, tok, Calculator, [record], params, max_turns=turns, seed=0)

    (ep,) = run(Scripted(tok, [CALL]))  # calls the tool forever
    assert (ep.turns, ep.tool_calls, ep.truncated) == (2, 2, True)
    assert ep.action_mask[-1] == 1  # no observation after the last model turn
    assert ep.messages[-1]["role"] == "assistant"
    (ep,) = run(Scripted(tok, [CALL], reasons={0: "length"}))  # the first turn is cut
    assert (ep.turns, ep.truncated, ep.reward) == (1, True, 0.0)
    assert ep.action_mask == [1] * len(ep.completion_ids)
    (ep,) = run(Scripted(tok, [CALL]), turns=1)
    assert (ep.turns, ep.truncated) == (1, True)
    # The second turn's prompt would leave fewer than max_tokens tokens of the context.
    prompt = len(
        tok.apply_chat_template(
            [{"role": "user", "content": record["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
        )
    )
    engine = Scripted(tok, [CALL], max_seq_len=prompt + len(tok.encode(CALL)) + 1 + 40 + 5)
    (ep,) = run(engine, turns=5)
    assert (ep.turns, ep.truncated, len(engine.prompts)) == (1, True, 1)
    assert ep.action_mask[-1] == 1


def test_rejected_generations_raise(tok):
    engine = Scripted(tok, ["x"], reasons={0: "rejected"})
    with pytest.raises(RuntimeError, match="episode 0 turn 1: generation rejected"):
        run_episodes(engine, tok, Calculator, RECORDS[:1], SamplingParams(), max_turns=2, seed=0)


@pytest.mark.parametrize("turns", [0, -1, 1.5, True])
def test_max_turns_must_be_a_positive_int(tok, turns):
    with pytest.raises(ValueError, match="max_turns"):
        run_episodes(
            Scripted(tok, ["x"]),
            tok,
            Calculator,
            RECORDS[:1],
            SamplingParams(),
            max_turns=turns,
            seed=0,
        )


def test_a_template_that_is_not_prefix_stable_is_refused(tok):
    last_only = (
        "{% for m in messages %}{% if loop.last %}<|im_start|>{{ m.role }}\n"
        "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    other = AutoTokenizer(tok.backend, chat_template=last_only)
    with pytest.raises(ValueError, match="not prefix-stable"):
        run_episodes(
            Scripted(other, [CALL]),
            other,
            Calculator,
            RECORDS[:1],
            SamplingParams(),
            max_turns=2,
            seed=0,
        )


# ---------------------------------------------------------------------- the tool parser
QWEN3_CODER_CALL = (
    "<tool_call>\n<function=calc>\n<parameter=expr>\n23 + 45\n</parameter>\n</function>\n"
    "</tool_call>"
)


def test_turns_are_read_with_the_parser_the_server_picks_for_the_template(model):
    """A template whose tool format is qwen3_coder's: the environment's default (`auto`)
    reads the model's calls with the parser `python -m astrai.serve tool_parser=auto` picks
    for the same tokenizer; hermes (the old runner's, hard-coded) reads none of them."""
    from astrai.serve import ServeSettings, create_app
    from astrai.tokenizer.chat_template import DEFAULT_CHAT_TEMPLATE

    texts = [f"{p['prompt']} {p['solution']}" for p in arithmetic_problems(60)]
    marker = "{# a Qwen3-Coder template writes <function=name><parameter=p> #}"
    coder = AutoTokenizer.train(
        texts * 2, vocab_size=300, chat_template=DEFAULT_CHAT_TEMPLATE + marker
    )
    served = create_app(_engine(model, coder), ServeSettings(tool_parser="auto")).state.astrai
    assert served.tool_parser.name == "qwen3_coder"
    record = {"prompt": "What is 23 + 45?", "answer": "68"}

    def episode(make_env):
        engine = Scripted(coder, [QWEN3_CODER_CALL, "The answer is 68."])
        (ep,) = run_episodes(
            engine, coder, make_env, [record], SamplingParams(), max_turns=3, seed=0
        )
        return ep

    ep = episode(Calculator)
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "23 + 45"}}}
    assert (ep.turns, ep.tool_calls, ep.error) == (2, 1, None)
    assert ep.messages[1:3] == [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "68"},
    ]
    ep = episode(lambda: Calculator(tool_parser="hermes"))
    assert (ep.turns, ep.tool_calls) == (1, 0)
    assert ep.final_text == QWEN3_CODER_CALL
    ep = episode(lambda: Calculator(tool_parser="none"))
    assert (ep.turns, ep.tool_calls) == (1, 0)


def test_gpt_oss_turns_are_read_through_their_harmony_channels():
    """A harmony template (GPT-OSS's shape, tests/tiny_parts.py): `auto` reads the calls with
    the `openai` parser after the harmony split, as the server does; the analysis is left out
    of the conversation, the call and the final answer are kept, the transcript is still the
    template's rendering."""
    from tiny_parts import harmony_tokenizer

    texts = [f"{p['prompt']} {p['solution']}" for p in arithmetic_problems(60)]
    tok = harmony_tokenizer(texts * 2, 300)
    record = {"prompt": "What is 23 + 45?", "answer": "68"}
    call = (
        "<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.calc <|constrain|>json<|message|>{"expr": "23 + 45"}<|call|>'
    )
    final = (
        "<|channel|>analysis<|message|>It said 68.<|end|><|start|>assistant<|channel|>final"
        "<|message|>The answer is 68.<|return|>"
    )
    engine = Scripted(tok, [call, final], stop=None)
    (ep,) = run_episodes(engine, tok, Calculator, [record], SamplingParams(), max_turns=3, seed=0)
    args = {"expr": "23 + 45"}
    assert (ep.turns, ep.tool_calls, ep.error) == (2, 1, None)
    assert ep.messages[1:] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": args}}],
        },
        {"role": "tool", "content": "68"},
        {"role": "assistant", "content": "The answer is 68."},
    ]
    assert ep.final_text == "The answer is 68."
    assert tok.encode(call) == ep.completion_ids[: len(tok.encode(call))]

"""The episode runner: multi-turn rollouts of a policy against per-episode environments.

`run_episodes` plays ``params.n`` episodes per record, every turn of all live episodes in
one `InferenceEngine.run_batch`: turn 1 as GRPO's single-turn rollout does (one group of
``n`` per record, its prompt prefilled once), each later turn over the live transcripts
(prompt + everything so far) with ``n = 1``; a transcript's earlier turns are in the radix
prefix cache (a request's complete pages enter it when it finishes), so only the new tail
is prefilled.

The transcript is kept as tokens and never re-tokenized: the model's own tokens (its stop
token included) exactly as sampled, with the engine's log-probs and action mask 1, then
the chat template's tokens between the model's turn and its next generation prompt (the
observation), with log-prob 0.0 and mask 0. Those are read off renderings of the
conversation: the tokens of ``render(messages + observation, add_generation_prompt=True)``
after ``render(messages)``, plus what the template writes after the assistant's stop token
(ChatML's ``"\\n"`` after ``<|im_end|>``; the template's stop token too when the model's turn
ended on another stop id). This needs a prefix-stable template (a conversation prefix
renders, and tokenizes, as a prefix of the whole: true of astrai's default ChatML
template, `astrai.tokenizer.chat_template`); one that is not raises ValueError.

The model's turn becomes an assistant message with the server's tool-call parser family:
the environment's `tool_parser` (``auto`` by default) resolved against the tokenizer's chat
template, as `python -m astrai.serve` resolves its own, so training and serving read a
model's calls alike.

Failures: an environment that raises (in the factory, `reset` or `step`), or answers
with a malformed `StepResult` or messages the template cannot render, fails its episode
alone (reward 0.0, `error` set, one warning); a rejected or aborted generation is an engine
or configuration error and raises RuntimeError.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any

from astrai.inference.params import SamplingParams
from astrai.serve import harmony
from astrai.serve.tool_parsers import ToolParserChoice, resolve
from astrai.train.environments.base import Environment, StepResult

if TYPE_CHECKING:
    from astrai.inference import InferenceEngine
    from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "TURN_SEED_STRIDE",
    "Episode",
    "TemplateNotPrefixStable",
    "assistant_message",
    "observation_ids",
    "run_episodes",
]

#: Turn ``t`` (from 1) draws with seeds ``seed + (t - 1) * TURN_SEED_STRIDE + p`` (`p` the
#: transcript's place in the turn's batch). Below 2**32: torch's CPU generators use only a
#: seed's low 32 bits (a stride of 2**40 gave every turn turn 1's random stream). Odd and
#: far from 0 and 2**32 in its first multiples (the golden-ratio prime): a turn's seed range
#: stays clear of turn 1's, and of later generation batches' (GRPO's seeds advance by the
#: batch's episode count), while batches hold far fewer than 2**30 episodes.
TURN_SEED_STRIDE = 2654435761


@dataclass
class Episode:
    """One episode's rollout, as GRPO trains on it, and what happened in it.

    `prompt_ids`: the rendered `reset` messages with the generation prompt (an environment
    that failed there gets a sibling's prompt, or [] when every sibling failed).
    `completion_ids`: everything after the prompt, in order; `logprobs` and `action_mask`
    align with it (the engine's log-prob and 1 on the model's tokens, 0.0 and 0 on the
    template's and observations'). `reward`: the sum of the step rewards (0.0 when the
    environment raised). `truncated`: the last model turn was cut by ``max_tokens``, the
    next prompt would not have fit the context, or ``max_turns`` ended the episode before
    the environment did. `error`: the environment's exception, else None.
    `cached_prompt_tokens`: per model turn, prompt tokens served from the prefix cache
    (see `run_episodes`). `messages`: the conversation, as the environment saw it.
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    truncated: bool = False
    error: str | None = None
    cached_prompt_tokens: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def final_text(self) -> str:
        """The last assistant message's content: what reward functions score."""
        for message in reversed(self.messages):
            if message.get("role") == "assistant":
                return message.get("content") or ""
        return ""

    @property
    def masked_fraction(self) -> float:
        """Share of completion tokens that are not the model's (0.0 for an empty one)."""
        n = len(self.action_mask)
        return 1.0 - sum(self.action_mask) / n if n else 0.0


def assistant_message(text: str, parser: ToolParserChoice | None) -> dict[str, Any]:
    """The model's turn as an OpenAI-shaped message: the text outside tool calls as
    ``content``, and ``tool_calls`` when any, read by `parser` (the environment's
    `tool_parser` choice) as the server reads a choice; any tool name passes (the
    environment answers an unknown one). None (``none``): the text is all content."""
    content, found = (text, []) if parser is None else parser.parse_text(text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [
        {"type": "function", "function": {"name": c.name, "arguments": c.input}} for c in found
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def turn_text(tokenizer: AutoTokenizer, ids: list[int], parser: ToolParserChoice | None) -> str:
    """The text of a model's turn that `assistant_message` reads: decoded without special
    tokens, except for GPT-OSS (the ``openai`` parser), whose harmony channels are special
    tokens: its analysis is left out (as its template leaves it out of later turns) and its
    answer and calls kept, as the server's harmony reasoning parser splits them."""
    if parser is None or parser.name != "openai":
        return tokenizer.decode(ids, skip_special_tokens=True)
    return harmony.split(tokenizer.decode(ids, skip_special_tokens=False))[1]


@dataclass(eq=False)
class _Run:
    """One episode in progress: its environment and whether it takes another turn."""

    index: int
    episode: Episode
    env: Any = None
    tools: Any = None
    parser: ToolParserChoice | None = None  # how the model's turns are read
    active: bool = True

    @property
    def transcript(self) -> list[int]:
        return self.episode.prompt_ids + self.episode.completion_ids

    def fail(self, where: str, err: BaseException) -> None:
        text = f"{where} raised {type(err).__name__}: {err}"
        logger.warning(
            "episode %d: the environment's %s; the episode ends with reward 0", self.index, text
        )
        self.episode.error, self.episode.reward, self.active = text, 0.0, False


def run_episodes(
    engine: InferenceEngine,
    tokenizer: AutoTokenizer,
    make_env: Callable[[], Environment],
    records: Sequence[Mapping[str, Any]],
    params: SamplingParams,
    *,
    max_turns: int,
    seed: int | None,
) -> list[Episode]:
    """``len(records) * params.n`` episodes, prompt-major (episode ``i * n + j`` is sample
    ``j`` of record ``i``), each against its own ``make_env()``.

    Turn 1 is ``run_batch`` with ``n``: episode ``i * n + j`` draws with seed
    ``seed + i * n + j``, as GRPO's single-turn rollouts. When the ``n`` environments of a
    record render different prompts, or one failed before its prompt, turn 1 runs every
    live prompt alone (``n = 1``) with seed ``seed + p``, `p` its place among the live
    episodes: the same seeds unless an episode failed. Turn ``t`` draws with
    ``seed + (t - 1) * TURN_SEED_STRIDE + p`` (`TURN_SEED_STRIDE`). `make_env` is called
    once per episode, in episode order. An episode ends when its environment says done,
    when its turn was cut by ``params.max_tokens``, after ``max_turns`` model turns, or when
    its next prompt would leave fewer than ``params.max_tokens`` tokens of the engine's
    context. A rejected or aborted generation raises RuntimeError before any environment
    sees that turn.

    `Episode.cached_prompt_tokens`: each turn's prompt tokens the prefix cache served
    (`BatchResult.cached_prompt_tokens`).
    """
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"run_episodes max_turns must be an int >= 1, got {max_turns!r}")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"run_episodes params must be a SamplingParams, got {type(params)}")
    n = params.n
    runs = [_start(k, make_env, records[k // n], tokenizer) for k in range(len(records) * n)]
    _share_prompts(runs, n)
    live = [r for r in runs if r.active]
    for turn in range(1, max_turns + 1):
        if not live:
            break
        results, cached = _generate(engine, runs, live, params, seed, turn)
        for run, result in zip(live, results):
            _check_result(run, result, turn, engine)
        for run, result, hits in zip(live, results, cached):
            run.episode.cached_prompt_tokens.append(hits)
            _advance(run, result, engine, tokenizer, params, max_turns)
        live = [r for r in live if r.active]
    return [r.episode for r in runs]


def _start(
    index: int, make_env: Callable[[], Any], record: Mapping[str, Any], tokenizer: AutoTokenizer
) -> _Run:
    """A new episode: its environment, reset on `record`, and its rendered prompt."""
    run = _Run(index, Episode(prompt_ids=[]))
    where = "factory"
    try:
        run.env = make_env()
        where = "reset"
        messages = run.env.reset(record)
        _check_messages(messages, "reset()")
        run.tools = getattr(run.env, "tools", None)
        spec = run.env.tool_parser if isinstance(run.env, Environment) else "auto"
        run.parser = resolve(spec, tokenizer.chat_template)
        prompt = tokenizer.apply_chat_template(
            messages, tools=run.tools, add_generation_prompt=True, tokenize=True
        )
    except Exception as err:
        run.fail(where, err)
        return run
    run.episode.prompt_ids = list(prompt)
    run.episode.messages = copy.deepcopy(list(messages))
    return run


def _share_prompts(runs: list[_Run], n: int) -> None:
    """An episode whose environment failed before its prompt takes a sibling's (GRPO's
    group keeps one prompt), or none when all of them failed."""
    for i in range(0, len(runs), n):
        group = runs[i : i + n]
        prompt = next((r.episode.prompt_ids for r in group if r.episode.error is None), [])
        for r in group:
            if r.episode.error is not None:
                r.episode.prompt_ids = list(prompt)


def _generate(
    engine: InferenceEngine,
    runs: list[_Run],
    live: list[_Run],
    params: SamplingParams,
    seed: int | None,
    turn: int,
) -> tuple[list[Any], list[int]]:
    """One model turn of the live episodes in one `run_batch`; its results in `live`'s
    order and each request's prefix-cache hits."""
    n = params.n
    grouped = turn == 1 and n > 1 and len(live) == len(runs)
    grouped = grouped and all(
        runs[i + j].episode.prompt_ids == runs[i].episode.prompt_ids
        for i in range(0, len(runs), n)
        for j in range(1, n)
    )
    if grouped:
        prompts, batch_params = [runs[i].episode.prompt_ids for i in range(0, len(runs), n)], params
    else:
        prompts, batch_params = [r.transcript for r in live], dataclasses.replace(params, n=1)
    if seed is not None:
        seed += (turn - 1) * TURN_SEED_STRIDE
    results = engine.run_batch(prompts, batch_params, seed=seed, return_details=True)
    return results, [int(r.cached_prompt_tokens) for r in results]


def _check_result(run: _Run, result: Any, turn: int, engine: InferenceEngine) -> None:
    if result.finish_reason not in ("stop", "length") or result.error:
        raise RuntimeError(
            f"episode {run.index} turn {turn}: generation {result.finish_reason} "
            f"({result.error}); prompt length {len(run.transcript)}, engine context "
            f"{engine.max_seq_len} (raise the engine's max_seq_len?)"
        )


def _advance(
    run: _Run,
    result: Any,
    engine: InferenceEngine,
    tokenizer: AutoTokenizer,
    params: SamplingParams,
    max_turns: int,
) -> None:
    """Record the model's turn, let the environment answer, append its observation."""
    ep = run.episode
    ids = list(result.token_ids)
    ep.completion_ids += ids
    ep.logprobs += [float(x) for x in result.logprobs]
    ep.action_mask += [1] * len(ids)
    ep.turns += 1
    message = assistant_message(turn_text(tokenizer, ids, run.parser), run.parser)
    ep.messages.append(message)
    ep.tool_calls += len(message.get("tool_calls", ()))
    if result.finish_reason == "length":  # a cut turn is not shown to the environment
        ep.truncated, run.active = True, False
        return
    try:
        observation, reward, done = _checked(run.env.step(copy.deepcopy(ep.messages)))
    except Exception as err:
        run.fail("step", err)
        return
    ep.reward += reward
    if done or ep.turns >= max_turns:
        ep.truncated, run.active = not done, False
        return
    stopped = bool(ids) and ids[-1] in tokenizer.stop_ids
    try:
        tail = observation_ids(tokenizer, ep.messages, observation, run.tools, stopped=stopped)
    except TemplateNotPrefixStable:
        raise
    except Exception as err:  # the observation's messages cannot be rendered
        run.fail("step", err)
        return
    if len(run.transcript) + len(tail) > engine.max_seq_len - params.max_tokens:
        ep.truncated, run.active = True, False
        return
    ep.completion_ids += tail
    ep.logprobs += [0.0] * len(tail)
    ep.action_mask += [0] * len(tail)
    ep.messages += copy.deepcopy(observation)


def _checked(out: Any) -> StepResult:
    """`step`'s answer, checked: a malformed one is the environment's error."""
    try:
        observation, reward, done = out
    except (TypeError, ValueError):
        raise ValueError(
            f"step() must return a StepResult(observation, reward, done), got {out!r}"
        ) from None
    if isinstance(reward, bool) or not isinstance(reward, Real) or not math.isfinite(reward):
        raise ValueError(f"step() reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise ValueError(f"step() done must be a bool, got {done!r}")
    if not done:
        if not observation:
            raise ValueError("step() must give an observation (a list of messages) unless done")
        _check_messages(observation, "step() observation")
    return StepResult(observation, float(reward), done)


def _check_messages(messages: Any, where: str) -> None:
    if (
        isinstance(messages, str | bytes)
        or not isinstance(messages, Sequence)
        or not messages
        or not all(isinstance(m, Mapping) for m in messages)
    ):
        raise ValueError(f"{where}: expected a non-empty list of message dicts, got {messages!r}")


class TemplateNotPrefixStable(ValueError):
    """The chat template renders a conversation prefix as something other than a prefix
    of the whole, so observation tokens cannot be appended to a kept transcript."""


def observation_ids(
    tokenizer: AutoTokenizer,
    messages: list[dict[str, Any]],
    observation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    *,
    stopped: bool = True,
) -> list[int]:
    """The template's tokens after the model's turn (``messages[-1]``) up to the next
    generation prompt, `observation` included: what follows the turn's stop token in
    ``render(messages)`` (from the stop token itself unless the model `stopped` on a stop
    token of the tokenizer) and everything ``render(messages + observation,
    add_generation_prompt=True)`` adds to ``render(messages)``."""

    def render(msgs: list[dict[str, Any]], prompt: bool) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                msgs, tools=tools, add_generation_prompt=prompt, tokenize=True
            )
        )

    before = render(messages[:-1], True)
    through = render(messages, False)
    after = render([*messages, *observation], True)
    if after[: len(through)] != through:
        raise TemplateNotPrefixStable(
            "chat template is not prefix-stable: the tokens of a conversation are not a prefix "
            "of those of the conversation with the observation appended, so a multi-turn "
            "transcript cannot be extended (use a ChatML-like template such as astrai's default)"
        )
    # Only the stop tokens are compared, not the turn's own tokens: those may tokenize
    # differently next to the header (a leading newline merges with the header's).
    stops = set(tokenizer.stop_ids)
    ends = [i for i, t in enumerate(through) if t in stops]
    if len(ends) <= sum(t in stops for t in before):
        raise TemplateNotPrefixStable(
            "chat template ends an assistant turn without a stop token of the tokenizer "
            f"({sorted(stops)}), so the model's turn end cannot be matched in it"
        )
    cut = ends[-1] + 1 if stopped else ends[-1]
    return through[cut:] + after[len(through) :]

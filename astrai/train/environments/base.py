"""The environment interface of multi-turn rollouts: what the episode runner asks of a task.

An environment plays the other side of a conversation: it opens an episode with chat
messages for a data record (`reset`), then answers each model turn (`step`) with the
messages to append (a tool result, test feedback), a reward, and whether the episode is
over. One instance serves one episode (TRL's ``environment_factory``): the runner calls the
factory once per episode, so an environment keeps its episode's state in plain attributes.
Messages are OpenAI-shaped dicts, the same the chat template renders; the model's turn
arrives as ``{"role": "assistant", "content": str}`` plus ``"tool_calls": [{"type":
"function", "function": {"name": ..., "arguments": {...}}}]`` when it called tools.

Writing one (a guessing game: the model gets up to three tries; the runner's reward is the
sum of the step rewards)::

    from astrai.train.environments import Environment, StepResult, run_episodes

    class Guess(Environment):  # name the record's answer; a wrong guess hears "try again"
        def reset(self, record):
            self.answer, self.tries = str(record["answer"]), 0
            return [{"role": "user", "content": record["prompt"]}]

        def step(self, messages):
            self.tries += 1
            if messages[-1]["content"].strip() == self.answer:
                return StepResult(None, 1.0, True)
            retry = [{"role": "user", "content": "Wrong, try again."}]
            return StepResult(retry, 0.0, self.tries >= 3)

    episodes = run_episodes(
        engine, tokenizer, Guess, records, params, max_turns=3, seed=0
    )
    rewards = [e.reward for e in episodes]  # len(records) * params.n, prompt-major
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, NamedTuple

from astrai.serve.tool_parsers import ToolParserChoice, resolve

__all__ = ["Environment", "StepResult"]


class StepResult(NamedTuple):
    """An environment's answer to one model turn.

    `observation`: the messages to append before the model's next turn (e.g. ``[{"role":
    "tool", "content": "68"}]``); None or empty only when `done`. `reward`: this step's
    reward (the episode's is the sum). `done`: the episode is over (an observation given
    with it is not shown to the model).
    """

    observation: list[dict[str, Any]] | None
    reward: float = 0.0
    done: bool = False


class Environment(ABC):
    """One episode of a multi-turn task (see the module docstring for an example).

    `tools`: OpenAI function schemas rendered into the prompt (the chat template's
    ``tools=``); None: no tool block. `tool_parser`: how the runner reads tool calls in the
    model's turns, the server's `tool_parser` setting (vLLM's names: ``hermes``,
    ``llama3_json``, ``mistral``, ``pythonic``, ``qwen3_coder``, ``none``, "START|END" tags,
    or a `ToolParserChoice`); ``auto`` (the default) picks the parser from the tokenizer's
    chat template as the server's ``auto`` does, so training and serving read a model's
    calls alike. The runner only duck-types `reset`, `step` and `tools`; an object that is
    not an `Environment` is read with ``auto``.
    """

    tools: list[dict[str, Any]] | None = None
    tool_parser: str | ToolParserChoice = "auto"

    def __init__(self, *, tool_parser: str | ToolParserChoice = "auto") -> None:
        resolve(tool_parser)  # a ValueError naming tool_parser and its choices, at build time
        self.tool_parser = tool_parser

    @abstractmethod
    def reset(self, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The episode's first messages for `record` (e.g. the user's question)."""

    @abstractmethod
    def step(self, messages: list[dict[str, Any]]) -> StepResult:
        """Answer the model's turn: `messages` is the conversation so far, its last one the
        model's assistant message."""

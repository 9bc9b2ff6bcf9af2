"""`StepOutput`: what one step plan's forward emitted, per sampling row, read by name.

Plain decode is speculation with k = 0: every sampler (a row of `StepPlan.samplers`)
emits a list of tokens, one for a plain step, 1..k+1 after verifying k proposals (the
accepted proposals, then the sample that differed or the bonus token), none when its own
sampling failed (`faults`). The runner produces it (`astrai.inference.verify.sample_step`),
`InferenceScheduler.postprocess(plan, out)` appends the tokens under the stop rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from astrai.inference.logprobs import PromptScores, TopLogprobs


@dataclass(slots=True)
class StepOutput:
    """Per sampler `s` (in `plan.samplers` order): `tokens[s]` emitted this step and their
    `logprobs[s]` (the request's `logprobs_mode`); `top_logprobs[s]` their alternatives
    (None when no sampler asks); `proposed[s]` the proposals it verified (None: a plain
    step), of which it accepted `accepted(s)`. `faults` `{s: error}`: samplers whose own
    sampling failed at their first position (they emit nothing and end `aborted`);
    `stopped`: samplers whose structured output is complete after their last token.
    `prompt_logprobs`: the prompt tokens this forward scored."""

    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    top_logprobs: list[list[TopLogprobs]] | None = None
    proposed: list[int] | None = None
    faults: dict[int, str] = field(default_factory=dict)
    stopped: set[int] = field(default_factory=set)
    prompt_logprobs: list[PromptScores] | None = None

    def accepted(self, s: int) -> int:
        """Proposals sampler `s` kept: all its tokens but the last (0 without proposals)."""
        if not self.proposed or not self.proposed[s]:
            return 0
        return max(0, len(self.tokens[s]) - 1)


__all__ = ["StepOutput"]

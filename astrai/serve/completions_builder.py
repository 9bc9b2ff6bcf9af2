"""Legacy OpenAI text completions: `/v1/completions`, plain and streaming.

This is the API that scoring clients speak (lm-eval's `local-completions`): a batch of
prompts as text or token ids, `echo` to get the prompt back with the log-prob of every
prompt token, `max_tokens=0` to score without sampling. Prompts are used as given: no
chat template and no special tokens are added (as `InferenceEngine.generate` does).
"""

from __future__ import annotations

from typing import Any

from astrai.serve.best_of import check_best_of
from astrai.serve.errors import APIError
from astrai.serve.logprobs import LegacyLogprobs, token_text
from astrai.serve.openai_builder import OpenAIStyleBuilder, usage
from astrai.serve.protocol import Choice, Prepared, RequestContext
from astrai.serve.request import openai_params, or_default, stop_strings
from astrai.serve.schemas import CompletionRequest, given
from astrai.serve.settings import ServeSettings
from astrai.serve.structured_outputs import structured_outputs_constraint
from astrai.serve.tool_parsers import Event, TextDelta
from astrai.tokenizer import AutoTokenizer

_FINISH = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "stop",
    "error": "stop",
}


def _prompts(
    prompt: str | list[str] | list[int] | list[list[int]], tokenizer: AutoTokenizer, echo: bool
) -> tuple[list[list[int]], list[str]]:
    """Token ids and echo text of every prompt (text is echoed as given, ids decoded).

    Ids are checked against the model's vocabulary by the engine, after this: an id the
    tokenizer does not know decodes to nothing here and is refused there.
    """
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt: the list of prompts is empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]  # one prompt of token ids
    ids: list[list[int]] = []
    texts: list[str] = []
    for p in prompt:
        if isinstance(p, str):
            ids.append(tokenizer.encode(p))
            texts.append(p)
        else:
            ids.append(list(p))
            ok = echo and all(t >= 0 for t in p)
            texts.append(tokenizer.decode(p) if ok else "")
    return ids, texts


class CompletionsResponseBuilder(OpenAIStyleBuilder):
    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def prepare(
        self, body: CompletionRequest, tokenizer: AutoTokenizer, settings: ServeSettings
    ) -> Prepared:
        if body.suffix:
            raise APIError(400, "suffix: insertion (suffix) is not supported", param="suffix")
        n = or_default(body, "n")
        best_of = check_best_of(body.best_of, n, stream=bool(body.stream))
        echo = bool(body.echo)
        max_tokens = or_default(body, "max_tokens")
        if max_tokens == 0 and not echo:
            raise APIError(
                400, "max_tokens: 0 is allowed only with echo (prompt scoring)", param="max_tokens"
            )
        prompts, texts = _prompts(body.prompt, tokenizer, echo)
        k = body.logprobs
        extra: dict[str, Any] = {}
        if k is not None:
            extra["logprobs"] = k
        if echo and (k is not None or max_tokens == 0):
            extra["prompt_logprobs"] = k or 0  # scoring only: the engine samples nothing
        structured = structured_outputs_constraint(body.structured_outputs, tokenizer)
        if structured is not None:  # compiled already: a bad one was a 400 naming it
            extra["structured"] = structured
        field = given(body, "max_tokens")
        return Prepared(
            prompts=prompts,
            params=openai_params(
                body, settings, max_tokens=max_tokens, max_tokens_param=field, **extra
            ),
            max_tokens_param=field,
            n=n,
            best_of=best_of,
            stops=stop_strings(body.stop),
            stream=bool(body.stream),
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            model=settings.model_name,  # the id /v1/models lists, whatever was asked
            prompt_param="prompt",
            options={
                "echo": texts if echo else None,
                "tokens": token_text(tokenizer) if k is not None else None,
            },
        )

    # ------------------------------------------------------------------ pieces of a choice
    def _echo(self, ctx: RequestContext, choice: Choice) -> str | None:
        """The prompt text, once per choice, when echoing (None otherwise, or after that)."""
        texts = ctx.prepared.options["echo"]
        echoed = ctx.extra.setdefault("echoed", set())
        if texts is None or choice.index in echoed:
            return None
        echoed.add(choice.index)
        return texts[choice.prompt_index]

    def _logprobs(
        self, ctx: RequestContext, choice: Choice, echo: bool, upto: int | None
    ) -> dict | None:
        """Legacy log-probs of the prompt (with `echo`) and of the tokens not yet sent."""
        tt = ctx.prepared.options["tokens"]
        if tt is None:
            return None
        builders = ctx.extra.setdefault("logprobs", {})
        lp = builders.setdefault(choice.index, LegacyLogprobs(tt))
        task = choice.result.task
        texts = ctx.prepared.options["echo"]
        # The choice's text so far: its echoed prompt, then the output emitted until now.
        text_len = (0 if texts is None else len(texts[choice.prompt_index])) + choice.chars
        parts = []
        if echo:
            ids = ctx.prepared.prompts[choice.prompt_index]
            scored = task.prompt_logprobs or [None] * len(ids)
            parts.append(
                lp.build(
                    ids,
                    [None if e is None else e.logprob for e in scored],
                    [None if e is None else e.top for e in scored],
                    text_len=text_len,
                )
            )
        span = choice.take_tokens(upto)
        tops = task.top_logprobs
        parts.append(
            lp.build(
                task.output_ids[span.start : span.stop],
                task.logprobs[span.start : span.stop],
                [tops[i] if i < len(tops) else () for i in span],
                text_len=text_len,
                skipped=tt.special,  # the output's text is decoded without special tokens
            )
        )
        return LegacyLogprobs.merge(parts)

    def _choice(
        self, ctx: RequestContext, choice: Choice, text: str, upto: int | None, finish: str | None
    ) -> dict[str, Any]:
        echo = self._echo(ctx, choice)
        return {
            "index": choice.index,
            "text": (echo or "") + text,
            "logprobs": self._logprobs(ctx, choice, echo is not None, upto),
            "finish_reason": finish,
        }

    # ------------------------------------------------------------------ streaming
    def format_stream_start(self, ctx: RequestContext) -> list[str]:
        return []  # the echo comes with a choice's first chunk, once its prompt is scored

    def format_chunk(self, ctx: RequestContext, choice: Choice, event: Event) -> list[str]:
        if not isinstance(event, TextDelta):  # no tools here; nothing else is produced
            return []
        upto = choice.tokens_emitted()
        return [self._chunk(ctx, [self._choice(ctx, choice, event.text, upto, None)])]

    def format_choice_end(self, ctx: RequestContext, choice: Choice) -> list[str]:
        end = self._choice(ctx, choice, "", None, _FINISH[choice.finish_reason or "stop"])
        return [self._chunk(ctx, [end])]  # the usage comes once, in its own final chunk

    # ------------------------------------------------------------------ plain
    def format_response(self, ctx: RequestContext) -> dict[str, Any]:
        choices = [
            self._choice(ctx, c, c.content, None, _FINISH[c.finish_reason or "stop"])
            for c in ctx.choices
        ]
        return {**self.head(ctx, "text_completion"), "choices": choices, "usage": usage(ctx)}

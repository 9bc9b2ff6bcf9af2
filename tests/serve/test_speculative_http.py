"""Speculative decoding behind the HTTP API: stop strings inside an accepted run, streams
that deliver a step's accepted tokens together, usage, and the same text as without."""

from __future__ import annotations

import openai
import pytest

from astrai.inference import InferenceEngine
from astrai.model import AutoModel, Transformer
from astrai.serve import ServerThread, ServeSettings, create_app

MSGS = [{"role": "user", "content": "Count for me"}]
# A periodic answer: after its first period the n-gram lookup proposes the next one, and the
# scripted model (forced logits: the real forward runs) accepts it.
PERIOD = "alpha beta gamma delta "
TEXT = PERIOD * 6 + "omega end"


class PositionScripted(Transformer):
    """Runs the real forward, then forces the logits at every requested position to the
    script's token for that position (after the prompt: then the end token). Unlike
    conftest's `ScriptedTransformer` it scores any number of positions per row, as a
    speculative step asks."""

    script: tuple[int, ...] = ()
    end_id: int = 0

    def forward_packed(self, input_ids, positions, kv_cache, logits_indices=None, **kwargs):
        logits = super().forward_packed(input_ids, positions, kv_cache, logits_indices, **kwargs)
        starts = self.__dict__.setdefault("prompt_len", {})
        row_of = []
        for row, seq, q in zip(
            kv_cache.req_pool_indices_host, kv_cache.seq_lens_host, kv_cache.q_lens_host
        ):
            if seq == q:  # a prefill from position 0: the prompt of a new sequence
                starts[row] = seq
            row_of += [row] * q
        forced = logits.new_full(logits.shape, -1e4)
        for k, i in enumerate(logits_indices.tolist()):
            j = int(positions[i]) + 1 - starts[row_of[i]]  # the output index it predicts
            forced[k, self.script[j] if j < len(self.script) else self.end_id] = 1e4
        return forced


def _served(model_dir, tokenizer, speculative):
    loaded = AutoModel.from_pretrained(model_dir)
    model = PositionScripted(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    model.end_id = tokenizer.token_to_id("<|im_end|>")
    model.script = tokenizer.encode(TEXT)
    engine = InferenceEngine(
        model, tokenizer, max_batch_size=4, max_seq_len=1024, speculative=speculative
    )
    return engine, ServerThread(create_app(engine, ServeSettings()))


@pytest.fixture(scope="module")
def servers(model_dir, tokenizer):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    on_engine, on = _served(model_dir, tokenizer, spec)
    off_engine, off = _served(model_dir, tokenizer, None)
    with on, off:
        yield {"on": (on_engine, on.url), "off": (off_engine, off.url)}
    on_engine.shutdown()
    off_engine.shutdown()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_same_text_stop_string_and_usage_on_and_off(servers, stream):
    """A stop string that falls inside an accepted run ends the text exactly where it does
    without speculation; usage counts the tokens the client got."""
    answers = {}
    for side, (_, url) in servers.items():
        kwargs = dict(model="astrai", messages=MSGS, max_tokens=200, stop=["gamma delta alpha"])
        with _client(url) as client:
            if stream:
                chunks = list(
                    client.chat.completions.create(
                        stream=True, stream_options={"include_usage": True}, **kwargs
                    )
                )
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            else:
                r = client.chat.completions.create(**kwargs)
                text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        answers[side] = (text, reason)
    assert answers["on"] == answers["off"]
    assert answers["on"] == ("alpha beta ", "stop")


def test_whole_answers_match_and_accepted_tokens_stream_together(servers):
    """The whole periodic answer is the same on and off; on, the stream has fewer text
    chunks than tokens (several accepted tokens leave in one step), and the engine's
    figures show proposals accepted."""
    texts, chunks_on = {}, 0
    for side, (engine, url) in servers.items():
        with _client(url) as client:
            stream = client.chat.completions.create(
                model="astrai",
                messages=MSGS,
                max_tokens=200,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage = [], None
            for c in stream:
                if c.choices and c.choices[0].delta.content:
                    parts.append(c.choices[0].delta.content)
                if c.usage is not None:
                    usage = c.usage
        texts[side] = "".join(parts)
        if side == "on":
            chunks_on, tokens_on = len(parts), usage.completion_tokens
            stats = engine.get_stats()
    assert texts["on"] == texts["off"] == TEXT
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_mean_accepted_length"] > 1.5
    assert chunks_on < tokens_on

"""The server decodes its streams on its event loop; the engine's thread only records tokens
and wakes it (astrai/serve/handler.py, astrai/inference/result.py)."""

from __future__ import annotations

import threading


def test_http_streams_are_decoded_off_the_engine_thread(oai, script, tokenizer, monkeypatch):
    seen: set[str] = set()
    make = tokenizer.stream_decoder

    class Recording:
        def __init__(self, **kw):
            self.inner = make(**kw)

        def step(self, token_id):
            seen.add(threading.current_thread().name)
            return self.inner.step(token_id)

        def flush(self):
            seen.add(threading.current_thread().name)
            return self.inner.flush()

    monkeypatch.setattr(tokenizer, "stream_decoder", lambda **kw: Recording(**kw))
    answer = "Once upon a time, a 🐍 met a café owner."
    script(answer)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    stream = oai.chat.completions.create(model="astrai", messages=msgs, n=2, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    plain = oai.chat.completions.create(model="astrai", messages=msgs)
    assert texts == [answer, answer] and plain.choices[0].message.content == answer
    assert seen and "astrai-engine" not in seen

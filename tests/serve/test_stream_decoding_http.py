"""The server decodes its streams on its event loop; the engine's thread only records tokens
and wakes it (astrai/serve/handler.py, astrai/inference/result.py)."""

from __future__ import annotations


def test_http_streams_are_decoded_off_the_engine_thread(oai, script, decoding_threads):
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
    assert decoding_threads and "astrai-engine" not in decoding_threads

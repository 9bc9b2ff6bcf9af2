"""Embeddings throughput: astrai's `Embedder` (the server's `/v1/embeddings` path: padding-free
packed forwards of up to 8,192 tokens, the engine loop paused) against transformers-style pooling (the same
weights exported in HF format, `LlamaModel` over a padded batch, masked mean pooling).

    .venv/bin/python experiments/bench/embeddings_cpu.py [--out DIR]

A random-weight model (hidden 256, 4 layers, vocabulary 4,096), fp32, CPU; 64 prompts of
32-256 random tokens; best of 3 rounds each; both results compared to 1e-4.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

from astrai.inference import InferenceEngine
from astrai.inference.embedding import Embedder
from astrai.model import ModelConfig, Transformer, save_pretrained
from astrai.tokenizer import AutoTokenizer

logger = logging.getLogger("embeddings_cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="write the result JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    cfg = ModelConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    model = Transformer(cfg).eval()
    engine = InferenceEngine(model, tok, max_batch_size=4, max_seq_len=512, start=False)
    embedder = Embedder.of_engine(engine, "mean", "bench")
    lengths = torch.randint(32, 257, (64,)).tolist()
    prompts = [torch.randint(0, 4096, (n,)).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as export:
        save_pretrained(model, export, hf_format=True)
        hf = transformers.AutoModel.from_pretrained(export, dtype=torch.float32).eval()

    def ours() -> torch.Tensor:
        return torch.stack(embedder.embed(prompts))

    def reference(batch: int = 16) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for i in range(0, len(prompts), batch):
                chunk = prompts[i : i + batch]
                width = max(map(len, chunk))
                ids = torch.tensor([p + [0] * (width - len(p)) for p in chunk])
                mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in chunk])
                hidden = hf(input_ids=ids, attention_mask=mask).last_hidden_state
                mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
                out.append(F.normalize(mean, dim=-1))
        return torch.cat(out)

    result = {"threads": torch.get_num_threads(), "uptime_load": os.getloadavg()}
    tokens = sum(lengths)
    for name, fn in (("astrai_embedder", ours), ("transformers_padded_mean", reference)):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            vectors = fn()
            best = min(best, time.perf_counter() - start)
        result[name] = {"seconds": round(best, 3), "tokens_per_s": round(tokens / best)}
        result[f"{name}_vectors"] = vectors
    torch.testing.assert_close(
        result.pop("astrai_embedder_vectors"),
        result.pop("transformers_padded_mean_vectors"),
        atol=1e-4,
        rtol=0,
    )
    result["prompts"], result["tokens"] = len(prompts), tokens
    logger.info("%s", json.dumps(result))
    if args.out:
        with open(os.path.join(args.out, "embeddings-cpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()

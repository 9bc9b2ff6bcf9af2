"""Benchmarks: ``python -m astrai.bench <name> [key=value ...]``.

Each benchmark is a module with ``run(cfg) -> report`` and ``format_report(report) -> str``;
its options and their defaults are ``conf/bench/<name>.yaml``. :data:`BENCHMARKS` maps
names to modules, which are imported only when run.
"""

BENCHMARKS: dict[str, str] = {
    "chunked_loss": "astrai.bench.chunked_loss",
    "data": "astrai.bench.data",
    "engine": "astrai.bench.engine",
    "eval": "astrai.bench.eval",
    "grpo_async": "astrai.bench.grpo_async",
    "kernels": "astrai.bench.kernels",
    "packing": "astrai.bench.packing",
    "quant": "astrai.bench.quant",
    "rollouts": "astrai.bench.rollouts",
    "scaling": "astrai.bench.scaling",
    "serve": "astrai.bench.serve",
    "train": "astrai.bench.train",
    "train_trl": "astrai.bench.train_trl",
    "weight_sync": "astrai.bench.weight_sync",
}

__all__ = ["BENCHMARKS"]

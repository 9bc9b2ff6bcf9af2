"""``python -m astrai.serve [model=<dir>] [key=value ...]``: serve a model directory over HTTP.

Options are in ``conf/serve.yaml`` (Hydra). The model defaults to ``$ASTRAI_MODEL`` or
``outputs/latest/export``, where ``make train`` exports its last run.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

CONF_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))

logger = logging.getLogger("astrai.serve")


def build_engine(cfg: dict[str, Any]) -> Any:
    """Load the model and tokenizer from `cfg["model"]` and start an `InferenceEngine`."""
    import torch

    from astrai.inference import InferenceEngine
    from astrai.model import AutoModel
    from astrai.tokenizer import AutoTokenizer

    path = Path(str(cfg["model_path"])).expanduser()
    if cfg.get("backend"):
        os.environ["ASTR_BACKEND"] = str(cfg["backend"])
    device = cfg.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None
    model = AutoModel.from_pretrained(path, device=device, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return InferenceEngine(
        model,
        tokenizer,
        max_batch_size=cfg["max_batch_size"],
        max_seq_len=cfg.get("max_seq_len"),
        cache_mode=cfg["cache_mode"],
        page_size=cfg["page_size"],
        kv_tokens=cfg.get("kv_tokens"),
        memory_fraction=cfg.get("memory_fraction"),
        max_prefill_tokens=cfg["max_prefill_tokens"],
        max_queue=cfg.get("max_queue"),
    )


def serve(cfg: dict[str, Any]) -> None:
    """Build the engine, run uvicorn until SIGINT/SIGTERM, then end streams and stop."""
    path = Path(str(cfg["model_path"])).expanduser()
    if not path.is_dir():  # checked before the heavy imports: fail fast with the fix
        raise SystemExit(
            f"model directory {str(path)!r} does not exist: run `make train` first "
            "or pass model=<dir>"
        )
    import uvicorn

    from astrai.serve import Server, ServeSettings, create_app

    logging.getLogger().setLevel(str(cfg.get("log_level", "info")).upper())
    engine = build_engine(cfg)
    settings = ServeSettings(
        model_name=cfg.get("model_name") or Path(str(cfg["model_path"])).resolve().name,
        api_key=cfg.get("api_key") or None,
        tool_call_format=str(cfg.get("tool_call_format") or "none"),
        max_prompt_tokens=cfg.get("max_prompt_tokens"),
    )
    app = create_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=cfg["host"],
        port=int(cfg["port"]),
        log_level=str(cfg.get("log_level", "info")).lower(),
        access_log=False,  # we log one line per request ourselves
        timeout_graceful_shutdown=cfg.get("timeout_graceful_shutdown"),
    )
    logger.info(
        "serving %s (%s) on http://%s:%s%s",
        settings.model_name,
        cfg["model_path"],
        cfg["host"],
        cfg["port"],
        " (API key required)" if settings.api_key else "",
    )
    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a normal stop
        pass
    finally:
        engine.shutdown()
        logger.info("server stopped")


def _cli(cfg: Any) -> None:
    from omegaconf import OmegaConf

    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    serve({k: v for k, v in options.items() if k != "hydra"})


def main() -> None:
    import hydra

    from astrai.cli import model_arg_to_model_path

    model_arg_to_model_path()
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="serve")(_cli)()


if __name__ == "__main__":
    sys.exit(main())

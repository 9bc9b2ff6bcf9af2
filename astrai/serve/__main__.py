"""``python -m astrai.serve [model_path=<dir>] [key=value ...]``: serve a model directory.

Options are in ``conf/serve.yaml`` (Hydra), the engine's in the ``engine`` group
(``engine=contiguous``, ``engine.max_batch_size=64``). The model defaults to
``$ASTRAI_MODEL`` or ``outputs/latest/export``, where ``make train`` exports its last run.
Every check that needs no model runs first, before torch, the model code, uvicorn or the
app are imported (they are deferred into the functions, and `astrai.serve` imports its
names lazily): the model directory (`astrai.model.directory`: a reward model's is named as
such), an embedding export's (`astrai.serve.embedding_model`), the server settings, the address (a non-loopback `host` needs `api_key` or
`allow_unauthenticated=true`), the adapter names, the port, then the engine's `lora` and
`speculative` options (these import torch, but no model). A wrong one fails in seconds with
one line naming the key.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astrai.model.directory import check_model_dir
from astrai.serve.embedding_model import build_embedding, check_embedding_dir

if TYPE_CHECKING:
    from fastapi import FastAPI

    from astrai.inference import InferenceEngine
    from astrai.inference.speculative import SpeculativeConfig
    from astrai.serve.settings import ServeSettings

CONF_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "conf"))

logger = logging.getLogger("astrai.serve")

# ServeSettings fields taken from conf/serve.yaml as they are.
_SETTINGS = (
    "max_body_bytes",
    "max_prompt_chars",
    "tokenizer_threads",
    "request_timeout_s",
    "max_client_batch_size",
    "max_tokens_policy",
    "tool_parser",
    "reasoning_parser",
    "allow_runtime_lora",
    "allowed_lora_roots",
    "allow_weight_updates",
    "max_stored_responses",
    "pooling_type",
)


def device_and_dtype(cfg: dict[str, Any]) -> tuple[str, Any]:
    """`device` (`auto`: CUDA when present, else the CPU) and `dtype` (None: the stored one)
    of the served models, the generative one and the reward model alike."""
    import torch

    device = cfg.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, (getattr(torch, cfg["dtype"]) if cfg.get("dtype") else None)


def lora_modules_of(cfg: dict[str, Any]) -> dict[str, str]:
    """`lora_modules` as {name: directory}: a mapping, or vLLM's list of ``name=path``.
    A bad entry, a bad name (`lora_paths.check_lora_name`) or a directory that does not
    exist is a SystemExit naming `lora_modules.<name>` (checked before the model loads)."""
    from astrai.serve.lora_paths import check_lora_name

    given = cfg.get("lora_modules")
    if not given:
        return {}
    if isinstance(given, dict):
        pairs = [(str(k), v) for k, v in given.items()]
    elif isinstance(given, list | tuple):
        pairs = []
        for item in given:
            name, sep, path = str(item).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise SystemExit(f"lora_modules: expected name=path, got {item!r}")
            pairs.append((name.strip(), path.strip()))
    else:
        raise SystemExit(
            f"lora_modules: expected a mapping {{name: dir}} or a list of name=dir, got {given!r}"
        )
    modules: dict[str, str] = {}
    for name, path in pairs:
        try:
            check_lora_name(name, key=f"lora_modules.{name}")
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if not isinstance(path, str) or not path:
            raise SystemExit(f"lora_modules.{name}: expected an adapter directory, got {path!r}")
        if name in modules:
            raise SystemExit(f"lora_modules.{name}: named twice")
        if not Path(path).expanduser().is_dir():
            raise SystemExit(
                f"lora_modules.{name}: {path} is not a directory (a LoRA adapter directory "
                "with adapter_config.json and adapter_model.safetensors)"
            )
        modules[name] = str(Path(path).expanduser())
    return modules


def engine_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `engine` group's settings, with LoRA on (`engine.lora`, default limits) when
    `lora_modules` names adapters or `allow_runtime_lora` is true and `engine.lora` is null."""
    options = dict(cfg["engine"])
    wants_lora = cfg.get("lora_modules") or cfg.get("allow_runtime_lora") is True
    if wants_lora and options.get("lora") is None:
        options["lora"] = {}  # LoRASettings(): max_loras 4, max_lora_rank 16
    return options


def check_engine_options(cfg: dict[str, Any]) -> SpeculativeConfig | None:
    """Check `engine.lora` and `engine.speculative` (and a draft model's directory) as
    serve will use them (`engine_options`) before the model loads: a bad one is a
    SystemExit naming the key. Returns the speculative setting (None: off)."""
    from astrai.inference.engine_options import check_engine_blocks

    return check_engine_blocks(engine_options(cfg))


def side_model_name(cfg: dict[str, Any], kind: str, taken: tuple[str, ...]) -> str | None:
    """The id `/v1/models` lists the `<kind>_model` (reward, embedding) under:
    `<kind>_model_name`, else its directory's name, else (a name in `taken`, e.g. two
    `export` folders) ``<that name>-<kind>``. An explicit name in `taken` (the served
    model's first, then other side models') is a SystemExit naming the key."""
    if not cfg.get(f"{kind}_model"):
        return None
    given = cfg.get(f"{kind}_model_name")
    if given:
        if str(given) in taken:
            whose = "the served model's own name (model_name)"
            if str(given) != taken[0]:
                whose = "the name of another served model"
            raise SystemExit(f"{kind}_model_name={given}: {whose}; pick another")
        return str(given)
    name = Path(str(cfg[f"{kind}_model"])).expanduser().resolve().name
    return f"{name}-{kind}" if name in taken else name


def reward_name_of(cfg: dict[str, Any], model_name: str) -> str | None:
    """The reward model's id (`side_model_name`); None without `reward_model`."""
    return side_model_name(cfg, "reward", (model_name,))


def load_lora_modules(engine: InferenceEngine, modules: dict[str, str]) -> None:
    """Load the startup adapters; a bad one is a SystemExit naming `lora_modules.<name>`
    and the file (the engine's message), before the server starts."""
    from astrai.inference.adapters import AdapterError

    for name, path in modules.items():
        try:
            info = engine.load_adapter(name, path)
        except (AdapterError, OSError) as err:
            raise SystemExit(f"lora_modules.{name}: {err}") from None
        logger.info("LoRA adapter %s (rank %d) from %s", name, info.rank, path)


def build_engine(cfg: dict[str, Any]) -> InferenceEngine:
    """Load the model and tokenizer from `cfg["model_path"]` and start the engine that the
    `engine` group (conf/engine/) describes, capped to `max_prompt_tokens` (the engine's
    one prompt check refuses longer prompts: a 400 naming the field), with LoRA adapter
    serving on when `lora_modules` is given (`engine_options`)."""
    from hydra.utils import instantiate

    from astrai.model import AutoModel
    from astrai.tokenizer import AutoTokenizer

    path = Path(str(cfg["model_path"])).expanduser()
    if cfg.get("backend"):
        os.environ["ASTR_BACKEND"] = str(cfg["backend"])
    device, dtype = device_and_dtype(cfg)
    model = AutoModel.from_pretrained(path, device=device, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    cap = cfg.get("max_prompt_tokens")
    extra = {} if cap is None else {"max_prompt_tokens": cap}
    return instantiate(engine_options(cfg))(model, tokenizer, **extra)


def build_reward(cfg: dict[str, Any], name: str | None = None) -> Any:
    """The reward model of `POST /v1/score` (`reward_model=<dir>`; None without one), on the
    engine's device and dtype, listed as `name` (None: its directory's name); a directory
    without a score head is a SystemExit naming the key (it loads before the engine, so
    this fails in seconds)."""
    if not cfg.get("reward_model"):
        return None
    from astrai.model import CheckpointError
    from astrai.serve.score import RewardScorer

    device, dtype = device_and_dtype(cfg)
    try:
        return RewardScorer.from_pretrained(
            str(cfg["reward_model"]), device=device, dtype=dtype, name=name
        )
    except CheckpointError as err:
        raise SystemExit(f"reward_model={cfg['reward_model']}: {err}") from None


def check_port(host: str, port: int) -> None:
    """Bind `host:port` once, as uvicorn will (SO_REUSEADDR), so that a busy port fails in
    a second, naming `port`, instead of after the model has loaded."""
    if not port:  # 0: the OS picks a free one
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            why = "is in use (another server?)" if err.errno == errno.EADDRINUSE else str(err)
            raise SystemExit(
                f"port={port}: cannot listen on {host}:{port}: {why}; "
                "pass another port=<n> (or stop the process holding it)"
            ) from None


def settings_of(cfg: dict[str, Any]) -> ServeSettings:
    """The `ServeSettings` that `cfg` describes; a bad value is a SystemExit naming it
    (checked before the model loads)."""
    from astrai.inference.params import check_max_prompt_tokens
    from astrai.serve.settings import ServeSettings

    cap = cfg.get("max_prompt_tokens")  # the engine's setting (build_engine), checked now
    try:
        check_max_prompt_tokens(cap)
    except ValueError:
        raise SystemExit(
            f"max_prompt_tokens: must be a positive int or null, got {cap!r}"
        ) from None
    try:
        settings = ServeSettings(
            model_name=cfg.get("model_name") or Path(str(cfg["model_path"])).resolve().name,
            api_key=cfg.get("api_key") or None,
            **{k: cfg[k] for k in _SETTINGS if k in cfg},
        )
    except ValueError as err:  # the message names the key
        raise SystemExit(str(err)) from None
    return settings


def check_address(cfg: dict[str, Any]) -> None:
    """`host` / `port` usable, and a non-loopback `host` only with `api_key` or
    `allow_unauthenticated=true` (`settings.check_listen`): else a SystemExit naming the key."""
    from astrai.serve.settings import check_listen

    try:
        check_listen(
            cfg.get("host"),
            cfg.get("port"),
            cfg.get("api_key") or None,
            cfg.get("allow_unauthenticated", False),
        )
    except ValueError as err:
        raise SystemExit(str(err)) from None


def startup_line(settings: ServeSettings, app: FastAPI, spec: SpeculativeConfig | None) -> str:
    """What the server runs with that `auto` settings leave open: the tool-call and
    reasoning parsers as resolved, and whether speculative decoding is on."""
    from astrai.serve.reasoning import resolve_reasoning_parser

    state = app.state.astrai
    tool = state.tool_parser.name if state.tool_parser is not None else "none"
    if settings.tool_parser == "auto":
        tool += " (auto)"
    reasoning = resolve_reasoning_parser(settings.reasoning_parser, state.engine.tokenizer)
    reasoning = reasoning or "none"
    if settings.reasoning_parser == "auto":
        reasoning += " (auto)"
    speculative = (
        "off"
        if spec is None
        else f"{spec.method}, up to {spec.num_speculative_tokens} tokens per step"
    )
    line = f"tool parser {tool}; reasoning parser {reasoning}; speculative decoding {speculative}"
    if settings.allow_runtime_lora:
        line += f"; runtime LoRA loading from {', '.join(settings.allowed_lora_roots)}"
    if settings.allow_weight_updates:
        line += "; weight updates on (the RL routes)"
    return line


def serve(cfg: dict[str, Any]) -> None:
    """Build the engine, run uvicorn until SIGINT/SIGTERM, then end streams and stop."""
    check_model_dir(str(cfg["model_path"]))  # the cheap checks first: fail fast with the fix
    if cfg.get("reward_model"):
        check_model_dir(str(cfg["reward_model"]), key="reward_model", generative=False)
    if cfg.get("embedding_model"):
        check_embedding_dir(str(cfg["embedding_model"]))
    settings = settings_of(cfg)
    check_address(cfg)
    reward_name = reward_name_of(cfg, settings.model_name)
    taken = (settings.model_name, reward_name or settings.model_name)
    embedding_name = side_model_name(cfg, "embedding", taken)
    modules = lora_modules_of(cfg)
    for name in modules:
        if name in (settings.model_name, reward_name, embedding_name):
            raise SystemExit(f"lora_modules.{name}: the name of a served model; pick another")
    check_port(str(cfg["host"]), int(cfg["port"]))
    spec = check_engine_options(cfg)
    import uvicorn

    from astrai.runtime import set_threads
    from astrai.serve import Server, create_app

    logging.getLogger().setLevel(str(cfg.get("log_level", "info")).upper())
    set_threads(cfg.get("threads"))
    reward = build_reward(cfg, reward_name)
    embedding = build_embedding(cfg, embedding_name, settings.pooling_type, *device_and_dtype(cfg))
    engine = build_engine(cfg)
    try:
        load_lora_modules(engine, modules)
    except SystemExit:
        engine.shutdown()
        raise
    app = create_app(engine, settings, reward=reward, embedding=embedding)
    config = uvicorn.Config(
        app,
        host=cfg["host"],
        port=int(cfg["port"]),
        log_level=str(cfg.get("log_level", "info")).lower(),
        access_log=False,  # we log one line per request ourselves
        timeout_graceful_shutdown=cfg.get("timeout_graceful_shutdown"),
    )
    logger.info(
        "serving %s (%s)%s%s on http://%s:%s%s; %s",
        settings.model_name,
        cfg["model_path"],
        f" with LoRA adapters {', '.join(modules)}" if modules else "",
        f", embeddings also from {embedding_name} ({cfg['embedding_model']})" if embedding else "",
        cfg["host"],
        cfg["port"],
        " (API key required)" if settings.api_key else "",
        startup_line(settings, app, spec),
    )
    try:
        Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a normal stop
        pass
    finally:
        engine.shutdown()
        logger.info("server stopped")
    from astrai.remote.weight_group import leave_parked_groups

    leave_parked_groups()  # a weight group left by a dead member must not hold the exit


def launch_replicas(cfg: dict[str, Any]) -> int:
    """`replicas=N` / `router=vllm` (astrai.serve.replicas): the checks that need no model,
    once, then the launcher with this command line's overrides; its exit code."""
    from hydra.core.hydra_config import HydraConfig

    from astrai.serve.replicas import launch

    check_model_dir(str(cfg["model_path"]))
    if cfg.get("embedding_model"):
        check_embedding_dir(str(cfg["embedding_model"]))
    settings_of(cfg)
    check_address(cfg)
    lora_modules_of(cfg)
    return launch(cfg, list(HydraConfig.get().overrides.task), check_port)


def _cli(cfg: Any) -> None:
    from omegaconf import OmegaConf

    from astrai.runtime import setup_logging

    options = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(options, dict)
    setup_logging(options.get("log_level"))  # quiet third parties; debug shows everything
    options = {k: v for k, v in options.items() if k != "hydra"}
    if options.get("replicas", 1) != 1 or options.get("router"):
        raise SystemExit(launch_replicas(options))
    serve(options)


def main() -> None:
    import hydra

    from astrai.cli_keys import command_line

    sys.argv[1:] = command_line("serve", sys.argv[1:])  # model.path= -> model_path=, prot= -> port?

    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="serve")(_cli)()


if __name__ == "__main__":
    sys.exit(main())

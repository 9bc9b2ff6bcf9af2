"""`python -m astrai.serve embedding_model=<dir>` (`astrai.serve.embedding_model`): a bad
directory fails at start-up naming the setting and the path, before any model loads; the
export gets its own id (`<name>-embedding` when its folder's name is taken); a directory
without a tokenizer embeds with the served model's; the whole command serves it."""

from __future__ import annotations

import shutil
from typing import ClassVar

import pytest
import torch
from serve_helpers import serve_config

from astrai.model import AutoModel, save_pretrained
from astrai.serve.embedding_model import build_embedding, check_embedding_dir


@pytest.fixture(scope="module")
def exports(model_dir, tmp_path_factory):
    """The served model in a folder named `export`, and an embedding export (other weights,
    no tokenizer) in another folder named `export`, as two `make train` runs write them."""
    root = tmp_path_factory.mktemp("exports")
    policy = shutil.copytree(model_dir, root / "policy" / "export")
    model = AutoModel.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    embedder = root / "embedder" / "export"
    save_pretrained(model, embedder)  # no tokenizer: the served model's is used
    return policy, embedder


def test_bad_directories_name_the_setting_and_path(tmp_path, model_dir):
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit, match=rf"^embedding_model={missing}: not a directory"):
        check_embedding_dir(str(missing))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as err:
        check_embedding_dir(str(tmp_path / "half"))
    assert str(err.value).startswith(f"embedding_model={tmp_path / 'half'}: ")
    assert "model.safetensors" in str(err.value) and "config.json" not in str(err.value)[:80]
    assert check_embedding_dir(str(model_dir)) == model_dir


def test_serve_refuses_a_bad_directory_before_loading(tmp_path, model_dir, monkeypatch, in_process):
    import astrai.serve.__main__ as main

    for heavy in ("build_engine", "build_reward", "build_embedding"):
        monkeypatch.setattr(main, heavy, lambda *a, **k: pytest.fail("a model was loaded"))
    cfg = serve_config([f"model_path={model_dir}", f"embedding_model={tmp_path}", "port=0"])
    with pytest.raises(SystemExit, match=rf"^embedding_model={tmp_path}: .*config\.json"):
        main.serve(cfg)
    names = ["embedding_model_name=m", "model_name=m", "port=0"]
    cfg = serve_config([f"model_path={model_dir}", f"embedding_model={model_dir}", *names])
    with pytest.raises(SystemExit, match=r"^embedding_model_name=m: the served model's own"):
        main.serve(cfg)


def test_without_a_tokenizer_the_served_one_embeds(exports, tokenizer):
    policy, embedder = exports
    cfg = {"model_path": str(policy), "embedding_model": str(embedder)}
    assert build_embedding({"embedding_model": None}, None, "last", "cpu", None) is None
    built = build_embedding(cfg, "e", "cls", "cpu", None)
    assert built.name == "e" and built.pooling_type == "cls"
    assert built.encode("import os") == tokenizer.encode("import os")
    ids = tokenizer.encode("import os")
    with torch.no_grad():
        hidden = built.model(torch.tensor([ids]), return_hidden=True)[0, 0]
    torch.testing.assert_close(built.embed([ids])[0], hidden / hidden.norm(), atol=1e-5, rtol=0)


class _Served:
    """Stands in for uvicorn's `Server` in `serve(cfg)`: asks the app what a client would,
    then returns as after Ctrl-C."""

    seen: ClassVar[dict] = {}

    def __init__(self, config) -> None:
        self.app = config.app

    def run(self) -> None:
        from fastapi.testclient import TestClient

        with TestClient(self.app) as client:
            self.seen["models"] = client.get("/v1/models").json()
            body = {"input": "import os", "encoding_format": "float"}
            self.seen["default"] = client.post("/v1/embeddings", json=body).json()
            served = client.post("/v1/embeddings", json={**body, "model": "export"})
            self.seen["served"] = served.json()


def test_serve_command_serves_the_export_under_its_own_id(exports, monkeypatch, in_process):
    """Both folders are named `export`: the embedding export is `export-embedding`, the
    default of `/v1/embeddings`; the served model still embeds under `export`."""
    import astrai.serve
    import astrai.serve.__main__ as main

    policy, embedder = exports
    monkeypatch.setattr(astrai.serve, "Server", _Served)
    cfg = serve_config(
        [
            f"model_path={policy}",
            f"embedding_model={embedder}",
            "pooling_type=mean",
            "port=0",
            "device=cpu",
            "engine=contiguous",
            "engine.max_batch_size=2",
            "engine.max_seq_len=128",
        ]
    )
    main.serve(cfg)
    seen = _Served.seen
    assert [m["id"] for m in seen["models"]["data"]] == ["export", "export-embedding"]
    assert seen["default"]["model"] == "export-embedding"
    assert seen["served"]["model"] == "export"
    assert seen["default"]["data"][0]["embedding"] != seen["served"]["data"][0]["embedding"]

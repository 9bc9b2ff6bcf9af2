"""The W&B mode a run uses: the config's, else `WANDB_MODE` (wandb's own `dryrun`/`run`
spellings read as their meaning), else online only with an API key; online without a key
is a preflight problem naming the fix, before any training."""

from __future__ import annotations

from pathlib import Path

import pytest

from astrai.train import preflight, wandb_run
from astrai.train.runner import compose


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


@pytest.mark.parametrize(
    ("env", "config", "expected"),
    [
        ("offline", None, "offline"),
        ("dryrun", None, "offline"),  # what Lightning's offline WandbLogger leaves behind
        ("run", None, "online"),
        ("DISABLED", None, "disabled"),
        ("online", "offline", "offline"),  # the config wins
        (None, None, "offline"),  # no key: offline
    ],
)
def test_mode_resolution(no_key, monkeypatch, env, config, expected) -> None:
    if env is not None:
        monkeypatch.setenv("WANDB_MODE", env)
    assert wandb_run.resolve_mode(config) == expected


def test_a_key_makes_the_default_online(no_key, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_run.resolve_mode(None) == "online"
    assert wandb_run.mode_problem(None) is None


def test_a_netrc_entry_is_a_key(no_key, monkeypatch, tmp_path) -> None:
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_run.has_api_key()


def test_an_unknown_mode_names_where_it_came_from(no_key, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match="WANDB_MODE: 'sometimes' is not online"):
        wandb_run.resolve_mode(None)
    with pytest.raises(ValueError, match=r"logger\.wandb\.mode: 'maybe'"):
        wandb_run.resolve_mode("maybe")


def test_online_without_a_key_is_refused_before_training(no_key, monkeypatch) -> None:
    cfg = compose(["logger=wandb", "logger.wandb.mode=online", "paths.output_dir=/tmp/x"])
    (problem,) = [p for p in preflight.problems(cfg) if "W&B" in p]
    assert problem.startswith("logger.wandb.mode=online: no W&B API key")
    assert "wandb login" in problem and "logger.wandb.mode=offline" in problem
    monkeypatch.setenv("WANDB_MODE", "online")
    cfg = compose(["logger=wandb", "paths.output_dir=/tmp/x"])
    assert any(p.startswith("WANDB_MODE=online: no W&B API key") for p in preflight.problems(cfg))
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert not [p for p in preflight.problems(cfg) if "W&B" in p or "WANDB" in p]
    cfg = compose(["paths.output_dir=/tmp/x"])  # no W&B logger: no W&B check
    monkeypatch.setenv("WANDB_MODE", "online")
    assert not [p for p in preflight.problems(cfg) if "W&B" in p]

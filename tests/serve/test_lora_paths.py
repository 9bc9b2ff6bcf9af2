"""`astrai.serve.lora_paths`: a client's `lora_path` resolves inside `allowed_lora_roots`,
and a path outside is refused alike whether it exists or not, without the file system
outside being looked at; adapter names are names, not paths."""

from __future__ import annotations

import os

import pytest

from astrai.serve.lora_paths import (
    MAX_LORA_NAME,
    AdapterRoots,
    LoRAPathNotAllowed,
    check_lora_name,
)


@pytest.fixture
def tree(tmp_path):
    """root/{a, b/inner}, a symlink root/out -> outside (exists), root/dangling -> a
    missing outside path, root/alias -> root/a, and root2 -> root (a symlinked root)."""
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "b" / "inner").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "out").symlink_to(outside, target_is_directory=True)
    (root / "dangling").symlink_to(tmp_path / "gone", target_is_directory=True)
    (root / "alias").symlink_to(root / "a", target_is_directory=True)
    (tmp_path / "root2").symlink_to(root, target_is_directory=True)
    return tmp_path


def refusal(roots: AdapterRoots, path: str) -> str:
    with pytest.raises(LoRAPathNotAllowed) as err:
        roots.resolve(path)
    return str(err.value).replace(repr(path), "<path>")


def test_paths_inside_a_root_resolve_to_their_real_directory(tree):
    root = tree / "root"
    roots = AdapterRoots.of([str(root)])
    assert roots.resolve(str(root / "a")) == str(root / "a")
    assert roots.resolve("a") == str(root / "a")  # relative: inside the first root
    assert roots.resolve("b/inner/../inner") == str(root / "b" / "inner")
    assert roots.resolve("alias") == str(root / "a")  # a symlink that stays inside
    # a root given through a symlink: both spellings are inside
    linked = AdapterRoots.of([str(tree / "root2")])
    assert linked.resolve(str(tree / "root2" / "a")) == str(root / "a")
    assert linked.resolve(str(root / "a")) == str(root / "a")


def test_outside_paths_get_one_answer_existing_or_not(tree):
    roots = AdapterRoots.of([str(tree / "root")])
    answers = {
        refusal(roots, path)
        for path in (
            "/etc",
            "/etc/passwd",
            "/no/such/directory",
            str(tree / "outside"),
            str(tree / "gone"),
            "../outside",
            "../gone",
            "a/../../outside",
            "out",  # a symlink inside the root to an existing outside directory
            "dangling",  # ... to a missing one
            "out/x",
            "a\0b",
        )
    }
    assert len(answers) == 1, answers
    (answer,) = answers
    assert "allowed_lora_roots" in answer and str(tree) not in answer


def test_nothing_outside_the_roots_is_looked_at(tree, monkeypatch):
    """A lexically outside path is refused before any system call touches it."""
    roots = AdapterRoots.of([str(tree / "root")])
    touched: list[str] = []
    for name in ("stat", "lstat", "readlink", "listdir", "scandir", "open"):
        real = getattr(os, name)

        def spy(path, *args, _real=real, **kwargs):
            touched.append(os.fspath(path))
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, spy)
    for path in ("/etc", str(tree / "outside" / "x"), "../../../etc/shadow"):
        with pytest.raises(LoRAPathNotAllowed):
            roots.resolve(path)
    assert touched == []


def test_roots_are_checked(tree):
    with pytest.raises(ValueError, match=r"^allowed_lora_roots: allow_runtime_lora=true needs"):
        AdapterRoots.of([])
    with pytest.raises(ValueError, match=r"^allowed_lora_roots: .*nope is not a directory"):
        AdapterRoots.of([str(tree / "nope")])
    assert AdapterRoots.of(str(tree / "root")).given == (str(tree / "root"),)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "non-empty"),
        (None, "non-empty"),
        ("../a", "not a path"),
        ("a/b", "not a path"),
        ("a\\b", "not a path"),
        ("x" * (MAX_LORA_NAME + 1), f"at most {MAX_LORA_NAME}"),
        ("tab\there", "unprintable"),
        ("nul\0", "unprintable"),
        ("policy", "live adapter"),
    ],
)
def test_bad_names_are_named(name, why):
    with pytest.raises(ValueError, match=rf"^lora_modules\.x: .*{why}"):
        check_lora_name(name, key="lora_modules.x")


def test_good_names_pass():
    for name in ("sql", "chat-v2", "Qwen3_lora.7", "x" * MAX_LORA_NAME, "café"):
        assert check_lora_name(name) == name

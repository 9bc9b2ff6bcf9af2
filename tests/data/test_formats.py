"""Record formats (astrai.data.formats): each named mapping and `columns:` prepares to the same
token ids and loss masks as the equivalent record in astrai's own schema; refusals name the
file, the row and the field."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from data_helpers import write_lines
from trl.data_utils import maybe_convert_to_chatml, maybe_extract_prompt

from astrai.data.encode import PrepareOptions
from astrai.data.formats import FORMATS, record_format
from astrai.data.prepare import prepare
from astrai.data.storage import DataError, H5Storage

_names = itertools.count()

CALL = {"name": "calc", "arguments": {"expr": "12 + 30"}}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "The answer is 42."},
    {"role": "user", "content": "And doubled?"},
    {"role": "assistant", "content": "The answer is 84."},
]
SHAREGPT = [
    {"from": "system", "value": "You are terse."},
    {"from": "human", "value": "What is 12 + 30?"},
    {"from": "function_call", "value": json.dumps(CALL)},
    {"from": "observation", "value": "42"},
    {"from": "gpt", "value": "The answer is 42."},
    {"from": "human", "value": "And doubled?"},
    {"from": "gpt", "value": "The answer is 84."},
]


def _arrays(tmp_path: Path, tok: Any, kind: str, records: list[Any], **kw: Any) -> list[dict]:
    """Every document's arrays (token keys; ``records`` JSON decoded) after ``prepare``."""
    name = f"in{next(_names)}"
    path = write_lines(tmp_path / f"{name}.jsonl", records)
    result = prepare(kind, path, tmp_path / "out", tok, progress=False, **kw)
    assert result.documents == len(records) and result.num_skipped == 0
    with H5Storage(tmp_path / "out" / f"{name}.h5") as st:
        return [
            {
                key: json.loads(st.get(key, i)) if key == "records" else st.get(key, i).tolist()
                for key in [*st.keys, *st.string_keys]
            }
            for i in range(len(st))
        ]


def _tokens(docs: list[dict]) -> list[dict]:
    return [{k: v for k, v in doc.items() if k != "records"} for doc in docs]


# ----------------------------------------------------------------------------- sharegpt


def test_sharegpt_sft_matches_messages(tmp_path: Path, tok) -> None:
    reference = _arrays(
        tmp_path,
        tok,
        "sft",
        [{"messages": CHAT, "tools": TOOLS}, {"messages": CHAT[1:2] + CHAT[4:5]}],
    )
    mapped = _arrays(
        tmp_path,
        tok,
        "sft",
        [
            {"conversations": SHAREGPT, "tools": json.dumps(TOOLS)},  # LLaMA-Factory: JSON text
            {"conversations": [SHAREGPT[1], SHAREGPT[4]], "tools": ""},  # no tools
        ],
        format="sharegpt",
    )
    assert mapped == reference
    assert any(reference[0]["loss_mask"]) and 0 in reference[0]["loss_mask"]
    # the system prompt as a field, Axolotl's role aliases (user/assistant/tool)
    renamed = [
        {
            "from": {"human": "user", "gpt": "assistant", "observation": "tool"}.get(
                t["from"], t["from"]
            ),
            "value": t["value"],
        }
        for t in SHAREGPT[1:]
    ]
    by_field = _arrays(
        tmp_path,
        tok,
        "sft",
        [{"conversations": renamed, "system": "You are terse.", "tools": TOOLS}],
        format="sharegpt",
    )
    assert by_field == reference[:1]
    # LLaMA-Factory's field and tag names, renamed
    tags = {"human": "USER", "gpt": "BOT", "function_call": "CALL", "observation": "TOOL"}
    custom = [{"speaker": tags[t["from"]], "text": t["value"]} for t in SHAREGPT[1:]]
    columns = {
        "messages": "dialog",
        "system": "sys",
        "role_tag": "speaker",
        "content_tag": "text",
        "user_tag": "USER",
        "assistant_tag": "BOT",
        "function_tag": "CALL",
        "observation_tag": "TOOL",
    }
    fields = _arrays(
        tmp_path,
        tok,
        "sft",
        [{"dialog": custom, "sys": "You are terse.", "tools": TOOLS}],
        format="sharegpt",
        columns=columns,
    )
    assert fields == reference[:1]


def test_sharegpt_with_role_names_reads_as_trls_chatml_conversion() -> None:
    """TRL's maybe_convert_to_chatml renames from/value (not the tags): with Axolotl's role
    aliases the two agree."""
    turns = [
        {"from": "system", "value": "Be brief."},
        {"from": "user", "value": "Hi"},
        {"from": "assistant", "value": "Hello"},
        {"from": "tool", "value": "42"},
    ]
    expected = maybe_convert_to_chatml({"conversations": json.loads(json.dumps(turns))})
    got = record_format("sharegpt", None, "sft").map({"conversations": turns}, "x.jsonl:1")
    assert got["messages"] == expected["messages"]


def test_sharegpt_preference_prompt_and_unpaired(tmp_path: Path, tok) -> None:
    question = {"from": "human", "value": "What is 2 + 2?"}
    good, bad = {"from": "gpt", "value": "4"}, {"from": "gpt", "value": "5"}
    ref = _arrays(
        tmp_path,
        tok,
        "preference",
        [
            {
                "prompt": [{"role": "user", "content": "What is 2 + 2?"}],
                "chosen": "4",
                "rejected": "5",
            }
        ],
    )
    got = _arrays(
        tmp_path,
        tok,
        "preference",
        [{"conversations": [question], "chosen": good, "rejected": bad}],  # LLaMA-Factory ranking
        format="sharegpt",
    )
    assert got == ref
    prompt_ref = _arrays(tmp_path, tok, "prompt", [{"prompt": "What is 2 + 2?", "answer": "4"}])
    prompt_got = _arrays(
        tmp_path,
        tok,
        "prompt",
        [{"conversations": [question, good], "answer": "4"}],  # the trailing answer is dropped
        format="sharegpt",
        required_fields=["answer"],
    )
    assert _tokens(prompt_got) == _tokens(prompt_ref)
    assert prompt_got[0]["records"]["answer"] == "4"  # the reward's fields stay in the record
    unpaired_ref = _arrays(
        tmp_path, tok, "unpaired", [{"prompt": "What is 2 + 2?", "completion": "5", "label": False}]
    )
    unpaired_got = _arrays(
        tmp_path,
        tok,
        "unpaired",
        [{"conversations": [question, bad], "kto_tag": False}],
        format="sharegpt",
        columns={"label": "kto_tag"},
    )
    assert unpaired_got == unpaired_ref


# ----------------------------------------------------------------------------- trl


def test_trl_sft_forms_match_messages(tmp_path: Path, tok) -> None:
    user, answer = CHAT[1], CHAT[4]
    ref = _arrays(tmp_path, tok, "sft", [{"messages": [user, answer]}] * 3)
    got = _arrays(
        tmp_path,
        tok,
        "sft",
        [
            {"messages": [user, answer]},  # conversational language modeling
            {"prompt": user["content"], "completion": answer["content"]},  # standard
            {"prompt": [user], "completion": [answer]},  # conversational prompt-completion
        ],
        format="trl",
    )
    assert got == ref
    renamed = _arrays(
        tmp_path,
        tok,
        "sft",
        [{"question": user["content"], "answer": answer["content"]}],
        format="trl",
        columns={"prompt": "question", "completion": "answer"},
    )
    assert renamed == ref[:1]


PREFERENCES = [
    {  # conversational, implicit prompt
        "chosen": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is blue."},
        ],
        "rejected": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "It is green."},
        ],
    },
    {"chosen": "The sky is blue.", "rejected": "The sky is green."},  # standard, implicit
    {  # a standard prompt beside conversational completions: extracted (TRL's rule)
        "prompt": "What color is the sky?",
        "chosen": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "Blue."},
        ],
        "rejected": [
            {"role": "user", "content": "What color is the sky?"},
            {"role": "assistant", "content": "Green."},
        ],
    },
    {"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."},  # explicit: as it is
]


def test_trl_preference_extracts_the_prompt_as_trl_does(tmp_path: Path, tok) -> None:
    fmt = record_format("trl", None, "preference")
    for example in PREFERENCES:
        expected = maybe_extract_prompt(json.loads(json.dumps(example)))
        mapped = fmt.map(example, "x.jsonl:1")
        assert {k: mapped[k] for k in ("prompt", "chosen", "rejected")} == {
            k: expected[k] for k in ("prompt", "chosen", "rejected")
        }
    explicit = [maybe_extract_prompt(json.loads(json.dumps(e))) for e in PREFERENCES]
    ref = _arrays(tmp_path, tok, "preference", explicit)
    got = _arrays(tmp_path, tok, "preference", PREFERENCES, format="trl")
    assert got == ref


def test_trl_prompt_and_unpaired_are_astrai_fields(tmp_path: Path, tok) -> None:
    rows = [{"prompt": [{"role": "user", "content": "Hi?"}], "completion": "Hello.", "label": True}]
    assert _arrays(tmp_path, tok, "unpaired", rows, format="trl") == _arrays(
        tmp_path, tok, "unpaired", rows
    )
    prompts = [{"prompt": "Hi?", "answer": "Hello."}]
    assert _arrays(tmp_path, tok, "prompt", prompts, format="trl") == _arrays(
        tmp_path, tok, "prompt", prompts
    )


# ----------------------------------------------------------------------------- alpaca


def test_alpaca_matches_messages_for_every_kind(tmp_path: Path, tok) -> None:
    base = {"instruction": "Add the numbers.", "input": "12 + 30", "system": "You are terse."}
    history = [["What is 1 + 1?", "2"]]
    prompt = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Add the numbers.\n12 + 30"},  # instruction "\n" input
    ]
    bare = [{"role": "user", "content": "Say hi."}]
    ref = _arrays(
        tmp_path,
        tok,
        "sft",
        [
            {"messages": [*prompt, {"role": "assistant", "content": "42"}]},
            {"messages": [*bare, {"role": "assistant", "content": "hi"}]},
        ],
    )
    got = _arrays(
        tmp_path,
        tok,
        "sft",
        [
            {**base, "history": history, "output": "42"},
            {"instruction": "Say hi.", "input": "", "output": "hi"},  # empty input: no newline
        ],
        format="alpaca",
    )
    assert got == ref
    pref = [{**base, "history": history, "chosen": "42", "rejected": "41"}]
    assert _arrays(tmp_path, tok, "preference", pref, format="alpaca") == _arrays(
        tmp_path, tok, "preference", [{"prompt": prompt, "chosen": "42", "rejected": "41"}]
    )
    unpaired = [{**base, "history": history, "output": "41", "kto_tag": False}]
    assert _arrays(
        tmp_path, tok, "unpaired", unpaired, format="alpaca", columns={"label": "kto_tag"}
    ) == _arrays(
        tmp_path, tok, "unpaired", [{"prompt": prompt, "completion": "41", "label": False}]
    )
    prompts = _arrays(
        tmp_path, tok, "prompt", [{**base, "history": history, "answer": "42"}], format="alpaca"
    )
    assert _tokens(prompts) == _tokens(_arrays(tmp_path, tok, "prompt", [{"prompt": prompt}]))
    assert prompts[0]["records"]["answer"] == "42"
    renamed = _arrays(
        tmp_path,
        tok,
        "sft",
        [{"q": "Say hi.", "a": "hi"}],
        format="alpaca",
        columns={"instruction": "q", "output": "a"},
    )
    assert renamed == ref[1:]


# ----------------------------------------------------------------------------- columns


def test_columns_rename_astrai_fields_for_every_kind(tmp_path: Path, tok) -> None:
    cases = {
        "sft": ({"messages": CHAT[1:2] + CHAT[4:5]}, {"messages": "conv"}),
        "preference": (
            {"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."},
            {"prompt": "q", "chosen": "good", "rejected": "bad"},
        ),
        "prompt": ({"prompt": "Sky?", "tools": TOOLS}, {"prompt": "q", "tools": "fns"}),
        "unpaired": (
            {"prompt": "Sky?", "completion": "Blue.", "label": True},
            {"prompt": "q", "completion": "a", "label": "ok"},
        ),
    }
    for kind, (record, columns) in cases.items():
        renamed = {columns[k]: v for k, v in record.items()}
        got = _arrays(tmp_path, tok, kind, [renamed], columns=columns)
        assert _tokens(got) == _tokens(_arrays(tmp_path, tok, kind, [record])), kind


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kind", "record", "options", "message"),
    [
        (
            "sft",
            {"messages": CHAT},
            {"format": "sharegpt"},
            r"in\d+\.jsonl:2: record is missing required field 'conversations'",
        ),
        (
            "sft",
            {"conversations": SHAREGPT},
            {"columns": {"messages": "conv"}},
            r"\.jsonl:2: record is missing required field 'conv' \(format=openai, kind=sft, columns: messages -> conv",
        ),
        (
            "sft",
            {"instruction": "Say hi."},
            {"format": "alpaca"},
            r"\.jsonl:2: record is missing required field 'output' \(format=alpaca",
        ),
        (
            "sft",
            {"conversations": [{"from": "bot", "value": "x"}]},
            {"format": "sharegpt"},
            r"\.jsonl:2: conversations\[0\]\.from is 'bot', not one of",
        ),
        (
            "sft",
            {"conversations": [{"from": "human"}]},
            {"format": "sharegpt"},
            r"\.jsonl:2: conversations\[0\] must be a turn with fields 'from' and 'value'",
        ),
        (
            "sft",
            {"conversations": [{"from": "function_call", "value": "calc(1)"}]},
            {"format": "sharegpt"},
            r"\.jsonl:2: conversations\[0\] is a function call but not JSON",
        ),
        (
            "sft",
            {"text": "plain"},
            {"format": "trl"},
            r"\.jsonl:2: a 'text' record is TRL's language-modeling form",
        ),
        (
            "sft",
            {"question": "Hi?"},
            {"format": "trl"},
            r"\.jsonl:2: record has neither field 'messages' nor 'prompt' and 'completion'",
        ),
        (
            "sft",
            {"prompt": "Hi?"},
            {"format": "trl"},
            r"\.jsonl:2: record is missing required field 'completion'",
        ),
        (
            "unpaired",
            {"conversations": [SHAREGPT[1]], "label": True},
            {"format": "sharegpt"},
            r"\.jsonl:2: conversations\[-1\] must be an assistant turn",
        ),
        (
            "preference",
            {"chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
            {"format": "trl"},
            r"\.jsonl:2: field 'chosen' and 'rejected' must both be strings",
        ),
        (
            "sft",
            {"instruction": "x", "output": "y", "history": ["x"]},
            {"format": "alpaca"},
            r"\.jsonl:2: field 'history' must be a list of \[instruction, response\] pairs",
        ),
    ],
)
def test_a_record_that_fits_no_mapping_names_file_row_and_field(
    tmp_path: Path, tok, kind: str, record: dict, options: dict, message: str
) -> None:
    good = _good(kind, options)
    path = write_lines(tmp_path / f"in{next(_names)}.jsonl", [good, record])
    with pytest.raises(DataError, match=message):
        prepare(kind, path, tmp_path / "out", tok, progress=False, **options)
    # skip_bad_lines counts it instead
    result = prepare(
        kind, path, tmp_path / "out", tok, progress=False, skip_bad_lines=True, **options
    )
    assert (result.documents, result.skipped) == (1, {"bad_record": 1})


def _good(kind: str, options: dict) -> dict:
    """A record of ``kind`` in ``options``'s layout that prepares."""
    fmt, columns = options.get("format"), options.get("columns") or {}
    if fmt == "sharegpt":
        if kind == "unpaired":
            return {"conversations": [SHAREGPT[1], SHAREGPT[4]], "label": True}
        return {"conversations": [SHAREGPT[1], SHAREGPT[4]]}
    if fmt == "alpaca":
        return {"instruction": "Say hi.", "output": "hi"}
    if kind == "preference":
        return {"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."}
    return {columns.get("messages", "messages"): CHAT[1:2] + CHAT[4:5]}


def test_bad_options_are_refused_before_reading(tmp_path: Path, tok) -> None:
    missing = tmp_path / "nothing.jsonl"  # never read: the options fail first
    with pytest.raises(
        DataError, match=r"format must be one of \('openai', 'sharegpt', 'trl', 'alpaca'\)"
    ):
        prepare("sft", missing, tmp_path / "out", tok, format="chatml")
    with pytest.raises(
        DataError,
        match=r"columns: 'conv' is not a field of format=openai for kind=sft; known: messages, tools",
    ):
        prepare("sft", missing, tmp_path / "out", tok, columns={"conv": "messages"})
    with pytest.raises(DataError, match=r"columns\.messages: must be a field name"):
        prepare("sft", missing, tmp_path / "out", tok, columns={"messages": ""})
    with pytest.raises(DataError, match="format=sharegpt has chat turns; kind=pretrain reads text"):
        prepare("pretrain", missing, tmp_path / "out", tok, format="sharegpt")
    with pytest.raises(DataError, match="name it with text_field"):
        prepare("pretrain", missing, tmp_path / "out", tok, columns={"text": "body"})
    assert set(FORMATS) == {"openai", "sharegpt", "trl", "alpaca"}


def test_format_and_columns_enter_the_signature_only_when_set(tmp_path: Path, tok) -> None:
    plain = PrepareOptions.parse("sft")
    before = {  # the options an output's signature held before format/columns existed
        "kind", "max_length", "pack", "window_size", "truncate", "skip_bad_lines",
        "text_field", "add_bos", "add_eos", "required_fields",
    }  # fmt: skip
    assert set(plain.signature()) == before
    assert PrepareOptions.parse("sft", format="openai").signature() == plain.signature()
    assert PrepareOptions.parse("sft", format="trl").signature()["format"] == "trl"
    # same file, another format: "prepared from other input or options"
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": CHAT[1:2] + CHAT[4:5]}])
    prepare("sft", path, tmp_path / "out", tok, progress=False)
    assert prepare(
        "sft", path, tmp_path / "out", tok, progress=False, format="openai"
    ).shards_reused
    with pytest.raises(DataError, match="prepared from other input or options"):
        prepare("sft", path, tmp_path / "out", tok, progress=False, format="trl")


def test_a_data_config_prepare_block_takes_format_and_columns(tmp_path: Path, tok_dir) -> None:
    from omegaconf import OmegaConf

    from astrai.data import AstraiDataModule

    turns = [{"speaker": "human", "text": "What is 2 + 2?"}, {"speaker": "gpt", "text": "4"}]
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    mapped = {
        "source": str(write_lines(tmp_path / "chats.jsonl", [{"dialog": turns}])),
        "prepare": {
            "format": "sharegpt",
            "columns": {"messages": "dialog", "role_tag": "speaker", "content_tag": "text"},
        },
    }
    plain = {"source": str(write_lines(tmp_path / "plain.jsonl", [{"messages": messages}]))}
    samples = []
    for spec in (mapped, {**plain, "prepare": {}}):
        spec = OmegaConf.create({"_target_": "astrai.data.SFTDataset", **spec})  # as from Hydra
        dm = AstraiDataModule(train=spec, batch_size=1)
        dm.connect(tok_dir, tmp_path / "cache")
        dm.setup("fit")
        samples.append({k: v.tolist() for k, v in dm.datasets["train"][0].items()})
    assert samples[0] == samples[1]


def test_the_prepare_config_takes_format_and_columns(tmp_path: Path, tok, tok_dir) -> None:
    """conf/prepare.yaml has both keys, and a command line's values reach prepare()."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from astrai.data.prepare import CONF_DIR

    turns = [{"speaker": "human", "text": "What is 2 + 2?"}, {"speaker": "gpt", "text": "4"}]
    path = write_lines(tmp_path / "chats.jsonl", [{"dialog": turns}])
    overrides = [
        "kind=sft",
        f"input={path}",
        f"output={tmp_path / 'cli'}",
        f"tokenizer_path={tok_dir}",
        "format=sharegpt",
        "columns={messages: dialog, role_tag: speaker}",
        "+columns.content_tag=text",
        "progress=false",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        options = OmegaConf.to_container(compose("prepare", overrides=overrides))
    options["tokenizer"] = options.pop("tokenizer_path")
    prepare(**options)
    with H5Storage(tmp_path / "cli" / "chats.h5") as st:
        got = {
            "input_ids": st.get("input_ids", 0).tolist(),
            "loss_mask": st.get("loss_mask", 0).tolist(),
        }
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert [got] == _arrays(tmp_path, tok, "sft", [{"messages": messages}])

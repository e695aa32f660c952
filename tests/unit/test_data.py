"""evoesap.data: loading, selection, chat-template answer masks, scored positions, batches."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from evoesap import data
from evoesap.data import FieldMap, Sample
from evoesap.errors import ConfigError, DataError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>", "<think>", "</think>"]
CORPUS = [
    "The user asks a question and the assistant answers it with care.",
    "user assistant system hello world what is two plus two four five",
    "def add(a, b): return a + b  # code and maths 12345 = + - * /",
]


def _tokenizer(template: str | None = CHATML, specials: Sequence[str] = SPECIALS, **named: str) -> PreTrainedTokenizerFast:
    """A real byte-level BPE tokenizer with the given special tokens (ChatML's by default), built offline."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", **named)
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return _tokenizer()


CHAT = Sample(
    id=3,
    messages=(
        ("system", "Be brief."),
        ("user", "assistant? what is two plus two"),
        ("assistant", "four"),
        ("user", "and the assistant"),
        ("assistant", "assistant answers five"),
    ),
)


def _answer_text(tokenizer, ts) -> list[str]:
    """Decoded runs of consecutive answer tokens."""
    runs, cur = [], []
    for t, a in zip(ts.input_ids, ts.answer_mask):
        if a:
            cur.append(t)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(tokenizer.decode(cur))
    return runs


def test_chat_template_answer_mask_marks_assistant_content_and_end_of_turn(tok):
    (ts,) = data.tokenize_samples([CHAT], tok, max_length=512)
    # independent: the template's own token ids, and each assistant content as its own tokens
    assert ts.input_ids == tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in CHAT.messages], tokenize=True, return_dict=False
    )
    assert _answer_text(tok, ts) == ["four<|im_end|>", "assistant answers five<|im_end|>"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for i, a in enumerate(ts.answer_mask):  # every run ends on an end-of-turn token
        if a and (i + 1 == len(ts.answer_mask) or not ts.answer_mask[i + 1]):
            assert ts.input_ids[i] == im_end
    assert sum(ts.answer_mask) == len(tok("four")["input_ids"]) + len(tok("assistant answers five")["input_ids"]) + 2


# Chat templates shaped like those of the eight families (the role and end-of-turn layout, with this
# test's small vocabulary): template, special tokens, named tokens, the scored runs (assistant content and
# end of turn, decoded) and the text each run's first scored position sits on (the header's last token).
BOS_DS, EOS_DS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
TEMPLATE_SHAPES = {
    "chatml (qwen2_moe, qwen3_moe)": (
        CHATML,
        SPECIALS,
        {},
        ["four<|im_end|>", "assistant answers five<|im_end|>"],
        "\n",
    ),
    "tulu (olmoe)": (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|user|>\n' + m['content'] + '\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\n' + m['content'] + eos_token }}"
        "{% if not loop.last %}{{ '\n' }}{% endif %}{% endif %}"
        "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}",
        ["<|user|>", "<|assistant|>", "<|endoftext|>", "<pad>"],
        {"eos_token": "<|endoftext|>"},
        ["four<|endoftext|>", "assistant answers five<|endoftext|>"],
        "\n",
    ),
    "deepseek_v3": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
        "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}",
        [BOS_DS, EOS_DS, "<｜User｜>", "<｜Assistant｜>", "<pad>"],
        {"bos_token": BOS_DS, "eos_token": EOS_DS},
        ["four" + EOS_DS, "assistant answers five" + EOS_DS],
        "<｜Assistant｜>",
    ),
    "deepseek_v2, ernie4_5_moe (plain role names)": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\n\n' }}"
        "{% elif m['role'] == 'assistant' %}{{ 'Assistant: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}",
        [BOS_DS, EOS_DS, "<pad>"],
        {"bos_token": BOS_DS, "eos_token": EOS_DS},
        [" four" + EOS_DS, " assistant answers five" + EOS_DS],
        ":",  # the space merges into the first word
    ),
    "mixtral [INST]": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}",
        ["<s>", "</s>", "<pad>"],
        {"bos_token": "<s>", "eos_token": "</s>"},
        ["four</s>", "assistant answers five</s>"],
        "]",
    ),
    "harmony (gpt_oss)": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ '<|start|>assistant<|channel|>final<|message|>' + m['content'] }}"
        "{% if loop.last and not add_generation_prompt %}{{ '<|return|>' }}{% else %}{{ '<|end|>' }}{% endif %}"
        "{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}",
        ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<pad>"],
        {"eos_token": "<|return|>"},
        ["four<|end|>", "assistant answers five<|return|>"],
        "<|message|>",
    ),
}
TWO_TURNS = Sample(
    id=0,
    messages=(
        ("user", "what is two plus two"),
        ("assistant", "four"),
        ("user", "and the assistant"),
        ("assistant", "assistant answers five"),
    ),
)


@pytest.mark.parametrize("shape", sorted(TEMPLATE_SHAPES))
def test_scored_positions_are_each_turns_content_and_end_for_every_template_shape(shape):
    template, specials, named, runs, header_end = TEMPLATE_SHAPES[shape]
    tok = _tokenizer(template, specials, **named)
    (ts,) = data.tokenize_samples([TWO_TURNS], tok, max_length=512)
    assert ts.input_ids == tok.apply_chat_template(
        [{"role": r, "content": c} for r, c in TWO_TURNS.messages], tokenize=True, return_dict=False
    )
    assert _answer_text(tok, ts) == runs  # exactly content + end of turn: no header, no separator after
    # Scored position t predicts token t+1: each run of scored positions starts on the header's last
    # token and ends on the last content token (which predicts the end of turn).
    scored = [t for t, s in enumerate(data.scored_mask(ts.answer_mask)) if s]
    starts = [t for t in scored if t - 1 not in scored]
    ends = [t for t in scored if t + 1 not in scored]
    assert len(starts) == len(ends) == len(runs)
    for start, end, run in zip(starts, ends, runs):
        assert tok.decode(ts.input_ids[start : start + 1]) == header_end
        assert tok.decode(ts.input_ids[start + 1 : end + 2]) == run
        assert ts.input_ids[end + 1] in tok.all_special_ids + [tok.convert_tokens_to_ids(s) for s in specials]


def test_enable_thinking_reaches_the_template():
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    tok = _tokenizer(template)
    sample = Sample(0, (("user", "hello"), ("assistant", "world")))
    (off,) = data.tokenize_samples([sample], tok, max_length=64, enable_thinking=False)
    (on,) = data.tokenize_samples([sample], tok, max_length=64, enable_thinking=True)
    think = tok.convert_tokens_to_ids("<think>")
    assert think in off.input_ids and think not in on.input_ids
    assert _answer_text(tok, off) == _answer_text(tok, on) == ["world<|im_end|>"]


def test_plain_fallback_without_chat_template():
    tok = _tokenizer(template=None)
    (ts,) = data.tokenize_samples([Sample(0, (("user", "two plus two"), ("assistant", "four")))], tok, max_length=64)
    assert tok.decode(ts.input_ids) == "User: two plus two\nAssistant: four\n"
    # byte-level BPE merges the separating space into the token; the newline ends the turn
    assert _answer_text(tok, ts) == [" four\n"]


def test_text_samples_are_all_answer(tok):
    (ts,) = data.tokenize_samples([Sample(7, text="hello world")], tok, max_length=64)
    assert ts.sample_id == 7 and all(ts.answer_mask) and tok.decode(ts.input_ids) == "hello world"


def test_truncation_and_no_answer_left_is_an_error(tok):
    full = data.tokenize_samples([CHAT], tok, max_length=512)[0]
    first_answer = full.answer_mask.index(True)
    (ts,) = data.tokenize_samples([CHAT], tok, max_length=first_answer + 1)
    assert ts.input_ids == full.input_ids[: first_answer + 1] and ts.answer_mask == full.answer_mask[: first_answer + 1]
    with pytest.raises(DataError, match=f"sample 3 has no answer token after truncation to {first_answer}"):
        data.tokenize_samples([CHAT], tok, max_length=first_answer)


def test_packing_concatenates_and_cuts(tok):
    samples = [Sample(i, text=t) for i, t in enumerate(CORPUS)]
    single = data.tokenize_samples(samples, tok, max_length=512)
    packed = data.tokenize_samples(samples, tok, max_length=10, pack=True)
    stream = [t for s in single for t in s.input_ids]
    assert [s.sample_id for s in packed] == list(range(len(packed)))
    assert all(len(s.input_ids) == 10 for s in packed[:-1]) and 0 < len(packed[-1].input_ids) <= 10
    assert [t for s in packed for t in s.input_ids] == stream


def test_scored_mask_shifts_by_one():
    assert data.scored_mask([False, False, True, True, False]) == [False, True, True, False, False]
    assert data.scored_mask([]) == []
    t = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert data.scored_mask(t).tolist() == [[True, True, False, False], [True, True, True, False]]


def test_batches_pad_right(tok):
    a = data.TokenizedSample(1, [5, 6, 7], [False, True, True])
    b = data.TokenizedSample(2, [8], [True])
    c = data.TokenizedSample(4, [9, 9], [False, True])
    out = list(data.batches([a, b, c], batch_size=2, pad_id=0))
    assert [x.sample_ids for x in out] == [[1, 2], [4]]
    assert out[0].input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out[0].attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out[0].answer_mask.tolist() == [[False, True, True], [True, False, False]]
    assert out[0].input_ids.dtype == out[0].attention_mask.dtype == torch.long and out[0].answer_mask.dtype == torch.bool


ROWS = [
    {
        "prompt": f"question {i}",
        "answer": f"answer {i}",
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        "text": f"doc {i}",
    }
    for i in range(20)
]


@pytest.mark.parametrize("ext", ["jsonl", "json", "parquet", "csv"])
def test_load_each_format(tmp_path, ext):
    path = tmp_path / f"d.{ext}"
    df = pd.DataFrame(ROWS)
    if ext == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in ROWS))
    elif ext == "json":
        path.write_text(json.dumps(ROWS))
    elif ext == "parquet":
        df.to_parquet(path)
    else:
        df.assign(messages=[json.dumps(m) for m in df.messages]).to_csv(path, index=False)
    chats = data.load_samples(str(path))
    assert [s.id for s in chats] == list(range(20))
    assert chats[4].messages == (("user", "q4"), ("assistant", "a4"))
    pairs = data.load_samples(f"file://{path}", fields=FieldMap(prompt="prompt", response="answer"))
    assert pairs[2].messages == (("user", "question 2"), ("assistant", "answer 2"))
    texts = data.load_samples(str(path), fields=FieldMap(text="text"))
    assert texts[5].text == "doc 5" and texts[5].messages == ()


def test_selection_is_deterministic_and_nested(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    ids = lambda n, seed: [s.id for s in data.load_samples(str(path), n=n, seed=seed)]  # noqa: E731
    assert ids(8, 1) == ids(8, 1)
    assert ids(8, 1) != ids(8, 2)
    assert ids(5, 1) == ids(8, 1)[:5]
    assert len(set(ids(20, 3))) == 20
    sample = data.load_samples(str(path), n=3, seed=1)
    assert all(s.messages[0][1] == f"q{s.id}" for s in sample)


def test_missing_field_names_field_and_available(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    with pytest.raises(DataError, match=r"field 'conversation' not found .* available fields: prompt, answer, messages, text"):
        data.load_samples(str(path), fields=FieldMap(messages="conversation"))
    with pytest.raises(DataError, match="'response'"):
        data.load_samples(str(path), fields=FieldMap(prompt="prompt", response="response"))


def test_empty_answer_is_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"p": "hi", "r": "ok"}, {"p": "hi", "r": "  "}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError, match="row 1: empty answer"):
        data.load_samples(str(path), fields=FieldMap(prompt="p", response="r"))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    with pytest.raises(DataError, match="row 0: empty answer"):
        data.load_samples(str(path))


def test_bad_requests_are_clear(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS))
    with pytest.raises(DataError, match="asked for 50 samples but .* has only 20"):
        data.load_samples(str(path), n=50)
    with pytest.raises(DataError, match="does not exist"):
        data.load_samples(str(tmp_path / "nope.parquet"))
    with pytest.raises(ConfigError, match="prompt and response"):
        FieldMap(prompt="p")


@pytest.mark.parametrize(("source", "name", "revision"), [("org/chat", "org/chat", None), ("org/chat@v2", "org/chat", "v2")])
def test_hub_names_go_to_datasets_at_their_pinned_revision(source, name, revision, monkeypatch):
    import datasets

    seen = {}

    def fake_load(name, subset, split, revision):
        seen.update(name=name, subset=subset, split=split, revision=revision)
        return datasets.Dataset.from_list(ROWS[:4])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    out = data.load_samples(source, split="test", subset="en", n=2, seed=0, fields=FieldMap(text="text"))
    assert seen == {"name": name, "subset": "en", "split": "test", "revision": revision}
    assert [s.text for s in out] == [f"doc {s.id}" for s in out]


def test_check_vocab_refuses_mismatch(tok):
    class Model:
        def __init__(self, n: int) -> None:
            self.emb = torch.nn.Embedding(n, 4)

        def get_input_embeddings(self) -> torch.nn.Embedding:
            return self.emb

    data.check_vocab(tok, Model(len(tok)))
    data.check_vocab(tok, Model(len(tok) + 64))  # padded embeddings are fine
    with pytest.raises(DataError, match=f"tokenizer has {len(tok)} tokens but the model's embedding has 100"):
        data.check_vocab(tok, Model(100))


DEEP = "[" * 100_000 + "]" * 100_000  # past the JSON parser's recursion limit


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("deep.jsonl", '{"text": "a"}\n{"text": ' + DEEP + "}\n", "line 2: JSON nested too deeply to read"),
        ("deep.json", '{"train": ' + DEEP + "}", "deep.json: JSON nested too deeply to read"),
        ("chat.jsonl", json.dumps({"messages": DEEP}) + "\n", "field 'messages' is a string but not a JSON list"),
    ],
)
def test_json_nested_too_deeply_is_a_data_error_naming_the_file(tmp_path, name, text, problem):
    path = tmp_path / name
    path.write_text(text)
    fields = FieldMap() if name.startswith("chat") else FieldMap(text="text")
    with pytest.raises(DataError, match=problem):
        data.load_samples(str(path), fields=fields)

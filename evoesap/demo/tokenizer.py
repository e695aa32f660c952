"""A character-level fast tokenizer with a chat template, built offline with `tokenizers`.

A real chat template (without `{% generation %}` markers, like most hub models') makes the demo exercise
the same chat-template code path as a hub model; characters keep the vocabulary ~100 tokens.
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

USER, ASSISTANT, SYSTEM, END, PAD, UNK = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|pad|>", "<|unk|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, END, UNK, USER, ASSISTANT, SYSTEM)

# Each turn is `<|role|>content<|end|>`; the assistant's content and its `<|end|>` are what the model
# learns to produce (`evoesap.data`'s answer mask).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def build_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerFast:
    """Characters of printable ASCII plus the chat special tokens; `<|end|>` is both end-of-turn and eos."""
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII, space, newline
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    # BPE without merges is exactly a character tokenizer; Fuse joins characters back without spaces.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=END,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tokenizer(tok: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Write the tokenizer files next to the model so `AutoTokenizer.from_pretrained(dir)` works."""
    tok.save_pretrained(str(out_dir))

"""A GGUF's tokenizer as Hugging Face files: tokenizer.json, tokenizer_config.json, chat_template.jinja.

A GGUF keeps its vocabulary as metadata (`tokenizer.ggml.tokens`, `merges`, `token_type`, `scores`,
the special token ids, the chat template). transformers knows how to turn those into its own fast
tokenizer (byte-level BPE for `gpt2`, sentencepiece BPE for `llama`, with the pre-tokenizer split the
file's `tokenizer.ggml.pre` names); we hand the metadata to that converter. Its public loader
(`AutoTokenizer.from_pretrained(gguf_file=...)`) needs PyTorch to read the file, which we neither have nor
need: the metadata comes from our own reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from provider.models.gguf.reader import GgufError, GgufHeader

_KEYS = {  # tokenizer.ggml.<key> -> the converter's name
    "model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
    "token_type": "token_type", "merges": "merges", "precompiled_charsmap": "precompiled_charsmap",
    "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
    "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space",
}
TOKENIZER_TYPES = ("gpt2", "llama")  # byte-level BPE, sentencepiece BPE
# Ids that end a turn besides eos (Llama 3's <|eot_id|> and <|eom_id|>).
_END_IDS = ("eos_token_id", "eot_token_id", "eom_token_id")


def eos_ids(header: GgufHeader) -> list[int]:
    ids = [header.get(f"tokenizer.ggml.{key}") for key in _END_IDS]
    found = list(dict.fromkeys(i for i in ids if isinstance(i, int)))
    if not found:
        raise GgufError(f"{header.path.name}: no tokenizer.ggml.eos_token_id: generation could never end")
    return found


def chat_template(header: GgufHeader, override: str | None) -> str:
    template = override if override is not None else header.get("tokenizer.chat_template")
    if not isinstance(template, str) or not template.strip():
        raise GgufError(f"{header.path.name}: no chat template (tokenizer.chat_template); give one with "
                        "--chat-template FILE")
    return template


def check(header: GgufHeader) -> None:
    """The file describes a tokenizer this import can build (before any work is done)."""
    kind = header.get("tokenizer.ggml.model")
    tokens = header.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise GgufError(f"{header.path.name}: no tokenizer (tokenizer.ggml.model / tokens missing)")
    if kind not in TOKENIZER_TYPES:
        raise GgufError(f"{header.path.name}: tokenizer {kind!r} is not imported (known: {', '.join(TOKENIZER_TYPES)})")
    if kind == "gpt2" and not header.get("tokenizer.ggml.merges"):
        raise GgufError(f"{header.path.name}: a byte-level BPE tokenizer without merges")
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        token_id = header.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise GgufError(f"{header.path.name}: tokenizer.ggml.{key} {token_id} is outside its {len(tokens)} tokens")


def write_tokenizer(header: GgufHeader, out: Path, template: str) -> None:
    """The tokenizer files into `out` (an existing folder)."""
    from transformers import PreTrainedTokenizerFast

    try:  # transformers 5.18 moved the converter here and made it read `tokenizer.ggml.pre`
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError as exc:
        import transformers

        raise GgufError(f"the tokenizer import needs transformers >= 5.18 (this is {transformers.__version__})") from exc

    fields: dict[str, Any] = {name: header.get(f"tokenizer.ggml.{key}") for key, name in _KEYS.items()}
    fields = {name: value for name, value in fields.items() if value is not None}
    backend, _ = convert_gguf_tokenizer(header.architecture, fields)
    tokens = fields["tokens"]

    def token(key: str) -> str | None:
        token_id = header.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if isinstance(token_id, int) else None

    add_bos = header.get("tokenizer.ggml.add_bos_token")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"), chat_template=template,
        add_bos_token=bool(add_bos) if add_bos is not None else fields["tokenizer_type"] == "llama",
        add_eos_token=bool(header.get("tokenizer.ggml.add_eos_token", False)),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(out))


__all__ = ["TOKENIZER_TYPES", "chat_template", "check", "eos_ids", "write_tokenizer"]

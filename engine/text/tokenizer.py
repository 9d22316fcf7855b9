"""Tokenizers built with the ``tokenizers`` library, from GGUF metadata or ``tokenizer.json``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.loader.errors import UnsupportedModelError
from engine.text.chat_template import ChatTemplate

_SPECIAL = 3  # llama.cpp token type CONTROL
# GGUF pre-tokenizer names whose regex is GPT-2's byte-level one, and whether digits are split
# one by one before it (SmolLM's tokenizer.json is Digits(individual) + ByteLevel).
_PRE = {"smollm": True, "gpt2": False, "default": False}


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, bos_token_id: int | None,
                 eos_token_id: int | None, chat_template: str | None,
                 revision: str) -> None:
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.revision = revision
        bos = tokenizer.id_to_token(bos_token_id) if bos_token_id is not None else ""
        eos = tokenizer.id_to_token(eos_token_id) if eos_token_id is not None else ""
        self.chat_template = ChatTemplate(chat_template, bos or "", eos or "") \
            if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids as ``encode``, through ``encode_batch``, which lets other Python
        threads run while it works (``encode`` holds the GIL: a 1 MB text held it ~0.5 s).
        For a worker thread, so a long text does not stall the caller's event loop."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            kwargs: dict[str, Any] | None = None) -> str:
        """``ChatTemplate.render``; ``kwargs``: more template variables."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self.chat_template.render(messages, add_generation_prompt,
                                         continue_final_message, **(kwargs or {}))

    @classmethod
    def from_gguf(cls, path: str | Path) -> TextTokenizer:
        from engine.loader.gguf_read import GGUFFile  # metadata only (no torch: the gateway)

        reader = GGUFFile(Path(path).resolve())

        def get(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        model = get("tokenizer.ggml.model")
        pre = get("tokenizer.ggml.pre", "default")
        if model != "gpt2" or pre not in _PRE:
            raise UnsupportedModelError(
                f"{Path(path).name}: tokenizer {model!r} with pre-tokenizer {pre!r} is not "
                "supported (supported: byte-level BPE 'gpt2' with pre " + ", ".join(_PRE) + ")"
            )
        tokens: list[str] = get("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        types = get("tokenizer.ggml.token_type", [1] * len(tokens))
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if _PRE[pre] else byte_level
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True) if kind == _SPECIAL
        ])
        digest = hashlib.sha256("\n".join(tokens).encode())
        digest.update("\n".join(" ".join(m) for m in merges).encode())
        bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        if get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                special_tokens=[(tokens[bos], bos)],
            )
        return cls(tok, bos_token_id=bos, eos_token_id=eos,
                   chat_template=get("tokenizer.chat_template"),
                   revision=digest.hexdigest()[:12])

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> TextTokenizer:
        path = Path(path)
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}

        def token_id(name: str) -> int | None:
            value = cfg.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        digest = hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()[:12]
        # tokenizer.json's own post-processor adds BOS where the model wants it.
        return cls(tok, bos_token_id=token_id("bos_token"), eos_token_id=token_id("eos_token"),
                   chat_template=template, revision=digest)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    """From an HF directory or a GGUF file; the bundled model's names (``bundled``) are
    resolved as ``--model``'s are (so ``--model tiny:49152 --tokenizer bundled`` works)."""
    from engine.loader.paths import resolve_model_path

    path = Path(resolve_model_path(path))
    if path.is_dir():
        return TextTokenizer.from_hf_dir(path)
    return TextTokenizer.from_gguf(path)

"""Text side of the engine (tokenizer, chat template, detokenizer). Runs in the gateway
process; replicas only ever see token ids."""

from engine.text.chat_template import ChatTemplate
from engine.text.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ChatTemplate", "TextTokenizer", "load_tokenizer"]

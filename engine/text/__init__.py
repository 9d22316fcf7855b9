"""Text side of the engine (tokenizer, chat template, detokenizer). Runs in the gateway
process; replicas only ever see token ids."""

from engine.text.chat_template import ChatTemplate
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_checker import StopChecker, StopResult
from engine.text.stream import TextDelta, TextResult, TextStream, generate_text
from engine.text.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopChecker", "StopResult", "TextDelta",
           "TextResult", "TextStream", "TextTokenizer", "generate_text", "load_tokenizer"]

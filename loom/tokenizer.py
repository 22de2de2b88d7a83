"""The model directory's tokenizer: `tokenizer.json` through the `tokenizers` library, and the
chat template of `tokenizer_config.json` rendered with jinja2."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it ships none (prompts must then be token ids)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(HFTokenizer.from_file(str(path)), config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Renders the conversation; without a template, concatenates the contents plainly."""
        if not self.chat_template:
            text = "\n".join(m["content"] for m in messages)
            return text + "\n" if add_generation_prompt else text
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.apply_chat_template(messages)
        # A template that writes BOS itself must not get a second one from the post-processor.
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not has_bos)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return token.get("content")
    return token


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)

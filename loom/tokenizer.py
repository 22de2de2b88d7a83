"""The model directory's tokenizer: `tokenizer.json` through the `tokenizers` library, and its
chat templates rendered with jinja2 as transformers renders them.

Chat templates are found where transformers keeps them: `chat_template.jinja` (the default)
and `additional_chat_templates/NAME.jinja`, which take precedence over `tokenizer_config.json`'s
`chat_template`, a string or a list of `{"name", "template"}` entries."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def read_chat_templates(model_dir: Path, config: dict[str, Any]) -> dict[str, str]:
    """Name -> template source; the model's own template is named "default"."""
    templates: dict[str, str] = {}
    if (model_dir / "chat_template.jinja").is_file():
        templates["default"] = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        templates |= {f.stem: f.read_text(encoding="utf-8") for f in sorted(extra.glob("*.jinja"))}
    if templates:
        return templates
    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):
        return {t["name"]: t["template"] for t in entry}
    return {}


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], chat_templates: dict[str, str] | None = None,
                 source: str = "the model directory") -> None:
        self._tok = tokenizer
        self.config = config
        self.chat_templates = chat_templates or {}
        self.source = source
        # what templates may refer to by name, as transformers passes them: bos_token, eos_token, ...
        self.special_tokens = {key: text for key, value in config.items()
                               if key.endswith("_token") and isinstance(text := _token_text(value), str)}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
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
        return cls(HFTokenizer.from_file(str(path)), config, read_chat_templates(model_dir, config), str(model_dir))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_template(self, name: str | None = None) -> str:
        """The template called `name`, or the model's own ("default", or its only one)."""
        if not self.chat_templates:
            raise ValueError(f"messages: {self.source} has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template); send a prompt instead")
        if name is None:
            if "default" in self.chat_templates or len(self.chat_templates) > 1:
                name = "default"
            else:
                name = next(iter(self.chat_templates))
        if name not in self.chat_templates:
            raise ValueError(f"chat_template: {self.source} has no template {name!r} "
                             f"(it has {sorted(self.chat_templates)})")
        return self.chat_templates[name]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs: Any) -> str:
        """Renders the conversation with the model's chat template (or the named one); extra
        keyword arguments reach the template as variables, as in transformers."""
        compiled = _compile(self.chat_template(template))
        try:
            return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the chat template refused them ({e})") from None

    def encode_chat(self, messages: list[dict[str, Any]], template: str | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, template=template)
        # A template that writes BOS itself must not get a second one from the post-processor.
        has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not has_bos)


_compiled: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    """A chat template in the environment transformers renders them in: sandboxed, blocks
    trimmed, loop controls, `tojson` without HTML escaping, `raise_exception`, `strftime_now`."""
    if source not in _compiled:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _compiled[source] = env.from_string(source)
    return _compiled[source]


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return token.get("content")
    return token


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)

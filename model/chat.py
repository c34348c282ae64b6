"""Chat prompts: a checkpoint's chat template, rendered with jinja2 as transformers'
`apply_chat_template(messages, add_generation_prompt=True)` renders it (the same sandboxed environment,
filters and globals), without importing transformers."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from model.tokenizer import read_json


def load_chat_template(directory: Path | None) -> str | None:
    """The default chat template of a tokenizer directory, where AutoTokenizer finds it:
    chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or a list of named
    templates of which "default" is used). None when there is none."""
    if directory is None:
        return None
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    config = directory / "tokenizer_config.json"
    template = read_json(config).get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        if "default" not in named:
            raise ValueError(
                f"{config} holds chat templates named {', '.join(map(str, named))} but none named "
                "'default': name one 'default', or give a plain prompt (chat=false)"
            )
        template = named["default"]
    return template if isinstance(template, str) else None


def read_messages(path: str | Path) -> list[dict]:
    """A chat from a JSON file: a list of {"role": ..., "content": ...} objects."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"messages={path}: no such file; give a JSON file holding a list of messages")
    try:
        messages = json.loads(file.read_text(encoding="utf-8-sig"))  # (-sig: a BOM, as Windows tools write)
    except UnicodeDecodeError as err:
        raise ValueError(f"messages={path} is not UTF-8 text ({err}): save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"messages={path} is not valid JSON ({err})") from None
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ValueError(
            f'messages={path} must hold a non-empty JSON list of {{"role": ..., "content": ...}} objects'
        )
    return messages


@lru_cache
def compile_template(template: str):  # -> jinja2.Template
    """The template in transformers' environment: sandboxed, blocks trimmed, loop controls, its
    `tojson` (no HTML escaping, non-ASCII kept), `raise_exception`, `strftime_now`, and the
    `{% generation %}` tag (which marks assistant text for training masks, rendered as plain text)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2's own class attribute)

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        options = dict(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        return json.dumps(x, **options)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def alias_reasoning(message: dict) -> dict:
    """`message` with its reasoning, if it has any, also under `thinking` and `reasoning_content`."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str]) -> str:
    """The prompt text of `messages` followed by the assistant's turn header, as
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` renders it; the
    template sees the tokenizer's named special tokens (bos_token, eos_token, ...). A template that
    fails raises ValueError with its message on one line."""
    import jinja2

    # transformers drops keys whose value is None (templates test for absent keys), and gives an
    # assistant's reasoning under each name templates read it by (Qwen3's reasoning_content, gpt-oss's
    # thinking), whichever of them (or `reasoning`) the message used.
    messages = [alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
    try:
        return compile_template(template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=True, **special_tokens
        )
    except Exception as err:  # a template is data from the checkpoint: any failure of it is a user error
        kind = "" if isinstance(err, jinja2.TemplateError) else f"{type(err).__name__}: "
        message = " ".join(str(err).split())
        raise ValueError(f"the chat template failed to render: {kind}{message}") from None

"""Chat room: render Hugging Face-style Jinja chat templates in a sandbox."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

# jinja2 is imported where a template is first compiled, not here: `fantai generate` with a plain
# prompt renders no template, and the import was ~30 ms of its start-up.


class ChatTemplateError(ValueError):
    """A chat template raised (raise_exception) or could not be rendered."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF templates expect non-ASCII kept as is (jinja2's own tojson escapes HTML characters).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _flatten_content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "\n".join(texts)


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages with list-of-parts content joined into one string."""
    return [{**m, "content": _flatten_content(m.get("content"))} if "content" in m else dict(m)
            for m in messages]


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """Render `template` like transformers' apply_chat_template(tokenize=False) does."""
    import jinja2

    try:
        return compile_template(template).render(
            messages=normalize_messages(messages), tools=tools,
            add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **kwargs,
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e

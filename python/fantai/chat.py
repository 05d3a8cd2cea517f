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


# A template comes with the model file, from the internet: its rendering is bounded in output size,
# in the size of any string or list it builds, and in time, and a template past a bound fails like
# any broken template (a ChatTemplateError, a 400 on the server). The bounds are far above what a
# real chat template needs for a prompt the engine could take.
MAX_RENDER_CHARS = 16 << 20
MAX_RENDER_SECONDS = 2.0
_MAX_SEQUENCE = 1 << 24


def _bounded_binop(op: str, left: Any, right: Any) -> Any:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_SEQUENCE:
                raise ChatTemplateError(f"chat template builds a sequence of {len(seq) * n} items")
        return left * right
    if op == "**":
        if isinstance(right, int) and abs(right) > 64:
            raise ChatTemplateError(f"chat template raises to the power {right}")
        return left**right
    raise ChatTemplateError(f"operator {op} is not allowed")  # not reached: only * and ** are intercepted


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per distinct template text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            return _bounded_binop(operator, left, right)

    env = BoundedEnvironment(
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
        compiled = compile_template(template)
        return _bounded_render(compiled, dict(
            messages=normalize_messages(messages), tools=tools,
            add_generation_prompt=add_generation_prompt, bos_token=bos_token,
            eos_token=eos_token, **kwargs,
        ))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("chat template recursed too deeply") from e
    except MemoryError as e:
        raise ChatTemplateError("chat template ran out of memory") from e


def _bounded_render(compiled: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render in chunks under a size bound, with a line tracer on the template's own code that
    stops a loop running past the time bound (a loop with no output never yields a chunk)."""
    import sys
    import time

    deadline = time.monotonic() + MAX_RENDER_SECONDS
    ticks = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != "<template>":
            return None  # only the template's compiled code pays for tracing
        return line_tracer

    def line_tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal ticks
        ticks += 1
        if ticks & 1023 == 0 and time.monotonic() > deadline:
            raise ChatTemplateError(f"chat template ran longer than {MAX_RENDER_SECONDS} s")
        return line_tracer

    parts: list[str] = []
    size = 0
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise ChatTemplateError(f"chat template output exceeds {MAX_RENDER_CHARS} characters")
            parts.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(parts)

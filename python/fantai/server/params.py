"""Server room: request fields -> engine SamplingParams, with the checks that answer 400."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from fantai.sampling_params import SamplingParams
from fantai.server.errors import APIError
from fantai.server.protocol import ResponseFormat, SamplingFields
from fantai.structured import StructuredOutputsParams

# vLLM's structured_outputs keys that tune a backend rather than name a constraint: accepted,
# and llguidance needs none of them.
_TUNING_KEYS = frozenset({"disable_fallback", "disable_any_whitespace", "whitespace_pattern",
                          "disable_additional_properties", "backend"})
_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class GenerationDefaults:
    """Defaults a model's generation_config.json supplies for fields a request leaves unset."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    @classmethod
    def load(cls, source: str | None, model_path: str | None) -> GenerationDefaults:
        """`source`: 'auto' (the model folder's file), 'none', or a folder / JSON file path."""
        if source in (None, "none", "vllm", "fantai"):
            return cls()
        path = model_path if source == "auto" else source
        if path is None or (source == "auto" and not os.path.isdir(path)):
            return cls()  # a GGUF file carries no generation_config.json
        if os.path.isdir(path):
            path = os.path.join(path, "generation_config.json")
        if not os.path.isfile(path):
            if source == "auto":
                return cls()
            raise FileNotFoundError(f"generation config not found: {path}")
        with open(path, encoding="utf-8") as f:
            raw: dict[str, Any] = json.load(f)
        if "max_new_tokens" in raw:
            raw["max_tokens"] = raw["max_new_tokens"]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def _pick(value: Any, default: Any, fallback: Any) -> Any:
    if value is not None:
        return value
    return fallback if default is None else default


def check_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int,
                     default: int | None = None) -> int:
    """The number of tokens to generate; 400 when it cannot fit beside the prompt."""
    if max_tokens is not None and max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if prompt_len >= max_model_len:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens, but the "
                       f"prompt has {prompt_len} tokens. Please shorten the prompt.",
                       param="messages", code="context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room if default is None else min(default, room)
    if max_tokens > room:
        raise APIError(f"This model's maximum context length is {max_model_len} tokens. However, "
                       f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                       f"prompt, {max_tokens} for the completion). Please reduce the prompt or "
                       f"max_tokens.", param="max_tokens", code="context_length_exceeded")
    return max_tokens


def parse_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"Invalid key in logit_bias: {key!r} is not a token id.",
                           param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise APIError(f"Invalid key in logit_bias: token id {token} is outside the "
                           f"vocabulary [0, {vocab_size}).", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise APIError(f"Invalid value in logit_bias for token {token}: {value} is not in "
                           "[-100, 100].", param="logit_bias")
        out[token] = float(value)
    return out


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(f"Token id {bad[0]} in '{param}' is outside the vocabulary "
                       f"[0, {vocab_size}).", param=param)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise APIError("Stop strings must be non-empty.", param="stop")
    return stops


def format_constraint(fmt: ResponseFormat | None, param: str = "response_format"
                      ) -> StructuredOutputsParams | None:
    """OpenAI's response_format (text, json_object, json_schema) as a constraint."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    if schema is None:
        raise APIError(f"'{param}.json_schema.schema' is required when type is 'json_schema'.",
                       param=param)
    return StructuredOutputsParams(json=schema if isinstance(schema, dict) else json.dumps(schema))


def structured_from_request(req: SamplingFields) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for, from whichever field it used."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = format_constraint(req.response_format)
    if fmt is not None:
        found.append(("response_format", fmt))
    if req.structured_outputs:
        so = req.structured_outputs
        unknown = sorted(set(so) - set(_CONSTRAINT_KEYS) - _TUNING_KEYS)
        if unknown:
            raise APIError(f"Unsupported key(s) in structured_outputs: {', '.join(unknown)}.",
                           param="structured_outputs")
        picked = {k: so[k] for k in _CONSTRAINT_KEYS if so.get(k) is not None}
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**picked)))
        except (TypeError, ValueError) as exc:
            raise APIError(str(exc), param="structured_outputs") from None
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            try:
                found.append((name, StructuredOutputsParams(**{key: value})))
            except ValueError as exc:
                raise APIError(str(exc), param=name) from None
    if len(found) > 1:
        raise APIError("Give one output constraint per request; got "
                       f"{', '.join(n for n, _ in found)}.", param=found[1][0])
    return found[0][1] if found else None


def constraint_param(req: SamplingFields) -> str:
    """The request field that carried the constraint (for a 400 naming it)."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar"):
        if getattr(req, name):
            return name
    return "tools"


def build_sampling_params(req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                          defaults: GenerationDefaults, vocab_size: int,
                          stop: list[str] | None = None) -> SamplingParams:
    """SamplingParams from the shared OpenAI/vLLM fields; `stop` overrides req.stop."""
    if req.best_of is not None and req.best_of < req.n:
        raise APIError(f"best_of must be >= n, got best_of={req.best_of} and n={req.n}.",
                       param="best_of")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError("best_of > n cannot be streamed.", param="best_of")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options needs stream: true.", param="stream_options")
    check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
    top_k = _pick(req.top_k, defaults.top_k, 0)
    try:
        return SamplingParams(
            n=req.n, best_of=req.best_of,
            temperature=_pick(req.temperature, defaults.temperature, 1.0),
            top_p=_pick(req.top_p, defaults.top_p, 1.0), top_k=max(int(top_k), 0),
            min_p=_pick(req.min_p, defaults.min_p, 0.0),
            repetition_penalty=_pick(req.repetition_penalty, defaults.repetition_penalty, 1.0),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=stop if stop is not None else stop_list(req.stop),
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            logprobs=logprobs, logit_bias=parse_logit_bias(req.logit_bias, vocab_size),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured_from_request(req))
    except ValueError as exc:
        raise APIError(str(exc)) from None

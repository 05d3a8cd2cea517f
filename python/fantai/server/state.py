"""Server room: the configuration and runtime context every route reads (engine, names, metrics)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from fantai.server.errors import APIError
from fantai.server.metrics import ServerMetrics
from fantai.server.params import GenerationDefaults
from fantai.server.reasoning import ReasoningParser, get_reasoning_parser
from fantai.server.tool_parsers import ToolParser, get_parser

logger = logging.getLogger("fantai.server")


@dataclass(slots=True)
class ServerConfig:
    """What `fantai serve` options decide about the HTTP layer (the engine takes the rest)."""

    served_model_names: list[str]
    api_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    tool_call_parser: str | None = "hermes"
    reasoning_parser: str | None = None
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (LRU)
    generation_config: str | None = "auto"
    disable_log_requests: bool = False
    max_waiting_requests: int = 1024  # beyond the running batch; then 503 + Retry-After
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass(slots=True)
class ServerContext:
    engine: Any  # fantai.engine.AsyncEngine (duck-typed so tests and tools can stand in)
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    responses: Any = None  # fantai.server.responses_api.ResponseStore
    draining: bool = False
    active: set[str] = field(default_factory=set)  # engine request ids in flight

    @classmethod
    def create(cls, engine: Any, config: ServerConfig) -> ServerContext:
        parser = get_parser(config.tool_call_parser) if config.tool_call_parser else None
        defaults = GenerationDefaults.load(config.generation_config,
                                           getattr(engine, "model_path", None))
        reasoning = (get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser
                     else None)
        return cls(engine=engine, config=config, defaults=defaults, tool_parser=parser,
                   reasoning_parser=reasoning)

    @property
    def fault(self) -> str | None:
        """Why the engine failed, once it has (then /health is 503, generation routes refuse with
        503 and the process exits non-zero: see launch.exit_on_engine_fault)."""
        return getattr(self.engine, "fault", None)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        names = self.config.served_model_names
        if requested is None or requested == "":
            return names[0]
        if requested in names:
            return requested
        raise APIError(f"The model '{requested}' does not exist. This server serves: "
                       f"{', '.join(names)}.", status=404, param="model", code="model_not_found")

    def abort_all(self) -> int:
        """Abort every in-flight engine request (end of a shutdown grace period); their streams
        then end normally with finish_reason 'abort'."""
        ids = list(self.active)
        for request_id in ids:
            self.engine.abort(request_id)
        return len(ids)

    def log_request(self, request_id: str, num_prompt_tokens: int, params: Any) -> None:
        if not self.config.disable_log_requests:
            logger.info("request %s: %d prompt tokens, %s", request_id, num_prompt_tokens, params)

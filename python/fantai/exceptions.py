"""Errors the async engine raises into a request's generator (stdlib only, so the server and
tests can name them without loading the compiled core)."""


class EngineDeadError(RuntimeError):
    """The engine failed (a step raised an engine fault, or the output dispatcher died): the
    request cannot finish and no new one is taken. The process should exit and be restarted.
    Its message is why the engine failed; in_flight: the request was already in the engine (else
    it was refused before it started)."""

    def __init__(self, message: str, in_flight: bool = True) -> None:
        super().__init__(message)
        self.in_flight = in_flight


class RequestTimeoutError(TimeoutError):
    """The request ran past AsyncEngineArgs.request_timeout; it was aborted in the engine."""

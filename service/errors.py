"""Why the service does not serve a request: one error type with a kind per reason, raised anywhere below HTTP
(admission, the model registry, batching) and mapped to a status, and under /v1/ to OpenAI's shape, once, at the
edge (service/api/errors.py). The message says what is wrong and names the field at fault."""

from __future__ import annotations

MAX_NAME_SHOWN = 64  # characters of a name a client sent, echoed back: it may have sent a megabyte of it


def shown(name: str) -> str:
    """A name a client sent, cut to MAX_NAME_SHOWN characters for an answer."""
    return name[:MAX_NAME_SHOWN] + "..." if len(name) > MAX_NAME_SHOWN else name


class ServiceError(Exception):
    """A request refused, with why, and the field of the request it concerns (`sentences[3]`), if one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @property
    def detail(self) -> str:
        """What the client reads: the field first, as every error of the API says it."""
        return f"{self.field}: {self}" if self.field else str(self)


class InvalidRequest(ServiceError):
    """The request is malformed for this model (a field out of range, an empty sentence): 422."""


class TooLarge(ServiceError):
    """The request is over a limit it can never fit under; retrying is no use: 413."""


class Overloaded(ServiceError):
    """A budget or queue is full now; the same request may be served later: 503 with Retry-After."""


class NotReady(ServiceError):
    """The server is starting or stopping: 503 with Retry-After."""


class UnknownModel(ServiceError):
    """The request named a model this server does not serve: 404."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(f"unknown model {shown(name)!r}; this server serves: {', '.join(known)}", "model")


class ClientGone(ServiceError):
    """The client closed the request before it was answered: the work for it stopped (499 in the metrics)."""

    def __init__(self) -> None:
        super().__init__("client closed the request")


class EngineFailed(ServiceError):
    """The engine failed on this request's own sentences (out of memory, say): 503, retry."""

"""What can stop a request from reaching a machine, each with the HTTP status it becomes."""

from __future__ import annotations


class ProxyError(Exception):
    """Base: `status` is the HTTP status the client gets, the message is the reason."""

    status = 502


class UnknownApp(ProxyError):
    """No app of that name (or the Host names no app under the proxy's domain)."""

    status = 404


class NoBackend(ProxyError):
    """The app exists but nothing can serve now (none started or startable, all over hard
    limit past the queue wait, every worker of it dead)."""

    status = 503


class BadRequest(ProxyError):
    """A request the edge will not pass on as it is (its connection ends after the answer)."""

    status = 400


class UnsupportedCoding(BadRequest):
    """A transfer coding other than chunked: the edge would drop it when it frames the body."""

    status = 501


class UnsupportedVersion(BadRequest):
    """Not HTTP/1.1 or 1.0."""

    status = 505


class Forbidden(ProxyError):
    """The request asked for something its token (or its lack of one) does not allow."""

    status = 403


class HeadersTooLarge(ProxyError):
    status = 431


class BodyTooLarge(ProxyError):
    status = 413


class UpstreamTimeout(ProxyError):
    status = 504

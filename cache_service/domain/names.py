"""The one check of the names a client gives (namespaces, session ids), at the service boundary.

The rule is the key table's (:func:`cache_service.storage.keys.check_name`): every name may end
up inside a Redis key, so a name the service accepts can always be stored.
"""

from __future__ import annotations

from cache_service.domain.errors import InvalidArgument
from cache_service.storage.keys import MAX_NAME_LEN, check_name

MIN_CLIENT_ID = 16  # characters of a client-chosen session id: long enough not to collide by chance


def namespace_name(name: str) -> str:
    """``name`` if it may name a namespace, else :class:`InvalidArgument`.

    >>> namespace_name("acme/llama2")
    'acme/llama2'
    """
    return _checked(name, "namespace")


def session_id(sid: str) -> str:
    """``sid`` if it may name a session (one storage could hold), else :class:`InvalidArgument`."""
    return _checked(sid, "session id")


def client_session_id(sid: str) -> str:
    """A session id a client chose: :func:`session_id`, and long enough not to collide."""
    if not MIN_CLIENT_ID <= len(sid) <= MAX_NAME_LEN:
        raise InvalidArgument(f"a client-chosen session id needs {MIN_CLIENT_ID}-{MAX_NAME_LEN} characters")
    return session_id(sid)


def _checked(name: str, what: str) -> str:
    if len(name) > MAX_NAME_LEN:  # not echoed: the answer would carry all of it back
        raise InvalidArgument(f"{what} of {len(name)} characters exceeds {MAX_NAME_LEN}")
    try:
        return check_name(name, what=what)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc

"""The one check of the names a client gives (namespaces, session ids, commit keys, tokenizer
fingerprints), at the service boundary.

The rule is the key table's (:func:`cache_service.storage.keys.check_name`): every name may end
up inside a Redis key, so a name the service accepts can always be stored.
"""

from __future__ import annotations

import re

from cache_service.domain.errors import InvalidArgument
from cache_service.storage.keys import MAX_NAME_LEN, check_name
from cache_service.storage.stream_log import MAX_KEY_LEN
from indexer.fingerprint import check_fingerprint

MIN_CLIENT_ID = 16  # characters of a client-chosen session id: long enough not to collide by chance
# A commit key (the same in every retry of a request's commit): long enough not to collide by
# chance, short enough to keep many of in storage (see cache_service.storage.stream_log).
MIN_COMMIT_KEY, MAX_COMMIT_KEY = 16, MAX_KEY_LEN
_COMMIT_KEY = re.compile(r"[A-Za-z0-9._:-]+")


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


def commit_key(key: str) -> str:
    """``key`` if it may name a commit: empty (none), or :data:`MIN_COMMIT_KEY` to
    :data:`MAX_COMMIT_KEY` characters of ``A-Z a-z 0-9 . _ : -``; else :class:`InvalidArgument`.

    >>> commit_key("9f86d081884c7d659a2feaa0c55ad015")
    '9f86d081884c7d659a2feaa0c55ad015'
    >>> commit_key("short")
    Traceback (most recent call last):
    ...
    cache_service.domain.errors.InvalidArgument: a commit key needs 16-64 characters of [A-Za-z0-9._:-], got 5
    """
    if key and not (MIN_COMMIT_KEY <= len(key) <= MAX_COMMIT_KEY and _COMMIT_KEY.fullmatch(key)):
        # Not echoed: the answer would carry all of it back.
        raise InvalidArgument(
            f"a commit key needs {MIN_COMMIT_KEY}-{MAX_COMMIT_KEY} characters of [A-Za-z0-9._:-], got {len(key)}"
        )
    return key


def tokenizer(fingerprint: str) -> str:
    """``fingerprint`` if it may name a tokenizer (:mod:`indexer.fingerprint`; "": not stated),
    else :class:`InvalidArgument`.

    >>> tokenizer(""), tokenizer("0123456789abcdef")
    ('', '0123456789abcdef')
    """
    try:
        return check_fingerprint(fingerprint)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc


def _checked(name: str, what: str) -> str:
    if len(name) > MAX_NAME_LEN:  # not echoed: the answer would carry all of it back
        raise InvalidArgument(f"{what} of {len(name)} characters exceeds {MAX_NAME_LEN}")
    try:
        return check_name(name, what=what)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc

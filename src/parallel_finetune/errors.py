"""The one exception type a user should ever see as a message instead of a traceback."""


class UserError(Exception):
    """Bad input (config, data, layout, paths). The CLI prints `error: <message>` on one line and exits 2.

    The message names the file, key or value at fault and what would be valid.
    """


class RankError(UserError):
    """A problem one rank found alone (a collective that timed out): every rank that meets it prints it, since the
    others may be the ones that stopped."""


def one_line(exc: BaseException) -> str:
    """An exception as one short line; an OSError as its reason and path ("No space left on device: /x/y")."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"

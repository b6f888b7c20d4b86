"""The one exception type a user should ever see as a message instead of a traceback."""


class UserError(Exception):
    """Bad input (config, data, layout, paths). The CLI prints `error: <message>` on one line and exits 2.

    The message names the file, key or value at fault and what would be valid.
    """

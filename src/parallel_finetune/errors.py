"""The one exception type a user should ever see as a message instead of a traceback."""

import argparse
import shutil
import sys


class UserError(Exception):
    """Bad input (config, data, layout, paths). The CLI prints `error: <message>` on one line and exits 2.

    The message names the file, key or value at fault and what would be valid.
    """


class RankError(UserError):
    """A problem one rank found alone (a collective that timed out): every rank that meets it prints it, since the
    others may be the ones that stopped."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped the run: the CLI prints the message on one line and exits 130 (128 + SIGINT)."""


def one_line(exc: BaseException, folder=None) -> str:
    """An exception as one short line; an OSError as its reason and path ("No space left on device: /x/y").
    With `folder` (being written when `exc` happened): if its file system is full, say so first, since torch's
    and safetensors' writers turn ENOSPC into errors that no longer do."""
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    else:
        text = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    if folder is not None and "No space left on device" not in text:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return text
        if free < 2**20:
            return f"No space left on device ({free:,} bytes free under {folder}); {text}"
    return text


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse for the command lines (scripts/, `-m parallel_finetune.train`): a bad argument is one `error:` line
    and exit 2, as a UserError is; argparse's own prints the usage block first. Defined here, beside UserError, so a
    script refuses its arguments before it imports torch (errors.py imports nothing of the package)."""

    def error(self, message: str):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

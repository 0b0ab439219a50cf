"""The errors a user's input (or the run's environment) can cause; runners print them as one line and exit with
status 2.

A leaf module: each such error class subclasses `UserError` where it is defined (config, data, model,
checkpoint, vLLM server, run lock, non-finite steps, metrics writes), so catching them imports nothing else."""


class UserError(Exception):
    """Bad input or environment, reported as one line (exit status 2), not a bug in this code. A vLLM server
    that stays unreachable after the retries, or refuses the policy adapter, is one too (ServerError)."""


def one_line(e: BaseException) -> str:
    """An exception as one line: 'Type: message', the message's whitespace (newlines included) collapsed."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__

"""The errors a user's input (or the run's environment) can cause; runners print them as one line and exit with
status 2.

A leaf module: each such error class subclasses `UserError` where it is defined (config, data, model,
checkpoint, vLLM server, run lock, non-finite steps, metrics writes), so catching them imports nothing else."""


class UserError(Exception):
    """Bad input or environment, reported as one line (exit status 2), not a bug in this code. A vLLM server
    that stays unreachable after the retries, or refuses the policy adapter, is one too (ServerError)."""


def one_line(e: BaseException) -> str:
    """An exception as one line: 'Type: message', the message's whitespace (newlines included) collapsed. Total:
    an exception whose message cannot be made (its __str__ raises: a user's tool may raise anything) is its type
    name and a note."""
    try:
        name = type(e).__name__
        name = name if isinstance(name, str) else "Exception"
    except Exception:  # noqa: BLE001 -- a metaclass can make even the name raise
        name = "Exception"
    try:
        text = " ".join(str(e).split())
    except Exception:  # noqa: BLE001 -- str() of a hostile exception: name it, never raise
        text = "(its message cannot be shown)"
    return f"{name}: {text}" if text else name

"""The one exception type that reaches users as a message instead of a traceback."""


class UserError(Exception):
    """A problem with something the user gave us (a file, a field, a value).

    The message is one sentence that names the file, field or value; the CLI prints it and exits
    non-zero. Everything else is a bug and keeps its traceback.
    """

"""The one exception type that reaches users as a message instead of a traceback."""


class UserError(Exception):
    """A problem with something the user gave us (a file, a field, a value).

    The message is one sentence that names the file, field or value; the CLI prints it and exits
    non-zero. Everything else is a bug and keeps its traceback.
    """


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the interrupted work leaves behind (`left`: "the results finished so far are in
    out.jsonl ..."), for the CLI's one line. A plain KeyboardInterrupt leaves nothing: outputs are written
    whole or not at all."""

    def __init__(self, left: str):
        super().__init__(left)
        self.left = left

"""The error type of the command line: raised for bad user input, printed as one line, exit code 2."""


class UserError(Exception):
    """An error caused by the user's input: reported as one line, exit code 2."""

"""The error type of the command line: raised for bad user input, printed as one line, exit code 2."""


class UserError(Exception):
    """An error caused by the user's input: reported as one line, exit code 2."""


#: Exit code when a run or a program does not fit the machine's (or the target's) memory.
EXIT_DOES_NOT_FIT = 3

"""The error type of the command line (raised for bad user input, printed as one line, exit code 2) and its
other exit codes."""


class UserError(Exception):
    """An error caused by the user's input: reported as one line, exit code 2."""


#: Exit code when a run or a program does not fit the machine's (or the target's) memory.
EXIT_DOES_NOT_FIT = 3

#: Exit code of long work a time box stopped between its parts (``compare --plan``, ``align``): not finished;
#: what it did is kept, and the same command (``align``: with ``--resume``) goes on.
EXIT_STOPPED = 75
